"""What a user reads in a failed task's log (``dag.test()``'s task log, as the task runner writes it).

One failure is reported once: its message is in the log one time, with one traceback
(Airflow's own, for the exception the task raised), not also a chained one and a report
logged before the raise.
"""

from __future__ import annotations

import pytest

from tests.integration.test_operator import _line, _put, _run_operator
from vllm_batch_embedded.demo import BUCKET

pytestmark = pytest.mark.integration


def test_a_failed_preflight_is_reported_once_in_the_task_log(embedded, airflow_db, tiny_model):
    model = str(tiny_model)
    bad = (
        '{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "'
        + model
        + '"}}'
    )
    uri = _put(embedded, "tasklog/input.jsonl", _line("a", model) + "\n" + bad + "\n")
    result = _run_operator(
        "tasklog_bad_line", input_uri=uri, output_uri=f"s3://{BUCKET}/tasklog/results.jsonl", model=model
    )
    assert result.state == "failed"
    log = result.output
    assert log.count("line 2 (custom_id 'c'): body does not fit /v1/chat/completions") == 1, log[-4000:]
    assert log.count("failed preflight: 2 requests: 1 valid, 1 invalid") == 1
    assert log.count("Traceback (most recent call last)") == 1
    assert "The above exception was the direct cause" not in log
