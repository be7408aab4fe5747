"""The operator never overwrites its input: colliding locations fail before any engine or S3 write (No strangers)."""

from __future__ import annotations

import pytest

from airflow_vllm_batch.exceptions import LocationError
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.operators.test_vllm_batch_runs import Batch, FakeTI, chat_lines


@pytest.fixture
def batch(s3, bucket, tmp_path) -> Batch:
    return Batch(s3, bucket, tmp_path)


def test_an_output_uri_equal_to_the_input_uri_fails_at_dag_parse_time(batch):
    with pytest.raises(LocationError, match="output_uri and input_uri collide"):
        batch.operator(output_uri=batch.input_uri)


@pytest.mark.parametrize(
    "rendered",
    [
        {"output_uri": "in/input.jsonl"},
        {"error_uri": "in/input.jsonl"},
        {"output_uri": "in/input.jsonl.x", "input_uri": "in/input.jsonl.x.staging/abc/input.jsonl"},
    ],
    ids=["output", "error", "input-under-staging"],
)
def test_a_rendered_location_on_the_input_fails_without_retry_and_leaves_the_input_untouched(batch, rendered):
    operator = batch.operator()
    for name, key in rendered.items():  # what rendering a template sets
        setattr(operator, name, f"s3://{batch.bucket}/{key}")
    batch.put("in/input.jsonl.x.staging/abc/input.jsonl", chat_lines(5))
    before = {key: batch.get(key) for key in batch.keys()}
    with pytest.raises(AirflowFailException, match="collide"):
        operator.execute({"ti": FakeTI(), "outlet_events": {}})
    assert {key: batch.get(key) for key in batch.keys()} == before  # nothing written, nothing deleted
    assert batch.engine_runs == 0
