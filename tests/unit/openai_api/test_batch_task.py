"""The OpenAI API's batch task, run for real on S3 (SeaweedFS) with an engine stand-in: how a batch ends.

Per-request failures complete it; a cancel or its deadline stops the run under its lease,
which publishes what is answered through the run protocol (a manifest saying ``cancelled``
or ``expired``, every other request as ``batch_cancelled`` / ``batch_expired``); a failure of
the batch itself fails the task and says why in the batch's words.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from airflow_vllm_batch.exceptions import EngineError, StorageUnavailableError
from airflow_vllm_batch.manifest import Manifest
from airflow_vllm_batch.openai_api import batch_dag
from airflow_vllm_batch.openai_api.access import owner_key
from airflow_vllm_batch.openai_api.batch_dag import OpenAIBatchOperator, failure_record, public_message
from airflow_vllm_batch.openai_api.batch_spec import BatchSpec
from airflow_vllm_batch.openai_api.files import result_file_ids
from airflow_vllm_batch.openai_api.status import window_seconds
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.openai_api import step_engine
from tests.unit.openai_api.conftest import KEY
from tests.unit.openai_api.step_engine import StepEngine
from tests.unit.operators.test_vllm_batch_runs import FakeTI

BATCH = "batch_0123456789abcdef"


def requests(ids: list[str]) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": c,
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": c}]},
            }
        ).encode()
        + b"\n"
        for c in ids
    )


class ApiBatch:
    """One API batch's objects in a fresh bucket (``openai_files_uri`` its root), and its batch task.

    The run's conf is the batch's signed spec, as ``POST /batches`` makes it; ``created_at``
    and ``window`` may be changed before :meth:`run`, which signs them.
    """

    OWNER = "u"

    def __init__(
        self,
        s3,
        bucket: str,
        tmp_path,
        monkeypatch,
        ids=("a", "b", "c", "d"),
        created_at: int | None = None,
        window: str = "24h",
    ):
        self.client, self.bucket, self.tmp_path = s3.client(), bucket, tmp_path
        monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_FILES_URI", f"s3://{bucket}/")
        # The batch's pinned copy of its input, as POST /batches makes it.
        answer = self.client.put_object(
            Bucket=bucket, Key=f"batches/{BATCH}.input.jsonl", Body=requests(list(ids))
        )
        self.input_version = answer["ETag"].strip('"')
        self.created_at = int(time.time()) if created_at is None else created_at
        self.window = window
        output_id, error_id = result_file_ids(BATCH)
        self.out_key = f"files/{owner_key(self.OWNER)}/{output_id}.jsonl"
        self.err_key = f"files/{owner_key(self.OWNER)}/{error_id}.jsonl"
        self.manifest_key = self.out_key.removesuffix(".jsonl") + ".manifest.json"

    @property
    def conf(self) -> dict:
        spec = BatchSpec(
            batch_id=BATCH,
            dag_id="vllm_batch_openai",
            owner=self.OWNER,
            input_file_id="file-0123456789in",
            input_version=self.input_version,
            endpoint="/v1/chat/completions",
            route="",
            created_at=self.created_at,
            window_s=window_seconds(self.window),
        )
        return spec.sign(KEY)

    def run(self, try_number: int = 1, retries: int = 0, **engine) -> dict:
        operator = OpenAIBatchOperator(
            task_id="vllm_batch",
            model="m",
            engine=StepEngine(**engine),
            results_dir=str(self.tmp_path / "results"),
            retries=retries,
        )
        context = {
            "ti": FakeTI(try_number=try_number, run_id=BATCH),
            "outlet_events": {},
            "dag_run": SimpleNamespace(run_id=BATCH, dag_id="vllm_batch_openai", conf=self.conf),
        }
        return operator.execute(context)

    def cancel(self) -> None:
        self.client.put_object(
            Bucket=self.bucket, Key=f"batches/{BATCH}.cancel.json", Body=b'{"cancelling_at": 1}'
        )

    def lines(self, key: str) -> list[dict]:
        return [json.loads(line) for line in self.get(key).splitlines()]

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def keys(self) -> list[str]:
        return sorted(o["Key"] for o in self.client.list_objects_v2(Bucket=self.bucket).get("Contents", []))


@pytest.fixture
def api_batch(s3, bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(step_engine, "AFTER_ANSWER", None)
    step_engine.PRODUCED.clear()
    return ApiBatch(s3, bucket, tmp_path, monkeypatch)


def test_refused_requests_complete_the_batch_with_both_files_in_openais_shape(api_batch):
    manifest = api_batch.run(statuses={"b": 400, "d": 400})
    assert manifest["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert "status" not in manifest
    results = api_batch.lines(api_batch.out_key)
    assert sorted(r["custom_id"] for r in results) == ["a", "c"]
    assert all(r["id"].startswith("batch_req_") for r in results)
    errors = api_batch.lines(api_batch.err_key)
    assert sorted(e["custom_id"] for e in errors) == ["b", "d"]
    for e in errors:
        assert e["error"] is None
        assert e["response"]["status_code"] == 400
        assert e["id"].startswith("batch_req_")
        assert set(e["response"]["body"]["error"]) == {"message", "type", "param", "code"}
        assert e["response"]["body"]["error"]["message"] == f"{e['custom_id']} refused (400)"
    assert f"batches/{BATCH}.failure.json" not in api_batch.keys()


def test_the_operators_own_output_keeps_vllms_shape(s3, bucket, tmp_path):
    from tests.unit.operators.test_vllm_batch_runs import Batch

    batch = Batch(s3, bucket, tmp_path)
    batch.run()
    assert all(
        json.loads(line)["id"].startswith("vllm-") or not json.loads(line)["id"].startswith("batch_req_")
        for line in batch.get("out/results.jsonl").splitlines()
    )


def test_a_cancel_mid_run_publishes_the_finished_answers_and_the_rest_as_batch_cancelled(
    api_batch, monkeypatch
):
    monkeypatch.setattr(step_engine, "AFTER_ANSWER", lambda done: api_batch.cancel() if done == 2 else None)
    manifest = api_batch.run(statuses={"b": 400})
    assert manifest["status"] == "cancelled"
    assert manifest["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    assert [r["custom_id"] for r in api_batch.lines(api_batch.out_key)] == ["a"]
    errors = {e["custom_id"]: e for e in api_batch.lines(api_batch.err_key)}
    assert errors["b"]["response"]["status_code"] == 400
    assert errors["b"]["error"] is None
    assert {c: errors[c]["error"]["code"] for c in "cd"} == {"c": "batch_cancelled", "d": "batch_cancelled"}
    assert errors["c"]["response"] is None
    assert errors["c"]["id"].startswith("batch_req_")
    # Published as any output: the manifest names the files' ETags; no staging, no lease left.
    stored = Manifest.from_json(api_batch.get(api_batch.manifest_key))
    assert stored.status == "cancelled"
    assert stored.output_etag
    assert stored.error_etag
    assert not [k for k in api_batch.keys() if ".staging/" in k or k.endswith(".lease.json")]


def test_a_batch_cancelled_before_its_task_runs_publishes_every_request_as_batch_cancelled_without_an_engine(
    api_batch,
):
    api_batch.cancel()
    manifest = api_batch.run()
    assert manifest["status"] == "cancelled"
    assert manifest["request_counts"] == {
        "total": 4,
        "completed": 0,
        "failed": 4,
    }
    assert step_engine.PRODUCED == []
    assert {e["error"]["code"] for e in api_batch.lines(api_batch.err_key)} == {"batch_cancelled"}


def test_a_cancelled_batch_keeps_the_answers_an_earlier_try_checkpointed(api_batch, monkeypatch):
    def dies(done):
        if done == 3:
            raise StorageUnavailableError("S3 went away")

    monkeypatch.setattr(step_engine, "AFTER_ANSWER", dies)
    with pytest.raises(StorageUnavailableError):
        api_batch.run(retries=1)
    monkeypatch.setattr(step_engine, "AFTER_ANSWER", None)
    api_batch.cancel()
    manifest = api_batch.run(try_number=2, retries=1)
    assert manifest["status"] == "cancelled"
    assert manifest["request_counts"] == {
        "total": 4,
        "completed": 3,
        "failed": 1,
    }
    assert sorted(r["custom_id"] for r in api_batch.lines(api_batch.out_key)) == ["a", "b", "c"]


def test_a_retry_of_a_cancelled_batch_returns_its_manifest_and_runs_nothing(api_batch, monkeypatch):
    monkeypatch.setattr(step_engine, "AFTER_ANSWER", lambda done: api_batch.cancel() if done == 1 else None)
    first = api_batch.run()
    step_engine.PRODUCED.clear()
    assert api_batch.run(try_number=2) == first
    assert step_engine.PRODUCED == []


def test_the_deadline_counts_from_created_at_and_expires_the_run_mid_way(api_batch, monkeypatch):
    clock = [time.time()]
    monkeypatch.setattr(batch_dag.time, "time", lambda: clock[0])
    api_batch.created_at = int(clock[0]) - 23 * 3600
    # The second answer lands after 24 h from created_at: the run stops, whatever the try's own start.
    monkeypatch.setattr(
        step_engine, "AFTER_ANSWER", lambda done: clock.__setitem__(0, clock[0] + 3600) if done == 2 else None
    )
    manifest = api_batch.run()
    assert manifest["status"] == "expired"
    assert manifest["request_counts"] == {
        "total": 4,
        "completed": 2,
        "failed": 2,
    }
    assert {e["custom_id"]: e["error"]["code"] for e in api_batch.lines(api_batch.err_key)} == {
        "c": "batch_expired",
        "d": "batch_expired",
    }


def test_a_batch_whose_window_passed_before_its_task_ran_expires_without_an_engine(api_batch):
    api_batch.created_at = int(time.time()) - 25 * 3600
    manifest = api_batch.run()
    assert manifest["status"] == "expired"
    assert manifest["request_counts"]["failed"] == 4
    assert step_engine.PRODUCED == []


def test_an_engine_that_cannot_start_fails_the_batch_with_its_root_cause_in_the_batchs_words(
    api_batch, monkeypatch
):
    tail = "INFO loading\nTraceback (most recent call last):\n  File x\nValueError: max_model_len 99999 exceeds the model's 2048\n"
    message = f"The vLLM engine exited with code 1; nothing was published. Last lines of its log:\n{tail}"

    def cannot_start(self, info, job):
        raise EngineError(message)

    monkeypatch.setattr(step_engine.StepEngineEngine, "produce", cannot_start)
    with pytest.raises(EngineError):
        api_batch.run()
    record = json.loads(api_batch.get(f"batches/{BATCH}.failure.json"))
    (error,) = record["errors"]
    assert error["code"] == "engine_error"
    assert error["message"].endswith("Cause: ValueError: max_model_len 99999 exceeds the model's 2048")


def test_a_try_that_airflow_retries_leaves_no_failure_record(api_batch, monkeypatch):
    monkeypatch.setattr(
        step_engine.StepEngineEngine,
        "produce",
        lambda self, info, job: (_ for _ in ()).throw(EngineError("died")),
    )
    with pytest.raises(EngineError):
        api_batch.run(retries=1)
    assert f"batches/{BATCH}.failure.json" not in api_batch.keys()


def test_a_batch_whose_every_request_got_404_fails_saying_the_model_does_not_serve_the_endpoint(api_batch):
    with pytest.raises(AirflowFailException, match="does not serve /v1/chat/completions"):
        api_batch.run(statuses=dict.fromkeys("abcd", 404))
    (error,) = json.loads(api_batch.get(f"batches/{BATCH}.failure.json"))["errors"]
    assert error["code"] == "endpoint_not_served"
    assert "a refused (404)" in error["message"]
    assert "max_failed_ratio" not in error["message"]


@pytest.mark.parametrize(
    "message",
    [
        "S3 failed while publishing (boom). The engine's results are staged at s3://b/files/u/file-out.jsonl.staging/ab12/parts/: a retry publishes them.",
        "2 of 4 requests failed. The files are published: s3://b/o.jsonl, s3://b/e.jsonl; the manifest is in XCom key 'manifest'.",
    ],
)
def test_errors_data_names_no_storage_location_and_no_airflow_internals(message):
    said = public_message(message)
    assert "s3://" not in said
    assert "XCom" not in said
    assert said


def test_a_preflight_failure_is_told_line_by_line():
    from airflow_vllm_batch.exceptions import PreflightError

    problem = SimpleNamespace(line=3, message="body.model is 'x', not s3://b/k", custom_id="c")
    err = PreflightError("bad", SimpleNamespace(problems=[problem], file_problems=[]))
    record = failure_record(err)
    assert record["stage"] == "preflight"
    assert record["errors"][0]["line"] == 3
    assert "s3://" not in record["errors"][0]["message"]
