"""The answer cache's part of the results: cached answers appended to the checked results."""

from __future__ import annotations

import json

import pytest

from airflow_vllm_batch.batchfile import ResultsReport, check_results, open_lines
from airflow_vllm_batch.run.answer_cache import CacheSplit


def _answer(custom_id: str) -> bytes:
    body = {
        "object": "chat.completion",
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    line = {
        "id": custom_id,
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": custom_id, "body": body},
        "error": None,
    }
    return json.dumps(line).encode()


@pytest.mark.parametrize("final_newline", [True, False], ids=["ends-with-newline", "no-final-newline"])
def test_cached_answers_start_on_a_line_of_their_own_after_the_engines_results(tmp_path, final_newline):
    results = tmp_path / "results.jsonl"
    results.write_bytes(_answer("e0") + b"\n" + _answer("e1") + (b"\n" if final_newline else b""))
    cached = tmp_path / "cached-results.jsonl"
    cached.write_bytes(_answer("c0") + b"\n" + _answer("c1") + b"\n")
    report = ResultsReport(total=2, completed=2)
    CacheSplit(
        job=None,
        hits=2,
        misses=2,
        cached_path=cached,
        usage={"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
    ).add_to(report, results)
    with open_lines(str(results)) as lines:
        recount = check_results(lines)
    assert recount.request_counts == {"total": 4, "completed": 4, "failed": 0} == report.request_counts
    assert recount.unparseable_count == 0
