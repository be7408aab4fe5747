"""Who may use the API: its own rule (``openai_users`` and the auth manager's permission on its resource), on every endpoint; a user sees only their own."""

from __future__ import annotations

import logging

import pytest
from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient

from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.openai_api import access, app as app_module
from airflow_vllm_batch.openai_api.access import (
    FAB_AUTH_MANAGER,
    RESOURCE_NAME,
    SIMPLE_AUTH_MANAGER,
    isolation_gaps,
    may_use,
    owner_key,
    owns,
    parse_users,
)
from airflow_vllm_batch.openai_api.files import FileStore
from airflow_vllm_batch.openai_api.settings import OpenAIApiSettings
from tests.unit.openai_api.test_app import RecordingS3, User

BATCH = "batch_0123456789abcdef"
#: Every route of the API, and the method the API's rule is asked with for it.
ROUTES = [
    ("POST", "/files", "POST"),
    ("GET", "/files", "GET"),
    ("GET", "/files/file-0123456789abcdef", "GET"),
    ("GET", "/files/file-0123456789abcdef/content", "GET"),
    ("DELETE", "/files/file-0123456789abcdef", "DELETE"),
    ("POST", "/batches", "POST"),
    ("GET", "/batches", "GET"),
    ("GET", f"/batches/{BATCH}", "GET"),
    ("POST", f"/batches/{BATCH}/cancel", "PUT"),
]


def test_a_run_without_an_owner_is_nobodys():
    assert not owns({"owner": None}, "")
    assert not owns(None, "alice")


def test_each_user_has_a_key_of_their_own_safe_in_s3():
    keys = {owner_key(u) for u in ("alice", "bob", "Alice", "a/b", "../x")}
    assert len(keys) == 5
    assert all(k.isalnum() and len(k) == 24 for k in keys)


def test_openai_users_is_a_list_of_names_or_a_star():
    assert parse_users("*") is None
    assert parse_users(" * ") is None
    assert parse_users("alice, bob,,") == {"alice", "bob"}


@pytest.mark.parametrize("raw", ["", " , ", "*,alice"])
def test_a_malformed_openai_users_is_refused_naming_the_option(raw):
    with pytest.raises(ConfigurationError, match=r"\[vllm_batch\] openai_users .* or \* for every"):
        parse_users(raw)


def test_a_listed_user_is_asked_about_the_apis_own_resource_never_the_batch_dag(monkeypatch, auth_manager):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_USERS", "alice,bob")
    assert may_use(User(), "PUT")
    assert auth_manager.asked == [("PUT", RESOURCE_NAME, "alice")]
    auth_manager.allowed = False
    assert not may_use(User(), "GET")


def test_a_user_not_listed_in_openai_users_may_not_use_it_whatever_the_auth_manager_says(
    monkeypatch, auth_manager
):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_USERS", "bob")
    assert not may_use(User(), "GET")
    assert auth_manager.asked == []


def test_under_the_simple_auth_manager_a_listed_viewer_may_use_it_and_an_unlisted_admin_may_not(monkeypatch):
    """The simple auth manager grants the custom view to every role: the list of names decides."""
    import airflow.api_fastapi.app as api_app

    manager = SimpleAuthManager()
    monkeypatch.setattr(api_app, "get_auth_manager", lambda: manager)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_USERS", "vera")
    viewer = SimpleAuthManagerUser(username="vera", role="viewer")
    admin = SimpleAuthManagerUser(username="root", role="admin")
    roleless = SimpleAuthManagerUser(username="vera", role=None)
    assert all(may_use(viewer, method) for method in ("GET", "POST", "PUT", "DELETE"))
    assert not may_use(admin, "GET")
    assert not may_use(roleless, "GET")


class TouchedS3(RecordingS3):
    """Records the name of every S3 call made."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __getattribute__(self, name):
        if not name.startswith("_") and name not in ("objects", "calls"):
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)


@pytest.fixture
def http(monkeypatch):
    s3 = TouchedS3()
    monkeypatch.setattr(app_module, "_settings", lambda: OpenAIApiSettings(files_uri="s3://b/p/"))
    monkeypatch.setattr(app_module, "_store", lambda settings: FileStore(s3, "b", "p/"))
    monkeypatch.setattr(app_module, "_trigger", lambda *args: pytest.fail("nothing may be triggered"))
    app_module.app.dependency_overrides[get_user] = User
    yield TestClient(app_module.app, raise_server_exceptions=False), s3
    app_module.app.dependency_overrides.clear()


def _call(client: TestClient, method: str, path: str):
    if path == "/files" and method == "POST":
        return client.post(path, data={"purpose": "batch"}, files={"file": ("a.jsonl", b"{}\n")})
    if path == "/batches" and method == "POST":
        return client.post(
            path, json={"input_file_id": "file-0123456789abcdef", "endpoint": "/v1/completions"}
        )
    return client.request(method, path)


@pytest.mark.parametrize(("method", "path", "asked"), ROUTES)
def test_every_endpoint_asks_the_apis_rule_and_answers_403_when_it_refuses(
    http, auth_manager, method, path, asked
):
    client, s3 = http
    auth_manager.allowed = False
    answer = _call(client, method, path)
    assert answer.status_code == 403, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert RESOURCE_NAME in error["message"]
    assert "openai_users" in error["message"]
    assert auth_manager.asked == [(asked, RESOURCE_NAME, "alice")]
    # Refused before anything is read or written (an upload is not even started).
    assert s3.objects == {}
    assert s3.calls == []


def test_an_upload_is_refused_to_a_user_not_listed_and_nothing_is_stored(http, monkeypatch):
    client, s3 = http
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_USERS", "bob")
    answer = _call(client, "POST", "/files")
    assert answer.status_code == 403
    assert s3.objects == {}


def test_a_malformed_openai_users_answers_503_naming_it(http, monkeypatch):
    client, _ = http
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_USERS", "*,bob")
    answer = client.get("/files")
    assert answer.status_code == 503
    assert "openai_users" in answer.json()["error"]["message"]


def test_an_allowed_user_uploads_with_no_permission_on_the_batch_dag(http, auth_manager):
    client, s3 = http
    answer = _call(client, "POST", "/files")
    assert answer.status_code == 200, answer.text
    assert auth_manager.asked == [("POST", RESOURCE_NAME, "alice")]
    assert s3.objects
    assert s3.calls  # the recorder sees the calls a refused request must not make


def test_the_simple_auth_manager_is_said_not_to_isolate_users_and_fab_is_not():
    (gap,) = isolation_gaps(SIMPLE_AUTH_MANAGER, all_admins=False)
    assert "role viewer" in gap
    assert "task logs" in gap
    (gap,) = isolation_gaps(SIMPLE_AUTH_MANAGER, all_admins=True)
    assert "simple_auth_manager_all_admins" in gap
    (gap,) = isolation_gaps("my.company.KeycloakLike", all_admins=False)
    assert "my.company.KeycloakLike" in gap
    assert "not one the OpenAI API knows" in gap
    assert isolation_gaps(FAB_AUTH_MANAGER, all_admins=True) == []


def test_the_warning_is_logged_for_a_simple_auth_manager(monkeypatch, caplog):
    import airflow.api_fastapi.app as api_app

    manager = SimpleAuthManager()
    monkeypatch.setattr(api_app, "get_auth_manager", lambda: manager)
    with caplog.at_level(logging.WARNING, logger=access.log.name):
        access.warn_if_not_isolated()
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "cannot isolate users" in record.getMessage()
