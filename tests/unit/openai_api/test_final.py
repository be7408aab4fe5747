"""An ended batch is final: a later run of its signed spec, under any run identity, changes nothing.

A clear after a vLLM upgrade or an engine-args change, a re-trigger, a retry on a worker of
another version: each is a run of the same batch under another identity. The batch task
returns the published manifest before anything else (and the run again under the lease), so
the batch's files and status stay as they were, whatever the clock says.
"""

from __future__ import annotations

import json
import time

import pytest

from airflow_vllm_batch.engines.base import EngineInfo
from airflow_vllm_batch.engines.vllm.command import FALLBACK_SUPPORTED_URLS
from airflow_vllm_batch.exceptions import StorageUnavailableError
from airflow_vllm_batch.openai_api import batch_dag
from airflow_vllm_batch.openai_api.batch_dag import OpenAIBatchOperator
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.openai_api import step_engine
from tests.unit.openai_api.test_batch_task import BATCH, ApiBatch


@pytest.fixture
def api_batch(s3, bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(step_engine, "AFTER_ANSWER", None)
    step_engine.PRODUCED.clear()
    return ApiBatch(s3, bucket, tmp_path, monkeypatch)


def another_identity(monkeypatch) -> None:
    """What a vLLM upgrade of the workers changes: the engine's version, so the run identity."""
    monkeypatch.setattr(
        step_engine.StepEngineEngine,
        "inspect",
        lambda self: EngineInfo(
            vllm_version="step-2", supported_urls=FALLBACK_SUPPORTED_URLS | {"/v1/embeddings"}
        ),
    )


def past_the_window(monkeypatch) -> None:
    later = time.time() + 25 * 3600
    monkeypatch.setattr(batch_dag.time, "time", lambda: later)


def objects(api_batch) -> dict[str, bytes]:
    return {key: api_batch.get(key) for key in api_batch.keys() if not key.endswith(".lease.json")}


@pytest.mark.parametrize("past_window", [False, True], ids=["in-window", "past-window"])
def test_a_completed_batch_run_again_under_another_identity_keeps_its_files_and_runs_nothing(
    api_batch, monkeypatch, past_window
):
    first = api_batch.run()
    assert first["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    before = objects(api_batch)
    step_engine.PRODUCED.clear()
    another_identity(monkeypatch)
    if past_window:
        past_the_window(monkeypatch)
    assert api_batch.run(try_number=2) == first
    assert step_engine.PRODUCED == []
    assert objects(api_batch) == before


def test_a_completed_batch_stays_completed_when_the_media_policy_later_refuses_a_line(api_batch, monkeypatch):
    """The media check (no fetch of a host not allowed) runs after the ended check: it never fails an ended batch."""
    first = api_batch.run()
    before = objects(api_batch)
    refused = [
        {"code": "invalid_request", "line": 1, "param": "body.messages", "message": "host not allowed"}
    ]
    monkeypatch.setattr(batch_dag, "media_problems", lambda lines, allowed: (1, refused))
    assert api_batch.run(try_number=2) == first
    assert objects(api_batch) == before


def test_an_expired_batch_whose_error_file_its_owner_deleted_is_not_published_again(api_batch):
    api_batch.created_at = int(time.time()) - 25 * 3600
    first = api_batch.run()
    assert first["status"] == "expired"
    api_batch.client.delete_object(Bucket=api_batch.bucket, Key=api_batch.err_key)
    manifest_before = api_batch.get(api_batch.manifest_key)
    assert api_batch.run(try_number=2) == first
    assert api_batch.err_key not in api_batch.keys()
    assert api_batch.get(api_batch.manifest_key) == manifest_before


def test_the_run_under_the_lease_also_returns_an_ended_batch_whatever_its_identity(api_batch, monkeypatch):
    """A try that looked before another try published (the operator's first look saw nothing) finds it under the lease."""
    first = api_batch.run()
    before = objects(api_batch)
    step_engine.PRODUCED.clear()
    monkeypatch.setattr(OpenAIBatchOperator, "ended_manifest", lambda self: None)
    another_identity(monkeypatch)
    past_the_window(monkeypatch)
    assert api_batch.run(try_number=2) == first
    assert step_engine.PRODUCED == []
    assert objects(api_batch) == before


def test_a_batch_that_failed_for_an_unserved_endpoint_fails_the_same_way_when_run_again(
    api_batch, monkeypatch
):
    with pytest.raises(AirflowFailException, match="does not serve"):
        api_batch.run(statuses=dict.fromkeys("abcd", 404))
    before = objects(api_batch)
    another_identity(monkeypatch)
    with pytest.raises(AirflowFailException, match="does not serve"):
        api_batch.run(try_number=2)
    assert step_engine.PRODUCED == [1]
    assert objects(api_batch) == before
    assert json.loads(before[f"batches/{BATCH}.failure.json"])["errors"][0]["code"] == "endpoint_not_served"


def test_a_batch_whose_output_was_overwritten_after_publishing_is_published_again(api_batch):
    """Not the owner's delete but a stray write (a try that lost the lease): the protocol's repair, a run that publishes again."""
    api_batch.run()
    api_batch.client.put_object(Bucket=api_batch.bucket, Key=api_batch.out_key, Body=b"stray\n")
    step_engine.PRODUCED.clear()
    manifest = api_batch.run(try_number=2)
    assert manifest["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    assert sorted(r["custom_id"] for r in api_batch.lines(api_batch.out_key)) == ["a", "b", "c", "d"]


def test_a_try_removes_the_failure_record_an_earlier_try_left(api_batch):
    """A cleared run's new try owns the batch's ending: the old reason no longer shows once it ended otherwise."""
    failure = f"batches/{BATCH}.failure.json"
    api_batch.client.put_object(Bucket=api_batch.bucket, Key=failure, Body=b'{"stage": "run", "errors": []}')
    api_batch.run(try_number=3)
    assert failure not in api_batch.keys()


def dies_after(n: int):
    def answer(done: int) -> None:
        if done == n:
            raise StorageUnavailableError("S3 went away")

    return answer


def test_a_retry_under_another_identity_resumes_from_the_answers_the_earlier_try_made_durable(
    api_batch, monkeypatch
):
    monkeypatch.setattr(step_engine, "AFTER_ANSWER", dies_after(2))
    with pytest.raises(StorageUnavailableError):
        api_batch.run(retries=1)
    another_identity(monkeypatch)
    answered: list[int] = []
    monkeypatch.setattr(step_engine, "AFTER_ANSWER", answered.append)
    manifest = api_batch.run(try_number=2, retries=1)
    assert manifest["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    assert answered == [1, 2]  # the two requests the first try had not answered, and only them
    assert sorted(r["custom_id"] for r in api_batch.lines(api_batch.out_key)) == ["a", "b", "c", "d"]


def test_a_batch_cancelled_after_a_vllm_upgrade_keeps_the_answers_made_durable_before_it(
    api_batch, monkeypatch
):
    """The review's rolling upgrade: the retry is another identity; past its window or cancelled, it publishes them."""
    monkeypatch.setattr(step_engine, "AFTER_ANSWER", dies_after(3))
    with pytest.raises(StorageUnavailableError):
        api_batch.run(retries=1)
    another_identity(monkeypatch)
    monkeypatch.setattr(step_engine, "AFTER_ANSWER", None)
    api_batch.cancel()
    manifest = api_batch.run(try_number=2, retries=1)
    assert manifest["status"] == "cancelled"
    assert manifest["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert sorted(r["custom_id"] for r in api_batch.lines(api_batch.out_key)) == ["a", "b", "c"]
