"""POST /batches on a real S3: the batch runs a copy of its input made at create, and its run's conf holds no location and no metadata."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient

from airflow_vllm_batch.openai_api import app as app_module, callers
from airflow_vllm_batch.openai_api.access import owner_key
from airflow_vllm_batch.openai_api.batch_runs import BatchRun
from airflow_vllm_batch.openai_api.batch_spec import BatchSpec
from airflow_vllm_batch.openai_api.batch_view import batch_from_run
from airflow_vllm_batch.openai_api.files import FileStore
from airflow_vllm_batch.openai_api.settings import OpenAIApiSettings
from tests.unit.openai_api.conftest import KEY
from tests.unit.openai_api.test_app import User

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'


@pytest.fixture
def api(s3, bucket, monkeypatch):
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    store = FileStore(S3Hook(aws_conn_id="aws_default").get_conn(), bucket, "p/")
    triggered: list[tuple[str, dict]] = []
    monkeypatch.setattr(app_module, "_settings", lambda: OpenAIApiSettings(files_uri=f"s3://{bucket}/p/"))
    monkeypatch.setattr(app_module, "_store", lambda settings: store)
    monkeypatch.setattr(callers, "may_use", lambda user, method: True)
    monkeypatch.setattr(app_module, "load_routes", lambda: {})
    monkeypatch.setattr(
        app_module, "_trigger", lambda dag_id, batch_id, conf, user: triggered.append((batch_id, conf))
    )
    app_module.app.dependency_overrides[get_user] = User
    yield TestClient(app_module.app), store, triggered
    app_module.app.dependency_overrides.clear()


def _upload(client: TestClient, data: bytes = LINES) -> str:
    answer = client.post("/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", data)})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def _create(client: TestClient, file_id: str, **extra) -> dict:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **extra}
    answer = client.post("/batches", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_batch_runs_its_own_copy_of_the_input_whatever_happens_to_the_file_after_create(api):
    client, store, triggered = api
    file_id = _upload(client)
    batch = _create(client, file_id)
    batch_id, conf = triggered[0]
    spec = BatchSpec.verified(conf, batch_id, KEY, "vllm_batch_openai")
    pinned = store.client.get_object(Bucket=store.bucket, Key=store.batch_input_key(batch_id))
    assert pinned["Body"].read() == LINES
    assert pinned["ETag"].strip('"') == spec.input_version
    # Replaced, then deleted: the batch's copy, and so its run, is as it was at create.
    store.client.put_object(
        Bucket=store.bucket, Key=store.content_key(owner_key("alice"), file_id), Body=b"replaced\n"
    )
    assert client.delete(f"/files/{file_id}").status_code == 200
    kept = store.client.get_object(Bucket=store.bucket, Key=store.batch_input_key(batch_id))
    assert kept["Body"].read() == LINES
    assert kept["ETag"].strip('"') == spec.input_version
    assert spec.locations(f"s3://{store.bucket}/p/").input_uri == store.uri(store.batch_input_key(batch_id))
    assert batch["input_file_id"] == file_id


def test_a_batch_runs_conf_holds_the_signed_spec_and_no_location_or_metadata(api):
    client, store, triggered = api
    batch = _create(client, _upload(client), metadata={"team": "search", "secret-project": "x"})
    batch_id, conf = triggered[0]
    assert not [k for k in conf if k.endswith("_uri")]
    assert "metadata" not in conf
    assert "s3://" not in json.dumps(conf)
    assert "search" not in json.dumps(conf)
    assert BatchSpec.verified(conf, batch_id, KEY, "vllm_batch_openai").owner == "alice"
    assert batch["metadata"] == {"team": "search", "secret-project": "x"}
    assert store.get_json(store.batch_record_key(batch_id)) == {
        "metadata": {"team": "search", "secret-project": "x"},
        "completion_window": "24h",
        "total": 1,
    }


def test_a_batch_shows_its_signed_spec_and_the_apis_record_not_fields_added_to_its_conf(api, monkeypatch):
    """A run re-triggered with the signed conf plus fields of its own (a longer window, another count): none is shown."""
    client, store, triggered = api
    batch = _create(client, _upload(client))
    batch_id, conf = triggered[0]
    padded = {
        **conf,
        "completion_window": "72h",
        "total": 999,
        "model": "gpt-x",
        "output_file_id": "file-mine",
    }
    run = SimpleNamespace(
        run_id=batch_id, dag_id="vllm_batch_openai", conf=padded, state="queued", end_date=None
    )
    spec = app_module._verifier()(run)
    assert spec is not None
    shown = batch_from_run(store, BatchRun(run, spec), "aws_default")
    for field in ("completion_window", "expires_at", "request_counts", "model"):
        assert shown[field] == batch[field], field
    assert shown["completion_window"] == "24h"
    assert shown["request_counts"]["total"] == 1


def test_without_a_signing_key_no_batch_is_created(api, monkeypatch):
    client, _, triggered = api
    file_id = _upload(client)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY", "")
    answer = client.post(
        "/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert answer.status_code == 503
    assert "openai_signing_key" in answer.json()["error"]["message"]
    assert triggered == []


def test_a_create_that_fails_to_trigger_leaves_no_copy_and_no_record(api, monkeypatch):
    client, store, _ = api
    file_id = _upload(client)

    def not_deployed(*args):
        raise app_module.OpenAIError(503, "the batch DAG is not deployed")

    monkeypatch.setattr(app_module, "_trigger", not_deployed)
    answer = client.post(
        "/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert answer.status_code == 503
    assert store.client.list_objects_v2(Bucket=store.bucket, Prefix="p/batches/").get("KeyCount", 0) == 0
