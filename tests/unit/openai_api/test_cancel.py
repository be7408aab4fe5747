"""Cancel asks the run to stop (it changes no DAG run); the status reads a published manifest whose files still have its ETags."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient

from airflow_vllm_batch.manifest import Manifest, RequestCounts, Usage
from airflow_vllm_batch.openai_api import app as app_module, callers
from airflow_vllm_batch.openai_api.batch_runs import BatchRun
from airflow_vllm_batch.openai_api.batch_spec import BatchSpec
from airflow_vllm_batch.openai_api.batch_view import ending, published_manifest
from airflow_vllm_batch.openai_api.files import FileStore
from airflow_vllm_batch.openai_api.settings import OpenAIApiSettings
from airflow_vllm_batch.storage.layout import manifest_uri
from tests.unit.openai_api.conftest import KEY
from tests.unit.openai_api.test_app import User

BATCH = "batch_0123456789abcdef"


@pytest.fixture
def api(s3, bucket, monkeypatch):
    store = FileStore(s3.client(), bucket, "p/")
    spec = BatchSpec(
        batch_id=BATCH,
        dag_id="vllm_batch_openai",
        owner="alice",
        input_file_id="file-0123456789",
        input_version="0f0f",
        endpoint="/v1/chat/completions",
        route="",
        created_at=1_800_000_000,
        window_s=86400,
    )
    where = spec.locations(f"s3://{bucket}/p/")
    conf = {
        **spec.sign(KEY),
        "completion_window": "24h",
        "total": 2,
        "output_file_id": spec.output_file_id,
        "error_file_id": spec.error_file_id,
    }
    state = SimpleNamespace(
        run=SimpleNamespace(
            run_id=BATCH, dag_id="vllm_batch_openai", conf=conf, state="running", end_date=None
        ),
        tis=[],
    )
    monkeypatch.setattr(app_module, "_settings", lambda: OpenAIApiSettings(files_uri=f"s3://{bucket}/p/"))
    monkeypatch.setattr(app_module, "_store", lambda settings: store)
    monkeypatch.setattr(
        app_module, "_own_run", lambda settings, batch_id, user: BatchRun(state.run, spec, state.tis)
    )
    monkeypatch.setattr(callers, "may_use", lambda user, method: True)
    app_module.app.dependency_overrides[get_user] = User
    yield SimpleNamespace(
        store=store,
        state=state,
        spec=spec,
        where=where,
        client=s3.client(),
        bucket=bucket,
        http=TestClient(app_module.app),
    )
    app_module.app.dependency_overrides.clear()


def key(uri: str) -> str:
    return uri.split("/", 3)[3]


def ti(state: str):
    return SimpleNamespace(task_id="vllm_batch", state=state, start_date=None, end_date=None)


def publish(api, status: str | None = None) -> None:
    """A manifest as the batch task publishes it, naming its files' ETags."""
    etags = {}
    for name, uri in (("out", api.where.output_uri), ("err", api.where.error_uri)):
        etags[name] = api.client.put_object(Bucket=api.bucket, Key=key(uri), Body=b"{}\n")["ETag"].strip('"')
    manifest = Manifest(
        output_uri=api.where.output_uri,
        error_uri=api.where.error_uri,
        input_uri=None,
        model=None,
        request_counts=RequestCounts(total=2, completed=1, failed=1),
        usage=Usage(),
        duration_s=1.0,
        vllm_version=None,
        fingerprint="f" * 64,
        manifest_uri=manifest_uri(api.where.output_uri),
        # The batch's pinned input (its signed ETag): the manifest of this batch's ending, not another input's.
        input_etag=api.spec.input_version,
        output_etag=etags["out"],
        error_etag=etags["err"],
        status=status,
    )
    manifest_key = key(manifest_uri(api.where.output_uri))
    api.client.put_object(Bucket=api.bucket, Key=manifest_key, Body=manifest.to_json())


def test_cancelling_a_running_batch_asks_its_run_to_stop_and_marks_nothing_failed(api, monkeypatch):
    monkeypatch.setattr(
        app_module,
        "_mark_failed",
        lambda *a: pytest.fail("a cancel must not fail the DAG run"),
        raising=False,
    )
    api.state.tis = [ti("running")]
    answer = api.http.post(f"/batches/{BATCH}/cancel")
    assert answer.status_code == 200
    assert answer.json()["status"] == "cancelling"
    assert api.store.get_json(api.store.cancel_key(BATCH))["by"] == "alice"
    # Asked again while it stops: the same batch, still cancelling.
    assert api.http.post(f"/batches/{BATCH}/cancel").json()["status"] == "cancelling"


@pytest.mark.parametrize("status", [None, "cancelled", "expired"])
def test_cancelling_an_ended_batch_is_409(api, status):
    publish(api, status)
    api.state.run.state = "success"
    answer = api.http.post(f"/batches/{BATCH}/cancel")
    assert answer.status_code == 409
    assert answer.json()["error"]["message"].startswith("Cannot cancel a batch with status")


def test_a_cancelled_batch_reports_its_published_counts_and_files(api):
    api.store.put_json(api.store.cancel_key(BATCH), {"cancelling_at": 1_800_000_100})
    publish(api, "cancelled")
    batch = api.http.get(f"/batches/{BATCH}").json()
    assert batch["status"] == "cancelled"
    assert batch["request_counts"] == {
        "total": 2,
        "completed": 1,
        "failed": 1,
    }
    assert (batch["output_file_id"], batch["error_file_id"]) == (
        api.spec.output_file_id,
        api.spec.error_file_id,
    )


def test_a_manifest_whose_files_were_replaced_is_not_published(api):
    publish(api)

    def published():
        return published_manifest(
            api.store, api.spec, api.where.output_uri, api.where.error_uri, "aws_default"
        )

    assert published() is not None
    api.client.put_object(Bucket=api.bucket, Key=key(api.where.error_uri), Body=b"other\n")
    assert published() is None


def test_a_published_batch_ended_when_its_manifest_object_was_written(api):
    """The status's ending time is the manifest's ``LastModified`` in S3, read with the manifest (no other call)."""
    publish(api)
    manifest, published_at = ending(
        api.store, api.spec, api.where.output_uri, api.where.error_uri, "aws_default"
    )
    assert manifest is not None
    written = api.client.head_object(Bucket=api.bucket, Key=key(manifest_uri(api.where.output_uri)))
    assert published_at == written["LastModified"]
    batch = api.http.get(f"/batches/{BATCH}").json()
    assert batch["completed_at"] == batch["finalizing_at"] == int(published_at.timestamp())


def test_a_manifest_of_another_input_is_not_this_batchs_ending(api):
    publish(api)
    assert api.http.get(f"/batches/{BATCH}").json()["status"] == "completed"
    api.spec = dataclasses.replace(api.spec, input_version="another")
    assert (
        published_manifest(api.store, api.spec, api.where.output_uri, api.where.error_uri, "aws_default")
        is None
    )


def test_live_counts_come_from_the_progress_record(api):
    api.state.tis = [SimpleNamespace(task_id="vllm_batch", state="running", start_date=None, end_date=None)]
    api.state.tis[0].start_date = __import__("datetime").datetime(2027, 1, 1)
    api.store.put_json(api.store.progress_key(BATCH), {"completed": 5, "failed": 1})
    batch = api.http.get(f"/batches/{BATCH}").json()
    assert batch["status"] == "in_progress"
    assert batch["request_counts"]["completed"] == 5
    assert batch["request_counts"]["failed"] == 1


@pytest.mark.parametrize(("status", "deleted"), [("expired", "err"), ("cancelled", "err"), (None, "out")])
def test_an_ended_batch_keeps_its_status_counts_and_file_ids_when_its_owner_deletes_a_result_file(
    api, status, deleted
):
    publish(api, status)
    api.state.run.state = "success"
    before = api.http.get(f"/batches/{BATCH}").json()
    uri = api.where.error_uri if deleted == "err" else api.where.output_uri
    api.client.delete_object(Bucket=api.bucket, Key=key(uri))  # what DELETE /files/{id} does to its content
    after = api.http.get(f"/batches/{BATCH}").json()
    assert after == before
    assert after["status"] == (status or "completed")
    assert after["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
