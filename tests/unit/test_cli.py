from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest

from airflow_vllm_batch import cli

REQUEST = (
    '{"custom_id": "%s", "method": "POST", "url": "/v1/chat/completions", '
    '"body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}\n'
)
RESULT = (
    '{"id": "vllm-1", "custom_id": "%s", "response": {"status_code": 200, "request_id": "r", '
    '"body": {"object": "chat.completion", "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}}}, '
    '"error": null}\n'
)


@pytest.fixture
def batch(tmp_path: Path) -> Path:
    path = tmp_path / "input.jsonl"
    path.write_text(REQUEST % "a" + REQUEST % "b")
    return path


def test_validate_clean_file_exits_zero(batch, capsys):
    assert cli.main(["validate", str(batch), "--no-progress"]) == 0
    assert "OK" in capsys.readouterr().out


def test_validate_bad_file_exits_one_and_lists_problem(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(REQUEST % "a" + "not json\n" + REQUEST % "a")
    assert cli.main(["validate", str(path), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "line 2" in out
    assert "not valid JSON" in out
    assert "line 3" in out
    assert "repeats the one on line 1" in out


def test_validate_json_output_is_the_report(batch, capsys):
    assert cli.main(["validate", str(batch), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["valid_lines"] == 2
    assert data["models"] == {"m": 2}


def test_validate_model_option_is_enforced(batch, capsys):
    assert cli.main(["validate", str(batch), "--model", "other", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["invalid_lines"] == 2


def test_validate_supported_url_option_restricts_urls(batch, capsys):
    assert cli.main(["validate", str(batch), "--supported-url", "/v1/embeddings", "--json"]) == 1
    assert "is not served" in capsys.readouterr().out


def test_validate_missing_file_exits_two(tmp_path, capsys):
    assert cli.main(["validate", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot open" in capsys.readouterr().err


def test_stats_prints_outcomes_and_usage(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text((RESULT % "a" + RESULT % "b").rstrip("\n"))
    assert cli.main(["stats", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "completed" in out
    assert "20" in out
    assert "/v1/chat/completions" in out


def test_stats_with_input_reports_missing_answers(tmp_path, batch, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text(RESULT % "a")
    assert cli.main(["stats", str(path), "--input", str(batch), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["missing_count"] == 1
    assert data["missing"][0]["custom_id"] == "b"


def test_stats_reads_s3_through_the_hook(monkeypatch, capsys):
    class FakeObject:
        def get(self):
            return {"Body": io.BytesIO((RESULT % "a").encode()), "ContentLength": 10}

    class FakeHook:
        def __init__(self, aws_conn_id):
            assert aws_conn_id == "my_aws"

        @staticmethod
        def parse_s3_url(uri):
            return "bucket", "key.jsonl"

        def get_key(self, key, bucket_name):
            assert (bucket_name, key) == ("bucket", "key.jsonl")
            return FakeObject()

    monkeypatch.setattr(cli, "s3_hook", lambda conn_id: FakeHook(conn_id))
    assert cli.main(["stats", "s3://bucket/key.jsonl", "--aws-conn-id", "my_aws", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request_counts"]["total"] == 1


def test_validate_reads_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO((REQUEST % "a").encode())))
    assert cli.main(["validate", "-", "--json"]) == 0


def test_progress_bar_goes_to_stderr_when_forced(batch, capsys):
    assert cli.main(["validate", str(batch), "--progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        (
            "request_file",
            REQUEST % "a" + REQUEST % "b",
            "is a request (input) file, not a results file — did you mean `airflow-vllm-batch validate`?",
        ),
        (
            "other_json_objects",
            '{"name": "x"}\n{"name": "y"}\n',
            "is a file of JSON objects that are neither requests nor results",
        ),
        ("empty_file", "", "is empty (no lines), not a results file"),
        ("blank_lines_only", "\n  \n", "is empty (no lines)"),
        ("json_arrays", "[1, 2]\n", "is a JSON file whose lines are not objects"),
        ("plain_text", "hello\n", "is not a JSON Lines file"),
    ],
)
def test_stats_refuses_a_file_that_is_not_a_results_file(tmp_path, capsys, name, content, fragment):
    path = tmp_path / f"{name}.jsonl"
    path.write_text(content)
    assert cli.main(["stats", str(path), "--json"]) == 2
    captured = capsys.readouterr()
    assert fragment in captured.err
    assert str(path) in captured.err
    assert captured.out == ""


def test_stats_refuses_a_results_file_given_as_input(tmp_path, capsys):
    results = tmp_path / "results.jsonl"
    results.write_text(RESULT % "a")
    assert cli.main(["stats", str(results), "--input", str(results)]) == 2
    assert "is a results file, not a request (input) file" in capsys.readouterr().err


def test_stats_keeps_leading_blank_lines_of_a_results_file(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text("\n" + RESULT % "a")
    assert cli.main(["stats", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["request_counts"]["total"], data["blank_lines"]) == (1, 1)


def test_validate_reads_gzip_whatever_the_name(tmp_path, capsys):
    path = tmp_path / "input.jsonl"
    path.write_bytes(gzip.compress((REQUEST % "a" + REQUEST % "b").encode()))
    assert cli.main(["validate", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["valid_lines"], data["compression"]) == (2, "gzip")


def test_stats_reads_gzip_results_and_input(tmp_path, batch, capsys):
    results = tmp_path / "results.jsonl.gz"
    results.write_bytes(gzip.compress((RESULT % "a" + RESULT % "b").encode()))
    inputs = tmp_path / "input.jsonl.gz"
    inputs.write_bytes(gzip.compress(batch.read_bytes()))
    assert cli.main(["stats", str(results), "--input", str(inputs), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request_counts"]["completed"] == 2


def test_validate_a_truncated_gzip_exits_two_naming_the_file(tmp_path, capsys):
    path = tmp_path / "input.jsonl.gz"
    path.write_bytes(gzip.compress((REQUEST % "a").encode() * 200)[:-30])
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err
    assert "gzip file is truncated" in err


def test_validate_a_huge_line_says_more_than_the_limit_not_a_made_up_size(tmp_path, capsys):
    path = tmp_path / "input.jsonl"
    path.write_text(REQUEST % "a" + REQUEST % ("x" * 3_000_000))
    assert cli.main(["validate", str(path), "--json"]) == 1
    message = json.loads(capsys.readouterr().out)["problems"][0]["message"]
    assert "line is more than 1,000,000 bytes" in message
    assert "1,000,001" not in message
    assert "--max-line-bytes" in message


def test_validate_max_line_bytes_option_raises_the_limit(tmp_path, capsys):
    path = tmp_path / "input.jsonl"
    path.write_text(REQUEST % ("x" * 2_000))
    assert cli.main(["validate", str(path), "--max-line-bytes", "1000", "--json"]) == 1
    assert cli.main(["validate", str(path), "--max-line-bytes", "5000", "--json"]) == 0


def test_validate_refuses_a_results_file(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text(RESULT % "a")
    assert cli.main(["validate", str(path)]) == 2
    assert (
        "is a results file, not a request (input) file — did you mean `airflow-vllm-batch stats`?"
        in capsys.readouterr().err
    )


def test_validate_checks_the_operators_default_urls_by_default(tmp_path, capsys):
    from airflow_vllm_batch.engines.vllm.command import FALLBACK_SUPPORTED_URLS

    path = tmp_path / "score.jsonl"
    path.write_text(
        '{"custom_id": "a", "method": "POST", "url": "/score", "body": {"model": "m", "text_1": "a", "text_2": "b"}}\n'
    )
    assert cli.main(["validate", str(path), "--json"]) == 0
    assert cli.DEFAULT_SUPPORTED_URLS == FALLBACK_SUPPORTED_URLS


def test_validate_names_the_default_engine_not_this_engine_for_an_unserved_url(tmp_path, capsys):
    path = tmp_path / "completions.jsonl"
    path.write_text(
        '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "hi"}}\n'
    )
    assert cli.main(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert "this engine" not in out
    assert "engine=VLLMRunner()" in out
    assert "engine=VLLMServer(...)" in out


def test_validate_with_supported_url_names_that_option_for_an_unserved_url(batch, capsys):
    assert cli.main(["validate", str(batch), "--supported-url", "/v1/embeddings"]) == 1
    out = capsys.readouterr().out
    assert "this engine" not in out
    assert "--supported-url" in out


def test_validate_lists_repeated_custom_ids_read_from_stdin_without_sending_the_user_to_validate(
    monkeypatch, capsys
):
    data = (REQUEST % "a" + REQUEST % "b" + REQUEST % "a").encode()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert cli.main(["validate", "-"]) == 1
    out = capsys.readouterr().out
    assert "airflow-vllm-batch validate" not in out
    assert "line 3" in out
    assert "repeats the one on line 1" in out
