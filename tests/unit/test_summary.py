"""The closing summary: failures by reason, and the table at the end of the task log."""

from __future__ import annotations

import json

from airflow_vllm_batch.manifest import Manifest, RequestCounts, Usage
from airflow_vllm_batch.sharding import sum_manifests
from airflow_vllm_batch.summary import MAX_EXAMPLE_CHARS, render_summary, tally_failures


def error_line(custom_id: str, code: str, message: str) -> bytes:
    return json.dumps(
        {"custom_id": custom_id, "error": {"code": code, "message": message, "line": 1}}
    ).encode()


def manifest(**kwargs) -> Manifest:
    fields = {
        "output_uri": "s3://b/run/results.jsonl",
        "error_uri": "s3://b/run/results.errors.jsonl",
        "input_uri": "s3://b/run/input.jsonl",
        "model": "tiny",
        "request_counts": RequestCounts(total=6, completed=3, failed=3),
        "usage": Usage(prompt_tokens=30, completion_tokens=12, total_tokens=42),
        "duration_s": 40.0,
        "engine_duration_s": 30.0,
        "vllm_version": "0.32.0",
        "fingerprint": "f",
        "manifest_uri": "s3://b/run/results.manifest.json",
        "failed_by_reason": {"engine_error": 2, "invalid_request": 1},
    }
    return Manifest(**{**fields, **kwargs})


def test_failures_are_counted_by_error_code_most_common_first_with_the_first_example_of_each():
    tally = tally_failures(
        [
            error_line("a", "invalid_request", "method must be POST"),
            error_line("b", "engine_error", "boom"),
            b"",
            error_line("c", "engine_error", "bang"),
        ]
    )
    assert tally.counts == {"engine_error": 2, "invalid_request": 1}
    assert list(tally.counts) == ["engine_error", "invalid_request"]
    assert str(tally.examples["engine_error"]) == "b: boom"


def test_an_example_is_one_line_cut_short_with_its_urls_redacted():
    message = "failed\nreading https://s3.example/b/k?X-Amz-Signature=secret " + "x" * 500
    example = tally_failures([error_line("a", "engine_error", message)]).examples["engine_error"]
    assert "secret" not in example.message
    assert "?<redacted>" in example.message
    assert "\n" not in example.message
    assert len(example.message) == MAX_EXAMPLE_CHARS


def test_a_line_without_a_code_counts_as_unknown():
    assert tally_failures([b'{"custom_id": "a", "error": null}']).counts == {"unknown": 1}


def test_the_table_shows_counts_reasons_tokens_time_and_where_the_files_are():
    tally = tally_failures(
        [error_line("r0", "engine_error", "boom"), error_line("bad", "invalid_request", "not POST")]
    )
    table = render_summary(manifest(), tally.examples)
    lines = table.splitlines()
    assert lines[0] == "vLLM batch: 3 of 6 requests completed, 3 failed"
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in lines if line.startswith("| ")}
    assert rows["requests"] == "6 total, 3 completed, 3 failed"
    assert rows["failed: engine_error"] == "2, e.g. r0: boom"
    assert rows["failed: invalid_request"] == "1, e.g. bad: not POST"
    assert rows["tokens"] == "30 prompt + 12 completion = 42 total"
    assert rows["time"] == "engine 30.0 s of task 40.0 s (75 %); outside the engine 10.0 s"
    assert rows["results"] == "s3://b/run/results.jsonl"
    assert rows["errors"] == "s3://b/run/results.errors.jsonl"
    assert rows["manifest"] == "s3://b/run/results.manifest.json"
    assert len({len(line) for line in lines[1:]}) == 1  # a box: every row as wide as the others


def test_a_long_uri_is_never_wrapped():
    uri = "s3://bucket/" + "k" * 200 + "/results.jsonl"
    assert uri in render_summary(manifest(output_uri=uri))


def test_a_reused_output_says_no_engine_ran():
    table = render_summary(manifest(), None, task_s=1.5, resumed=True)
    assert "(reused: no engine ran in this try)" in table.splitlines()[0]
    assert "2 (see the error file)" in table
    assert "this try 1.5 s" in table


def test_a_run_without_failures_has_no_reason_rows_and_no_error_file():
    table = render_summary(
        manifest(request_counts=RequestCounts(6, 6, 0), error_uri=None, failed_by_reason=None)
    )
    assert "failed:" not in table
    assert "none (no request failed)" in table


def test_the_manifest_keeps_failed_by_reason_and_omits_it_when_none_failed():
    stored = Manifest.from_json(manifest().to_json())
    assert stored.failed_by_reason == {"engine_error": 2, "invalid_request": 1}
    assert "failed_by_reason" not in manifest(failed_by_reason=None).to_dict()


def test_the_merge_adds_up_the_shards_reasons():
    shards = [
        {**manifest(failed_by_reason={"engine_error": 1}).to_dict()},
        {**manifest(failed_by_reason={"engine_error": 2, "timeout": 3}).to_dict()},
        {**manifest(failed_by_reason=None).to_dict()},
    ]
    assert sum_manifests(shards)["failed_by_reason"] == {"engine_error": 3, "timeout": 3}
    assert sum_manifests(shards[2:])["failed_by_reason"] is None
