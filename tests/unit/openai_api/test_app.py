"""The app's upload endpoint, in process: the size limit and the purpose are enforced while streaming, in OpenAI's error shape."""

from __future__ import annotations

import pytest
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient

from airflow_vllm_batch.openai_api import app as app_module
from airflow_vllm_batch.openai_api.files import FileStore
from airflow_vllm_batch.openai_api.settings import OpenAIApiSettings
from tests.unit.openai_api.test_files import FakeS3


class User:
    def get_id(self) -> str:
        return "alice"

    def get_name(self) -> str:
        return "alice"


class RecordingS3(FakeS3):
    def __init__(self):
        super().__init__()
        self.objects: dict[str, bytes] = {}

    def put_object(self, *, Key, Body, **kw):
        self.objects[Key] = Body
        return {"ETag": '"e"'}  # S3 answers every PUT with the object's ETag


@pytest.fixture
def s3(monkeypatch):
    s3 = RecordingS3()
    monkeypatch.setattr(
        app_module, "_settings", lambda: OpenAIApiSettings(files_uri="s3://b/p/", max_file_bytes=100)
    )
    monkeypatch.setattr(app_module, "_store", lambda settings: FileStore(s3, "b", "p/"))
    app_module.app.dependency_overrides[get_user] = User
    yield s3
    app_module.app.dependency_overrides.clear()


def test_an_upload_over_the_size_limit_is_refused_with_413_and_nothing_kept(s3):
    answer = TestClient(app_module.app).post(
        "/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"{}\n" * 50)}
    )
    assert answer.status_code == 413
    assert "openai_max_file_bytes" in answer.json()["error"]["message"]
    assert answer.json()["error"]["param"] == "file"
    assert s3.objects == {}
    assert s3.put is None


def test_an_upload_for_another_purpose_is_refused(s3):
    answer = TestClient(app_module.app).post(
        "/files", data={"purpose": "fine-tune"}, files={"file": ("a.jsonl", b"{}\n")}
    )
    assert answer.status_code == 400
    assert "purpose='batch'" in answer.json()["error"]["message"]
    assert s3.objects == {}


def test_an_upload_is_kept_under_the_users_key_with_its_record(s3):
    answer = TestClient(app_module.app).post(
        "/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"{}\n{}\n")}
    )
    assert answer.status_code == 200, answer.text
    file_id = answer.json()["id"]
    assert answer.json()["bytes"] == 6
    assert answer.json()["filename"] == "a.jsonl"
    keys = sorted(s3.objects)
    assert [k.rsplit("/", 1)[-1] for k in keys] == [f"{file_id}.json", f"{file_id}.jsonl"]
    assert all(k.startswith("p/files/") for k in keys)


def test_without_a_token_the_app_answers_401_in_openais_shape():
    answer = TestClient(app_module.app).get("/batches")
    assert answer.status_code == 401
    assert answer.json()["error"]["type"] == "authentication_error"


def test_live_counts_that_cannot_be_read_leave_the_status_call_answering():
    from airflow_vllm_batch.openai_api.batch_view import live_progress

    class Broken:
        def get_object(self, **kw):
            raise ConnectionError("S3 is down")

    assert live_progress(FileStore(Broken(), "b", "p/"), "batch_0123456789abcdef") is None
