"""The API's edges speak OpenAI's contract: 401 for any token that does not authenticate, a request id on every answer, limits enforced, unknown parameters refused."""

from __future__ import annotations

import pytest
from airflow.api_fastapi.core_api.security import get_user
from fastapi import HTTPException
from fastapi.testclient import TestClient

from airflow_vllm_batch.batchfile.preflight_report import PreflightReport
from airflow_vllm_batch.batchfile.problems import Problem
from airflow_vllm_batch.exceptions import ConfigurationError, PreflightError
from airflow_vllm_batch.openai_api import app as app_module, callers
from airflow_vllm_batch.openai_api.batch_dag import failure_record
from airflow_vllm_batch.openai_api.files import FileStore
from airflow_vllm_batch.openai_api.settings import OpenAIApiSettings, parse_windows
from tests.unit.openai_api.test_app import RecordingS3, User


@pytest.fixture
def client(monkeypatch):
    s3 = RecordingS3()
    triggered = []
    monkeypatch.setattr(
        app_module, "_settings", lambda: OpenAIApiSettings(files_uri="s3://b/p/", max_file_bytes=1000)
    )
    monkeypatch.setattr(app_module, "_store", lambda settings: FileStore(s3, "b", "p/"))
    monkeypatch.setattr(callers, "may_use", lambda user, method: True)
    monkeypatch.setattr(app_module, "_trigger", lambda *args: triggered.append(args))
    app_module.app.dependency_overrides[get_user] = User
    yield TestClient(app_module.app, raise_server_exceptions=False), s3, triggered
    app_module.app.dependency_overrides.clear()


def _raising(status: int, detail: str):
    def dependency():
        raise HTTPException(status_code=status, detail=detail)

    return dependency


@pytest.mark.parametrize(
    ("status", "detail"), [(403, "Invalid JWT token"), (401, "Token Expired"), (401, "Not authenticated")]
)
def test_a_token_that_does_not_authenticate_is_a_401_authentication_error(status, detail):
    # What Airflow's get_user raises for a wrong, an expired and a missing token.
    app_module.app.dependency_overrides[get_user] = _raising(status, detail)
    try:
        answer = TestClient(app_module.app).get("/batches")
    finally:
        app_module.app.dependency_overrides.clear()
    assert answer.status_code == 401
    assert answer.json()["error"]["type"] == "authentication_error"
    assert "POST /auth/token" in answer.json()["error"]["message"]
    assert answer.headers["www-authenticate"] == "Bearer"


def test_a_permission_refused_by_the_auth_manager_stays_403(client, monkeypatch):
    http, _, _ = client
    monkeypatch.setattr(callers, "may_use", lambda user, method: False)
    answer = http.post(
        "/batches",
        json={
            "input_file_id": "file-0123456789",
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert answer.status_code == 403
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_every_answer_has_its_own_request_id_errors_and_failures_too(client, monkeypatch):
    http, _, _ = client
    ok = http.post("/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"{}\n")})
    refused = http.post("/batches", json={"input_file_id": "file-x", "endpoint": "/v1/nope"})
    monkeypatch.setattr(app_module, "_settings", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    failed = http.get("/files")
    ids = [a.headers.get("x-request-id") for a in (ok, refused, failed)]
    assert (ok.status_code, refused.status_code, failed.status_code) == (200, 400, 500)
    assert all(i and i.startswith("req_") for i in ids), ids
    assert len(set(ids)) == 3, ids
    assert failed.json()["error"]["type"] == "server_error"
    assert "boom" not in failed.text


@pytest.mark.parametrize(
    ("metadata", "why"),
    [
        ({f"k{i}": "v" for i in range(17)}, "17 keys: give at most 16"),
        ({"k" * 65: "v"}, "65 characters: give at most 64"),
        ({"k": "v" * 513}, "513 characters: give at most 512"),
    ],
)
def test_metadata_over_openais_limits_is_refused_naming_the_parameter(client, metadata, why):
    http, _, triggered = client
    answer = http.post(
        "/batches",
        json={"input_file_id": "file-0123456789", "endpoint": "/v1/chat/completions", "metadata": metadata},
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "metadata"
    assert why in answer.json()["error"]["message"]
    assert triggered == []


def test_metadata_at_openais_limits_is_accepted():
    app_module._check_metadata({f"{i:0>64}": "v" * 512 for i in range(16)})


@pytest.mark.parametrize("window", ["1h", "48h", "7d", "24"])
def test_a_completion_window_not_offered_is_refused_listing_the_offered_ones(client, window):
    http, _, triggered = client
    answer = http.post(
        "/batches",
        json={
            "input_file_id": "file-0123456789",
            "endpoint": "/v1/chat/completions",
            "completion_window": window,
        },
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "completion_window"
    assert "use '24h'" in answer.json()["error"]["message"]
    assert triggered == []


def test_the_offered_windows_are_the_deployments_setting():
    assert parse_windows("") == ("24h",)
    assert parse_windows("24h, 72h") == ("24h", "72h")
    with pytest.raises(ConfigurationError, match="openai_completion_windows has 'soon'"):
        parse_windows("24h,soon")


def test_a_batchs_output_expiry_is_refused_not_ignored(client):
    http, _, triggered = client
    body = {
        "input_file_id": "file-0123456789",
        "endpoint": "/v1/chat/completions",
        "output_expires_after": {"anchor": "created_at", "seconds": 3600},
    }
    answer = http.post("/batches", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "output_expires_after"
    assert "not a parameter this API takes" in answer.json()["error"]["message"]
    assert triggered == []


def test_a_files_expiry_is_refused_not_ignored_and_nothing_is_kept(client):
    http, s3, _ = client
    form = {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    answer = http.post("/files", data=form, files={"file": ("a.jsonl", b"{}\n")})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "expires_after"
    assert s3.objects == {}


def test_an_empty_files_problem_is_told_once():
    problem = Problem(0, None, "the file has no requests — check that the right file was uploaded")
    report = PreflightReport(total_lines=0, valid_lines=0, invalid_lines=0)
    report.file_problems.append(problem)
    report.problems.append(problem)
    record = failure_record(PreflightError("the file has no requests", report))
    assert [e["message"] for e in record["errors"]] == [problem.message]
