"""Splitting a batch file into shards, merging shard results, summing shard manifests."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import random
import struct

import pytest

from airflow_vllm_batch.batchfile import open_lines
from airflow_vllm_batch.operators.shards import VLLMBatchSplitOperator
from airflow_vllm_batch.sharding import (
    ShardingError,
    check_merged_counts,
    merge_results,
    missing_shards,
    shard_index,
    shard_name,
    split_lines,
    sum_manifests,
)
from airflow_vllm_batch.version_compat import AirflowFailException


def request(i: int, pad: int = 0) -> bytes:
    return json.dumps(
        {"custom_id": f"r-{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x" * pad}}
    ).encode()


def split(data: bytes, **limits) -> tuple[list, list[bytes]]:
    """Split ``data``; return the shard records and each shard's bytes."""
    files: dict[int, io.BytesIO] = {}

    @contextlib.contextmanager
    def open_shard(index: int):
        files[index] = io.BytesIO()
        yield files[index]
        files[index].seek(0)  # still readable after the writer is done with it

    with open_lines(io.BytesIO(data)) as lines:
        shards = list(split_lines(lines, open_shard, **limits))
    return shards, [files[s.index].getvalue() for s in shards]


# -- split -----------------------------------------------------------------------


def test_split_cuts_every_max_requests_lines():
    data = b"".join(request(i) + b"\n" for i in range(7))
    shards, contents = split(data, max_requests=3)
    assert [s.requests for s in shards] == [3, 3, 1]
    assert [s.index for s in shards] == [0, 1, 2]
    assert [s.first_line for s in shards] == [1, 4, 7]
    assert b"".join(contents) == data


def test_split_cuts_before_the_line_that_would_pass_max_bytes():
    lines = [request(i) + b"\n" for i in range(5)]
    size = len(lines[0])  # every line has the same length here
    shards, contents = split(b"".join(lines), max_bytes=2 * size + size - 1)
    assert [s.requests for s in shards] == [2, 2, 1]
    assert all(s.size <= 3 * size - 1 for s in shards)
    assert [s.size for s in shards] == [len(c) for c in contents]


def test_split_of_a_line_exactly_filling_max_bytes_keeps_it_in_the_shard():
    line = request(0) + b"\n"
    shards, _ = split(line * 4, max_bytes=2 * len(line))
    assert [s.requests for s in shards] == [2, 2]


def test_a_line_larger_than_max_bytes_gets_a_shard_of_its_own():
    small, big = request(0), request(1, pad=500)
    data = small + b"\n" + big + b"\n" + small.replace(b"r-0", b"r-2") + b"\n"
    shards, contents = split(data, max_bytes=200)
    assert [s.requests for s in shards] == [1, 1, 1]
    assert contents[1] == big + b"\n"
    assert shards[1].size > 200


def test_a_line_longer_than_the_reader_can_keep_stops_the_split_naming_it():
    data = request(0) + b"\n" + request(1, pad=300) + b"\n"
    with (
        pytest.raises(ShardingError, match="Line 2 is longer than 100 bytes"),
        open_lines(io.BytesIO(data), max_line_bytes=100) as lines,
    ):
        list(split_lines(lines, lambda i: contextlib.nullcontext(io.BytesIO()), max_line_bytes=100))


def test_split_keeps_every_line_byte_for_byte_including_crlf_and_unicode():
    lines = [
        request(0) + b"\r",
        '{"custom_id": "é", "body": {"input": "日本"}}'.encode(),
        b'  {"custom_id":"s"}  ',
    ]
    _shards, contents = split(b"\n".join(lines) + b"\n", max_requests=2)
    assert contents == [lines[0] + b"\n" + lines[1] + b"\n", lines[2] + b"\n"]


def test_split_adds_the_missing_final_newline():
    data = request(0) + b"\n" + request(1)
    _, contents = split(data)
    assert contents == [data + b"\n"]


def test_split_drops_blank_lines_and_counts_physical_line_numbers():
    data = b"\n" + request(0) + b"\n   \n\n" + request(1) + b"\n\n"
    shards, contents = split(data, max_requests=1)
    assert contents == [request(0) + b"\n", request(1) + b"\n"]
    assert [s.first_line for s in shards] == [2, 5]


def test_split_of_an_input_without_requests_yields_no_shard():
    assert split(b"\n \n") == ([], [])


def test_split_is_deterministic_down_to_the_hash():
    data = b"".join(request(i, pad=i) + b"\n" for i in range(50))
    first, first_contents = split(data, max_requests=7, max_bytes=900)
    second, second_contents = split(data, max_requests=7, max_bytes=900)
    assert first == second
    assert first_contents == second_contents
    assert [s.sha256 for s in first] == [hashlib.sha256(c).hexdigest() for c in first_contents]


def test_split_accepts_limits_rendered_as_strings():
    shards, _ = split(b"".join(request(i) + b"\n" for i in range(4)), max_requests="2", max_bytes="100000")
    assert [s.requests for s in shards] == [2, 2]


@pytest.mark.parametrize(
    "limits", [{"max_requests": 0}, {"max_bytes": -1}, {"max_requests": "many"}, {"max_requests": 2.5}]
)
def test_split_refuses_limits_that_are_not_positive_whole_numbers(limits):
    with pytest.raises(ShardingError, match="whole number of at least 1"):
        split(request(0) + b"\n", **limits)


def test_split_closes_the_open_shard_when_the_input_fails_midway():
    closed = []

    @contextlib.contextmanager
    def open_shard(index):
        try:
            yield io.BytesIO()
        finally:
            closed.append(index)

    def broken_lines():
        yield request(0)
        raise OSError("connection reset")

    with pytest.raises(OSError, match="connection reset"):
        list(split_lines(broken_lines(), open_shard))
    assert closed == [0]


def _embedding_result_line(dimensions: int, seed: int = 0) -> bytes:
    """An embedding answer as vLLM's runner writes it: a unit float32 vector spelled as JSON floats."""
    rng = random.Random(seed)
    vector = [rng.gauss(0, 1) for _ in range(dimensions)]
    norm = math.sqrt(sum(v * v for v in vector))
    # float32 values widened to Python floats: what the engine's tensor gives, 17 significant digits in JSON.
    values = [struct.unpack("f", struct.pack("f", v / norm))[0] for v in vector]
    body = {
        "id": "embd-0123456789abcdef0123456789abcdef",
        "object": "list",
        "created": 1_800_000_000,
        "model": "Qwen/Qwen3-Embedding-8B",
        "data": [{"index": 0, "object": "embedding", "embedding": values}],
        "usage": {
            "prompt_tokens": 512,
            "total_tokens": 512,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }
    response = {"status_code": 200, "request_id": "vllm-batch-0123456789abcdef", "body": body}
    return json.dumps(
        {"id": "vllm-0123456789abcdef", "custom_id": "request-0000001", "response": response, "error": None}
    ).encode()


def test_the_default_shard_of_4096_dimension_embeddings_stays_under_half_the_5_gb_put_limit():
    # vLLM uploads a shard's output in one PUT (at most 5 GB); the line is measured, not estimated.
    line = _embedding_result_line(4096)
    default = VLLMBatchSplitOperator(
        task_id="split", input_uri="s3://b/in.jsonl", shard_prefix="s3://b/shards/"
    ).max_requests
    assert default * (len(line) + 1) < 5e9 / 2, (default, len(line))


def test_shard_names_sort_in_shard_order_up_to_100000_shards():
    names = [shard_name(i) for i in range(100_000)]
    assert names == sorted(names)


def test_a_shard_name_reads_back_as_its_index():
    assert [shard_index(f"s3://b/p/{shard_name(i)}") for i in (0, 7, 99_999, 123_456)] == [
        0,
        7,
        99_999,
        123_456,
    ]


def test_a_sharding_mistake_fails_the_task_without_retry():
    split = VLLMBatchSplitOperator(task_id="split", input_uri="s3://b/in.jsonl", shard_prefix="b/shards/")
    with pytest.raises(AirflowFailException, match="shard_prefix must be an s3:// URI"):
        split.execute({})


# -- merge -----------------------------------------------------------------------


def result(custom_id: str) -> bytes:
    return json.dumps(
        {"id": "x", "custom_id": custom_id, "response": {"status_code": 200}, "error": None}
    ).encode()


def test_merge_keeps_shard_order_and_terminates_vllm_outputs_without_final_newline():
    shard0 = result("a") + b"\n" + result("b")  # as vLLM uploads it: no final newline
    shard1 = result("c")
    out = io.BytesIO()
    written = merge_results([io.BytesIO(shard0), io.BytesIO(shard1)], out)
    assert out.getvalue() == result("a") + b"\n" + result("b") + b"\n" + result("c") + b"\n"
    assert written == [2, 1]


def test_merge_copies_each_line_byte_for_byte():
    odd = b'{"custom_id":"u","response":{"body":{"text":"\\u00e9 \xc3\xa9"}},  "error":null}\r'
    out = io.BytesIO()
    merge_results([io.BytesIO(odd + b"\n"), io.BytesIO(result("v") + b"\n")], out)
    assert out.getvalue().split(b"\n")[0] == odd


def test_merge_reads_local_paths_and_skips_empty_shards(tmp_path):
    (tmp_path / "0.jsonl").write_bytes(result("a"))
    (tmp_path / "1.jsonl").write_bytes(b"")
    (tmp_path / "2.jsonl").write_bytes(result("b") + b"\n\n")
    out = io.BytesIO()
    merge_results([tmp_path / "0.jsonl", tmp_path / "1.jsonl", tmp_path / "2.jsonl"], out)
    assert out.getvalue() == result("a") + b"\n" + result("b") + b"\n"


def test_merge_counts_the_lines_of_each_source_without_blank_ones(tmp_path):
    sources = [
        io.BytesIO(result("a") + b"\n\n" + result("b")),
        io.BytesIO(b""),
        io.BytesIO(b"\n" + result("c") + b"\n"),
    ]
    assert merge_results(sources, io.BytesIO()) == [2, 0, 1]


def test_split_then_merge_round_trips_the_request_lines():
    data = b"".join(request(i, pad=i % 13) + b"\n" for i in range(100))
    _, contents = split(data, max_requests=9, max_bytes=1500)
    out = io.BytesIO()
    merge_results([io.BytesIO(c) for c in contents], out)
    assert out.getvalue() == data


# -- manifests -------------------------------------------------------------------


def manifest(i: int, total: int, failed: int, prompt: int, completion: int, duration: float) -> dict:
    return {
        "output_uri": f"s3://b/shard-{i}.results.jsonl",
        "model": "m",
        "vllm_version": "0.32.0",
        "request_counts": {"total": total, "completed": total - failed, "failed": failed},
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
        "duration_s": duration,
        "engine_duration_s": duration - 1,
        "manifest_uri": f"s3://b/shard-{i}.results.manifest.json",
    }


def test_sum_manifests_adds_counts_usage_and_durations():
    summed = sum_manifests([manifest(0, 10, 1, 100, 50, 30.0), manifest(1, 5, 0, 40, 20, 20.5)])
    assert summed["request_counts"] == {"total": 15, "completed": 14, "failed": 1}
    assert summed["usage"] == {"prompt_tokens": 140, "completion_tokens": 70, "total_tokens": 210}
    assert summed["shard_duration_s"] == 50.5
    assert summed["engine_duration_s"] == 48.5
    assert summed["max_shard_duration_s"] == 30.0
    assert summed["shards"] == 2
    assert summed["model"] == "m"
    assert summed["vllm_version"] == "0.32.0"
    assert summed["shard_manifest_uris"] == [
        "s3://b/shard-0.results.manifest.json",
        "s3://b/shard-1.results.manifest.json",
    ]


def test_sum_manifests_reports_no_version_when_shards_ran_on_different_vllms():
    other = {**manifest(1, 1, 0, 1, 1, 1.0), "vllm_version": "0.33.0"}
    assert sum_manifests([manifest(0, 1, 0, 1, 1, 1.0), other])["vllm_version"] is None


def test_sum_manifests_of_nothing_is_an_error():
    with pytest.raises(ShardingError, match="No shard manifests"):
        sum_manifests([])


def counted(completed: int, failed: int, i: int = 0) -> dict:
    return {
        "output_uri": f"s3://b/shard-{i}.results.jsonl",
        "request_counts": {"total": completed + failed, "completed": completed, "failed": failed},
    }


def test_merged_counts_that_match_every_manifest_pass():
    check_merged_counts([counted(3, 0, 0), counted(2, 2, 1)], [3, 2], [0, 2])


@pytest.mark.parametrize(
    ("results", "errors"),
    [([3, 3], [0, 2]), ([3, 1], [0, 2]), ([3, 2], [0, 1]), ([3, 2], [0, 0]), ([3, 2], [1, 1])],
    ids=["extra-result", "lost-result", "lost-error", "no-error-file", "error-in-the-wrong-shard"],
)
def test_merged_counts_that_disagree_with_a_manifest_fail_naming_the_shard(results, errors):
    with pytest.raises(
        ShardingError, match=r"manifests count 5 completed and 2 failed requests: shard \d \(s3://b/shard-"
    ):
        check_merged_counts([counted(3, 0, 0), counted(2, 2, 1)], results, errors)


def test_merged_counts_that_add_up_but_disagree_per_shard_still_fail():
    # One result moved from shard 0 to shard 1: the totals hide it, the shards do not.
    with pytest.raises(ShardingError, match=r"shard 0 .*; shard 1 "):
        check_merged_counts([counted(3, 0, 0), counted(2, 0, 1)], [2, 3], [0, 0])


@pytest.mark.parametrize(
    ("uri", "index"),
    [
        ("s3://b/p/shard-00003.jsonl", 3),
        ("shard-123456.jsonl", 123456),
        ("s3://b/p/shard-00003.results.jsonl", None),
        ("s3://b/p/myshard-00003.jsonl", None),
        ("s3://b/p/shard-3.jsonl", None),
        (None, None),
    ],
)
def test_shard_index_reads_only_the_splits_file_names(uri, index):
    assert shard_index(uri) == index


SPLIT = ["p/shard-00000.jsonl", "p/shard-00000.results.jsonl", "p/shard-00001.jsonl", "p/shard-00002.jsonl"]


@pytest.mark.parametrize(
    ("answered", "missing"),
    [([0, 1, 2], []), ([0, 2], [1]), ([0, 1], [2]), ([1, 2], [0]), ([2], [0, 1])],
    ids=str,
)
def test_missing_shards_are_the_splits_shards_no_manifest_answers(answered, missing):
    assert missing_shards([f"s3://b/p/{shard_name(i)}" for i in answered], SPLIT) == missing


def test_a_gap_below_an_answered_shard_is_missing_even_when_its_file_is_gone():
    assert missing_shards(["s3://b/p/shard-00000.jsonl", "s3://b/p/shard-00003.jsonl"], []) == [1, 2]


def test_manifests_of_files_not_made_by_the_split_have_no_missing_shards():
    assert missing_shards(["s3://b/mine/a.jsonl", "s3://b/p/shard-00000.jsonl"], SPLIT) == []


def test_sum_manifests_adds_the_shards_invalid_outputs_and_leaves_it_out_when_none():
    with_invalid = {
        **manifest(1, 5, 2, 40, 20, 20.5),
        "invalid_output": 2,
        "failed_by_reason": {"invalid_output": 2},
    }
    summed = sum_manifests([manifest(0, 10, 0, 100, 50, 30.0), with_invalid])
    assert summed["invalid_output"] == 2
    assert summed["failed_by_reason"] == {"invalid_output": 2}
    assert sum_manifests([manifest(0, 10, 0, 100, 50, 30.0)])["invalid_output"] is None


def test_sum_manifests_adds_the_shards_answers_from_the_cache_and_leaves_it_out_without_a_cache():
    # A shard whose every request hit has from_cache == its total; a shard without the cache has no from_cache.
    cached = [
        {**manifest(0, 10, 0, 100, 50, 3.0), "from_cache": 10},
        {**manifest(1, 10, 0, 100, 50, 30.0), "from_cache": 0},
    ]
    assert sum_manifests(cached)["from_cache"] == 10
    assert sum_manifests([manifest(0, 10, 0, 100, 50, 30.0)])["from_cache"] is None
