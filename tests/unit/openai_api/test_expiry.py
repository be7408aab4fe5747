"""When a batch's completion window passes, its task publishes the answers checkpointed so far as OpenAI does, and the API reports it expired."""

from __future__ import annotations

import io
import json
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from openai.types import Batch

from airflow_vllm_batch.openai_api.batch_dag import OpenAIBatchOperator
from airflow_vllm_batch.openai_api.progress import split_expired
from airflow_vllm_batch.openai_api.status import BatchRun, batch_object
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.version_compat import AirflowFailException, AirflowTaskTimeout
from tests.unit.openai_api.test_progress import bad, ok
from tests.unit.openai_api.test_status import CONF, CREATED, T

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
OUT = "files/u/file-out.jsonl"


def request(cid: str) -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}).encode()


def test_an_expired_batch_publishes_each_request_once_answered_failed_or_batch_expired():
    output, errors = io.BytesIO(), io.BytesIO()
    counts = split_expired([ok("a"), bad("b"), ok("a")], [request("a"), request("b"), request("c"), b""], output, errors)
    assert counts == {"total": 3, "completed": 1, "failed": 2}
    assert [json.loads(line)["custom_id"] for line in output.getvalue().splitlines()] == ["a"]
    failed = [json.loads(line) for line in errors.getvalue().splitlines()]
    assert [e["custom_id"] for e in failed] == ["b", "c"]
    assert failed[0]["error"]["code"] != "batch_expired" and failed[0]["response"]["status_code"] == 400
    assert failed[1]["error"]["code"] == "batch_expired" and failed[1]["response"] is None


class Bucket:
    """One bucket's objects, with the calls the batch task makes."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects

    # the client
    def get_paginator(self, name):
        return self

    def paginate(self, *, Bucket, Prefix):
        yield {"Contents": [{"Key": k, "Size": len(v), "LastModified": T0} for k, v in sorted(self.objects.items()) if k.startswith(Prefix)]}

    def get_object(self, *, Bucket, Key, **kw):
        body = io.BytesIO(self.objects[Key])
        body.iter_lines = lambda: iter(body.getvalue().splitlines())
        return {"Body": body}

    def put_object(self, *, Bucket, Key, Body, **kw):
        self.objects[Key] = Body.read()
        return {"ETag": '"e"'}

    def delete_objects(self, *, Bucket, Delete):
        for item in Delete["Objects"]:
            self.objects.pop(item["Key"], None)

    # the hook
    def get_conn(self):
        return self

    def list_keys(self, bucket_name, prefix):
        return [k for k in self.objects if k.startswith(prefix)]

    def load_bytes(self, data, key, bucket_name, replace):
        self.objects[key] = data


@pytest.fixture
def expiring(monkeypatch):
    bucket = Bucket(
        {
            "files/u/file-in.jsonl": b"\n".join(request(c) for c in "abc") + b"\n",
            f"{OUT}.staging/run1/parts/part-000000-t1.jsonl": ok("a") + b"\n" + bad("b") + b"\n",
        }
    )

    def times_out(self, context):
        raise AirflowTaskTimeout("Timeout")

    def bind(self, context):
        # What _bind_batch derives from a signed spec (its own tests: test_batch_spec.py).
        self.input_uri, self.output_uri = "s3://b/files/u/file-in.jsonl", f"s3://b/{OUT}"
        self.error_uri, self.failure_uri = "s3://b/files/u/file-err.jsonl", "s3://b/batches/batch_x.failure.json"
        if endpoint := (getattr(context.get("dag_run"), "conf", None) or {}).get("endpoint"):
            self.supported_urls = [endpoint]

    monkeypatch.setattr(VLLMBatchOperator, "execute", times_out)
    monkeypatch.setattr(OpenAIBatchOperator, "hook", property(lambda self: bucket))
    monkeypatch.setattr(OpenAIBatchOperator, "_bind_batch", bind)
    monkeypatch.setattr(OpenAIBatchOperator, "_check_pinned_input", lambda self: None)
    operator = OpenAIBatchOperator(task_id="vllm_batch", model="m", execution_timeout=timedelta(hours=24))
    return operator, bucket


def test_a_batch_task_timed_out_by_its_window_publishes_its_answers_and_fails_without_retry(expiring):
    operator, bucket = expiring
    with pytest.raises(AirflowFailException, match="expired"):
        operator.execute({})
    assert [json.loads(line)["custom_id"] for line in bucket.objects[OUT].splitlines()] == ["a"]
    errors = [json.loads(line) for line in bucket.objects["files/u/file-err.jsonl"].splitlines()]
    assert [e["custom_id"] for e in errors] == ["b", "c"] and errors[1]["error"]["code"] == "batch_expired"
    record = json.loads(bucket.objects["batches/batch_x.failure.json"])
    assert record == {"stage": "expired", "request_counts": {"total": 3, "completed": 1, "failed": 2}, "output": True, "error": True}
    assert not any(".staging/" in key for key in bucket.objects)


def test_an_expired_batch_reports_its_published_files_and_counts():
    record = {"stage": "expired", "request_counts": {"total": 3, "completed": 1, "failed": 2}, "output": True, "error": True}
    batch = Batch.model_validate(batch_object("batch_abcdefab", BatchRun(CONF, "failed", ["failed"], T, T, T, failure=record), CREATED + 60))
    assert batch.status == "expired" and batch.expired_at == int(T.timestamp()) and batch.errors is None
    assert (batch.output_file_id, batch.error_file_id) == (CONF["output_file_id"], CONF["error_file_id"])
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 1, 2)


def test_an_expired_batch_whose_answers_cannot_be_published_still_fails_without_retry(expiring, monkeypatch):
    operator, bucket = expiring
    monkeypatch.setattr(OpenAIBatchOperator, "publish_expired", lambda self: (_ for _ in ()).throw(ConnectionError("S3 is down")))
    with pytest.raises(AirflowFailException, match="expired"):
        operator.execute({})


def test_the_batch_task_accepts_only_lines_whose_url_is_the_batchs_endpoint(expiring, monkeypatch):
    operator, _ = expiring
    seen = {}

    def runs(self, context):
        seen["settings"] = self.settings()
        return {}

    monkeypatch.setattr(VLLMBatchOperator, "execute", runs)
    operator.execute({"dag_run": SimpleNamespace(conf={"endpoint": "/v1/embeddings"})})
    assert seen["settings"].supported_urls == frozenset({"/v1/embeddings"})
