"""Per-user limits on a real S3: refused with 429 in OpenAI's shape, counting only the caller's own files and batches."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
from airflow.api_fastapi.core_api.security import get_user

from airflow_vllm_batch.openai_api import app as app_module
from airflow_vllm_batch.openai_api.access import owner_key
from airflow_vllm_batch.openai_api.limits import UserLimits, batch_cap, load_limits
from tests.unit.openai_api.conftest import needs_batch_runs
from tests.unit.openai_api.test_create import LINES, api  # noqa: F401 - the fixture


class Bob:
    def get_id(self) -> str:
        return "bob"

    def get_name(self) -> str:
        return "bob"


def upload(client, data: bytes = LINES):
    return client.post("/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", data)})


def create(client, file_id: str):
    return client.post("/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"})


def as_bob():
    app_module.app.dependency_overrides[get_user] = Bob


def as_alice():
    from tests.unit.openai_api.test_app import User

    app_module.app.dependency_overrides[get_user] = User


def assert_limit_error(answer, kind: str, param: str, option: str) -> None:
    assert answer.status_code == 429, answer.text
    assert answer.headers["x-should-retry"] == "false"
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (kind, f"{kind}_limit_exceeded", param)
    assert option in error["message"]


def test_an_upload_over_the_file_cap_is_429_counting_only_the_callers_uploads(api, monkeypatch):  # noqa: F811
    client, store, _ = api
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_FILES", "2")
    as_bob()
    assert upload(client).status_code == upload(client).status_code == 200
    as_alice()
    # A batch's output file (no upload record) is no upload of hers.
    store.client.put_object(
        Bucket=store.bucket, Key=store.content_key(owner_key("alice"), "file-00000000abcdout"), Body=b"{}\n"
    )
    first = upload(client).json()["id"]
    assert upload(client).status_code == 200
    assert_limit_error(upload(client), "files", "file", "openai_max_user_files")
    assert client.delete(f"/files/{first}").status_code == 200
    assert upload(client).status_code == 200


def test_an_upload_over_the_byte_cap_is_429_and_nothing_is_kept(api, monkeypatch):  # noqa: F811
    client, store, _ = api
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_BYTES", str(2 * len(LINES)))
    as_bob()
    assert upload(client, LINES * 2).status_code == 200
    as_alice()
    assert upload(client).status_code == 200
    before = store.upload_usage(owner_key("alice"))
    assert_limit_error(upload(client, LINES * 2), "bytes", "file", "openai_max_user_bytes")
    assert store.upload_usage(owner_key("alice")) == before == (1, len(LINES))
    assert upload(client).status_code == 200


@pytest.fixture
def runs(api, monkeypatch):  # noqa: F811
    """The batch DAG's runs as the database holds them: every triggered run, minus those that ended."""
    _, _, triggered = api
    ended: set[str] = set()

    class Session:
        def execute(self, query):
            rows = [
                SimpleNamespace(run_id=b, dag_id="vllm_batch_openai", conf=conf)
                for b, conf in triggered
                if b not in ended
            ]
            return SimpleNamespace(all=lambda: rows)

    @contextlib.contextmanager
    def create_session():
        yield Session()

    import airflow.utils.session

    monkeypatch.setattr(airflow.utils.session, "create_session", create_session)
    return ended


@needs_batch_runs
def test_a_batch_over_the_active_batch_cap_is_429_counting_only_the_callers_batches(api, runs, monkeypatch):  # noqa: F811
    client, _, triggered = api
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_ACTIVE_BATCHES", "2")
    as_bob()
    bobs = upload(client).json()["id"]
    assert create(client, bobs).status_code == create(client, bobs).status_code == 200
    as_alice()
    file_id = upload(client).json()["id"]
    assert create(client, file_id).status_code == create(client, file_id).status_code == 200
    # A run naming her as owner that the API did not sign is no batch of hers.
    triggered.append(("batch_ffffffffffffffff", {"owner": "alice"}))
    refused = create(client, file_id)
    assert_limit_error(refused, "batches", "input_file_id", "openai_max_user_active_batches")
    assert len(triggered) == 5  # nothing was triggered
    runs.add(triggered[2][0])  # one of hers ended
    assert create(client, file_id).status_code == 200


@needs_batch_runs
def test_a_batch_whose_ending_is_published_no_longer_counts_while_its_run_ends(api, runs, monkeypatch):  # noqa: F811
    """The status shows a batch ended once its manifest is published, seconds before its run ends: the cap agrees."""
    from airflow_vllm_batch.openai_api import batch_view

    client, _, triggered = api
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_ACTIVE_BATCHES", "1")
    published: set[str] = set()
    real = batch_view.published_manifest
    monkeypatch.setattr(
        batch_view,
        "published_manifest",
        lambda store, spec, *rest: (
            {"status": "cancelled"} if spec.batch_id in published else real(store, spec, *rest)
        ),
    )
    as_alice()
    file_id = upload(client).json()["id"]
    assert create(client, file_id).status_code == 200
    assert_limit_error(create(client, file_id), "batches", "input_file_id", "openai_max_user_active_batches")
    published.add(triggered[0][0])  # its ending is published; its run is still running (not in `runs`)
    assert create(client, file_id).status_code == 200


@needs_batch_runs
def test_a_batch_over_the_enqueued_request_cap_is_429(api, runs, monkeypatch):  # noqa: F811
    client, _, _ = api
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_ENQUEUED_REQUESTS", "3")
    as_alice()
    two = upload(client, LINES * 2).json()["id"]
    assert create(client, two).status_code == 200
    assert_limit_error(create(client, two), "requests", "input_file_id", "openai_max_user_enqueued_requests")
    assert create(client, upload(client).json()["id"]).status_code == 200


def test_by_default_only_the_batch_cap_is_on_and_a_bad_value_is_refused_naming_the_option(monkeypatch):
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_ACTIVE_BATCHES")
    assert load_limits() == UserLimits() == UserLimits(0, 0, None, 0)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_ACTIVE_BATCHES", " Auto ")
    assert load_limits().max_active_batches is None
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_ACTIVE_BATCHES", "0")
    assert load_limits().max_active_batches == 0
    for bad in ("-1", "half"):
        monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_ACTIVE_BATCHES", bad)
        with pytest.raises(
            Exception, match=rf"openai_max_user_active_batches is '{bad}': give a whole number.*'auto'"
        ):
            load_limits()
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_FILES", "auto")
    with pytest.raises(
        Exception, match=r"openai_max_user_files is 'auto': give a whole number, 0 for no limit \("
    ):
        load_limits()


@pytest.mark.parametrize(
    ("configured", "dag_slots", "cap"),
    [
        (None, 4, 2),
        (None, 5, 2),
        (None, 1, 1),
        (None, 16, 8),
        (None, None, 0),
        (3, 4, 3),
        (0, 4, 0),
        (6, None, 6),
    ],
)
def test_the_auto_batch_cap_is_half_the_dags_run_slots_at_least_one(configured, dag_slots, cap):
    assert batch_cap(configured, dag_slots)[0] == cap


@needs_batch_runs
def test_by_default_a_user_holds_half_the_batch_dags_run_slots_and_the_429_says_why(api, runs, monkeypatch):  # noqa: F811
    """The default cap: with the batch DAG's max_active_runs 4, one user's third batch is refused, another user's is not."""
    from airflow_vllm_batch.openai_api import batch_runs

    client, _, triggered = api
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_ACTIVE_BATCHES")
    asked: list[str] = []
    monkeypatch.setattr(batch_runs, "dag_max_active_runs", lambda dag_id: asked.append(dag_id) or 4)
    as_alice()
    file_id = upload(client).json()["id"]
    assert create(client, file_id).status_code == create(client, file_id).status_code == 200
    refused = create(client, file_id)
    assert_limit_error(refused, "batches", "input_file_id", "openai_max_user_active_batches = auto")
    assert "half the batch DAG's max_active_runs (4)" in refused.json()["error"]["message"]
    assert asked
    assert set(asked) == {"vllm_batch_openai"}
    as_bob()
    assert create(client, upload(client).json()["id"]).status_code == 200
    assert len(triggered) == 3
    runs.add(triggered[0][0])  # one of hers ended: she may create one again
    as_alice()
    assert create(client, file_id).status_code == 200


def test_the_sdk_raises_rate_limit_error_at_once_without_retrying(api, monkeypatch):  # noqa: F811
    """The unmodified SDK: a 429 with x-should-retry false is RateLimitError on the first answer (no backoff, no retry)."""
    import openai

    client, _, _ = api
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_FILES", "1")
    as_alice()
    sent = []
    client.event_hooks["request"].append(lambda request: sent.append(request.url.path))
    sdk = openai.OpenAI(api_key="token", base_url="http://testserver", http_client=client, max_retries=2)
    sdk.files.create(file=("in.jsonl", LINES), purpose="batch")
    with pytest.raises(openai.RateLimitError) as refused:
        sdk.files.create(file=("in.jsonl", LINES), purpose="batch")
    assert refused.value.code == "files_limit_exceeded"
    assert refused.value.type == "files"
    assert sent == ["/files", "/files"]
