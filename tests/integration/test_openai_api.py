"""The OpenAI Files and Batches API, driven by the official ``openai`` SDK, unmodified, against a real deployment.

One LocalExecutor deployment for the module (``vllm_batch_embedded/airflow_deployment.py``: api-server, scheduler,
dag-processor on 127.0.0.1, SQLite, SeaweedFS as S3) with the provider's plugin mounted at
``/vllm-batch/openai/v1`` and the repo's ``dags/vllm_batch_openai.py`` as the batch DAG
(vLLM's batch runner on the tiny model). Users of Airflow's simple auth manager, as the
docs tell a deployment to make API users: ``alice`` and ``bob``, role ``viewer`` (which
changes nothing through Airflow's own API) and listed in ``[vllm_batch] openai_users``;
``vera``, a ``viewer`` not listed (the API refuses her); ``admin``. The SDK's ``api_key`` is
each user's Airflow API token from ``POST /auth/token``.

Two real runner runs (alice's good batch, and one whose lines the engine refuses in part); the
other batches fail in preflight or are cancelled before their task starts an engine. A second
deployment, whose batch DAG streams through a warm vLLM server (``warm_api``), shows a cancel
mid-run keeping the answers finished so far.

Fresh processes: the API plugin needs a deployment of its own settings (``api``); each batch's
runner engine is its task's child. ``warm_api`` is a second deployment (a ``vllm`` connection,
another files prefix) on the session's warm server. ``restarted`` adds three API servers to
``api`` (its database, DAGs and S3), each with the configuration a restart would give it: a
clock a day ahead, a rotated signing key with per-user limits, the old key dropped; the last
test restarts ``warm_api``'s scheduler with the rotated key.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import importlib.metadata
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil
import pytest
from openai import (
    AuthenticationError,
    ConflictError,
    NotFoundError,
    OpenAI,
    PermissionDeniedError,
    RateLimitError,
)
from openai.types.chat import ChatCompletion

from airflow_vllm_batch.openai_api.access import owner_key
from airflow_vllm_batch.openai_api.files import result_file_ids
from airflow_vllm_batch.version_compat import AIRFLOW_V_3_2_PLUS

if AIRFLOW_V_3_2_PLUS:
    from airflow.sdk.exceptions import TaskDeferred
else:
    from airflow.exceptions import TaskDeferred
from airflow_vllm_batch.openai_api.settings import DEFAULT_BATCH_DAG_ID, URL_PREFIX
from airflow_vllm_batch.storage.layout import manifest_uri
from tests.integration.dagrun import REPO
from tests.integration.extra_api_server import ExtraApiServer, extra_api_servers
from tests.integration.vllm_metrics import requests_answered
from vllm_batch_embedded.airflow_deployment import (
    Deployment,
    local_executor_deployment,
    signal_group,
    wait_until,
)

if TYPE_CHECKING:
    from openai.types import Batch, FileObject

    from airflow_vllm_batch.engines.vllm.server_process import VLLMServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.engine]

BUCKET = "openai"
N_REQUESTS = 3
#: The statuses of a batch that has not ended (its run is queued or running).
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
#: One engine start on two shared cores, with the scheduler's own pace: generous.
BATCH_TIMEOUT_S = 420
SIGNING_KEY = "integration-signing-key-" + "0" * 16
#: A second DAG built with openai_batch_dag (a staging DAG, one per team): it must run none of the first's batches.
SECOND_DAG_ID = "vllm_batch_openai_second"
PLUGIN_SHIM = "from airflow_vllm_batch.openai_api.plugin import VLLMBatchOpenAIPlugin  # noqa: F401\n"


def _entry_point_installed() -> bool:
    return any(
        ep.value.startswith("airflow_vllm_batch.openai_api.plugin")
        for ep in importlib.metadata.entry_points(group="airflow.plugins")
    )


@dataclass
class Api:
    dep: Deployment
    clients: dict[str, OpenAI]
    model: str

    @property
    def base_url(self) -> str:
        return self.dep.api_url + URL_PREFIX


@pytest.fixture(scope="module")
def api(seaweed, tiny_model: Path, tmp_path_factory) -> Iterator[Api]:
    seaweed.create_bucket(BUCKET)
    home = tmp_path_factory.mktemp("openai-api-home")
    if not _entry_point_installed():
        # A clone whose editable install predates the entry point (pip install -e . adds it):
        # the same plugin class through Airflow's plugins folder.
        (home / "plugins").mkdir()
        (home / "plugins" / "vllm_batch_openai_api.py").write_text(PLUGIN_SHIM)
    env = {
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,alice:viewer,bob:viewer,vera:viewer",
        # The API's own rule under the simple auth manager (whose roles must stay viewer): who may use it.
        "AIRFLOW__VLLM_BATCH__OPENAI_USERS": "alice,bob",
        "AIRFLOW__VLLM_BATCH__OPENAI_FILES_URI": f"s3://{BUCKET}/api/",
        # The API server and the workers share it (the LocalExecutor's workers inherit the scheduler's environment).
        "AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY": SIGNING_KEY,
    }
    example = (REPO / "dags" / "vllm_batch_openai.py").read_text()
    second = example.replace('queue="gpu",', f'queue="gpu",\n    dag_id="{SECOND_DAG_ID}",', 1)
    assert second != example
    dag_files = {"vllm_batch_openai.py": example, "vllm_batch_openai_second.py": second}
    with local_executor_deployment(seaweed, tiny_model, home, dag_files, extra_env=env) as dep:
        dep.wait_for_dag(DEFAULT_BATCH_DAG_ID)
        dep.wait_for_dag(SECOND_DAG_ID)
        clients = {}
        for user in ("alice", "bob", "vera"):
            dep.log_in(user)
            clients[user] = OpenAI(
                base_url=dep.api_url + URL_PREFIX, api_key=dep.token, max_retries=0, timeout=60
            )
        dep.log_in()  # the deployment's own calls (reading runs, triggering by hand) are the admin's
        yield Api(dep, clients, str(tiny_model))


def _lines(model: str, n: int = N_REQUESTS) -> bytes:
    body = lambda i: {
        "model": model,
        "messages": [{"role": "user", "content": f"Say {i}."}],
        "max_completion_tokens": 4,
        "temperature": 0,
    }
    return b"".join(
        json.dumps(
            {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body(i)}
        ).encode()
        + b"\n"
        for i in range(n)
    )


def _wait(api: Api, client: OpenAI, batch_id: str, done: tuple[str, ...]) -> Batch:
    def ended():
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in done else None

    try:
        return wait_until(f"batch {batch_id} to reach {done}", ended, BATCH_TIMEOUT_S, api.dep, interval=2)
    except Exception:
        print(api.dep.diagnose(DEFAULT_BATCH_DAG_ID, batch_id, "vllm_batch"))
        print(api.dep.log("api-server")[-4000:])
        raise


@pytest.fixture(scope="module")
def completed(api: Api) -> tuple[FileObject, Batch, list[Batch]]:
    """Alice's good batch, from upload to ``completed``, and every status it was seen in."""
    alice = api.clients["alice"]
    uploaded = alice.files.create(file=("requests.jsonl", _lines(api.model)), purpose="batch")
    batch = alice.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"test": "good"},
    )
    seen = [batch]
    # The batch runs its input as it was when created: deleting the file now changes nothing (issue 33, item 8).
    alice.files.delete(uploaded.id)

    def ended():
        seen.append(alice.batches.retrieve(batch.id))
        return seen[-1] if seen[-1].status in ("completed", "failed", "cancelled", "expired") else None

    try:
        final = wait_until("the good batch to end", ended, BATCH_TIMEOUT_S, api.dep, interval=2)
    except Exception:
        print(api.dep.diagnose(DEFAULT_BATCH_DAG_ID, batch.id, "vllm_batch"))
        raise
    return uploaded, final, seen


def test_without_a_token_the_api_answers_401(api: Api):
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(api.base_url + "/batches", timeout=30)  # loopback only
    assert err.value.code == 401
    assert "error" in json.loads(err.value.read())


def test_a_wrong_token_is_the_sdks_authentication_error_and_every_answer_has_a_request_id(api: Api):
    wrong = OpenAI(base_url=api.base_url, api_key="not-an-airflow-token", max_retries=0, timeout=60)
    with pytest.raises(AuthenticationError) as refused:
        wrong.batches.list()
    assert refused.value.status_code == 401
    assert (refused.value.request_id or "").startswith("req_")
    uploaded = api.clients["alice"].files.create(file=("id.jsonl", _lines(api.model, 1)), purpose="batch")
    assert (uploaded._request_id or "").startswith("req_")
    api.clients["alice"].files.delete(uploaded.id)


def test_an_uploaded_file_is_listed_retrieved_and_read_back_by_its_owner_only(api: Api):
    alice, bob = api.clients["alice"], api.clients["bob"]
    data = _lines(api.model, 2)
    uploaded = alice.files.create(file=("two.jsonl", data), purpose="batch")
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (len(data), "two.jsonl", "batch")
    assert alice.files.retrieve(uploaded.id).id == uploaded.id
    assert alice.files.content(uploaded.id).content == data
    assert uploaded.id in [f.id for f in alice.files.list()]
    assert uploaded.id not in [f.id for f in bob.files.list()]
    with pytest.raises(NotFoundError):
        bob.files.retrieve(uploaded.id)
    with pytest.raises(NotFoundError):
        bob.files.content(uploaded.id)
    assert alice.files.delete(uploaded.id).deleted
    with pytest.raises(NotFoundError):
        alice.files.retrieve(uploaded.id)


def test_a_batch_runs_to_completed_and_its_output_parses_with_the_sdks_types(api: Api, completed):
    uploaded, batch, seen = completed
    assert batch.status == "completed", batch
    assert batch.input_file_id == uploaded.id
    assert batch.metadata == {"test": "good"}
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        N_REQUESTS,
        N_REQUESTS,
        0,
    )
    assert batch.error_file_id is None
    assert batch.output_file_id
    assert batch.created_at <= batch.in_progress_at <= batch.completed_at
    statuses = [b.status for b in seen]
    assert statuses[0] == "validating"
    assert set(statuses) <= {
        "validating",
        "in_progress",
        "finalizing",
        "completed",
    }
    alice = api.clients["alice"]
    lines = alice.files.content(batch.output_file_id).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in lines) == [f"req-{i}" for i in range(N_REQUESTS)]
    for line in lines:
        record = json.loads(line)
        assert record["response"]["status_code"] == 200
        ChatCompletion.model_validate(record["response"]["body"])
    output = alice.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output"
    assert output.bytes == len(alice.files.content(batch.output_file_id).content)


@pytest.fixture(scope="module")
def failed(api: Api) -> Batch:
    """Alice's batch of a bad file (lines 2 and 4), ended ``failed`` in preflight, before any engine."""
    alice = api.clients["alice"]
    good = _lines(api.model, 3).splitlines(keepends=True)
    bad = (
        good[0]
        + b"{not json\n"
        + good[2]
        + b'{"custom_id": "req-9", "method": "POST", "url": "/v1/chat/completions"}\n'
    )
    uploaded = alice.files.create(file=("bad.jsonl", bad), purpose="batch")
    batch = alice.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return _wait(api, alice, batch.id, ("completed", "failed", "cancelled", "expired"))


def test_a_bad_file_fails_in_preflight_with_line_numbered_errors(api: Api, failed: Batch):
    assert failed.status == "failed", failed
    assert sorted(e.line for e in failed.errors.data) == [2, 4], failed.errors
    assert all(e.code == "invalid_request" and e.message for e in failed.errors.data)
    # Preflight failed before any engine: nothing was published, and the run never was in progress.
    assert failed.output_file_id is None
    assert failed.in_progress_at is None
    log = api.dep.task_log(DEFAULT_BATCH_DAG_ID, failed.id, "vllm_batch", 1)
    # Told once, as the task's failure (the PreflightError's own traceback is at DEBUG).
    assert "failed preflight" in log
    assert "AirflowFailException" in log
    assert "Starting the vLLM engine" not in log


def _objects(seaweed) -> dict[str, str]:
    """Every object under the API's prefix, with its ETag."""
    listed = seaweed.client().list_objects_v2(Bucket=BUCKET, Prefix="api/").get("Contents", [])
    return {o["Key"]: o["ETag"] for o in listed}


def _forged_confs(api: Api, batch: Batch) -> dict[str, dict]:
    """Confs of runs the API did not make: another user's locations as the old conf took them, an edited conf, a replayed one."""
    where = f"s3://{BUCKET}/api/files/{owner_key('alice')}"
    real = api.dep.dag_run(DEFAULT_BATCH_DAG_ID, batch.id)[
        "conf"
    ]  # readable by whoever may read the DAG's runs
    return {
        "locations": {
            "input_uri": f"{where}/{batch.input_file_id}.jsonl",
            "output_uri": f"{where}/{batch.output_file_id}.jsonl",
            "error_uri": f"{where}/{batch.output_file_id}.jsonl",
            "failure_uri": f"s3://{BUCKET}/api/batches/{batch.id}.failure.json",
            "endpoint": "/v1/chat/completions",
            "owner": "bob",
        },
        "edited": {**real, "owner": "bob"},
        "replayed": real,
    }


def test_runs_triggered_by_hand_fail_before_any_read_or_write_and_are_no_ones_batches(
    api: Api, completed, seaweed
):
    """Someone who may trigger the batch DAG (here the admin) triggers it through Airflow's REST API with confs the API did not sign (issue 33, item 2)."""
    _, batch, _ = completed
    before = _objects(seaweed)
    run_ids = {name: f"batch_{uuid.uuid4().hex}" for name in ("locations", "edited", "replayed")}
    confs = _forged_confs(api, batch)
    for name, conf in confs.items():
        api.dep.request(
            "POST",
            f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}/dagRuns",
            {"dag_run_id": run_ids[name], "conf": conf, "logical_date": None},
        )
    states = {
        name: api.dep.wait_for_run(DEFAULT_BATCH_DAG_ID, run_id, BATCH_TIMEOUT_S)
        for name, run_id in run_ids.items()
    }
    assert set(states.values()) == {"failed"}, states
    why = {
        "locations": "not a batch of the OpenAI API",
        "edited": "signature does not match",
        "replayed": f"signed for the batch '{batch.id}'",
    }
    for name, run_id in run_ids.items():
        log = api.dep.task_log(DEFAULT_BATCH_DAG_ID, run_id, "vllm_batch", 1)
        assert why[name] in log, (name, log[-3000:])
        assert "nothing was read or written" in log, (name, log[-3000:])
        # Not read: the task names its input when it pins it.
        assert "Starting the vLLM engine" not in log
        assert ".input.jsonl" not in log
        assert f"{batch.input_file_id}.jsonl" not in log
    # Nothing under the API's prefix was written, replaced or deleted; alice's output is hers as published.
    assert _objects(seaweed) == before
    bob = api.clients["bob"]
    assert not set(run_ids.values()) & {b.id for b in bob.batches.list(limit=100).data}
    for run_id in run_ids.values():
        with pytest.raises(NotFoundError):
            bob.batches.retrieve(run_id)


def test_another_user_neither_sees_nor_cancels_a_users_batch(api: Api, completed):
    _, batch, _ = completed
    bob = api.clients["bob"]
    with pytest.raises(NotFoundError):
        bob.batches.retrieve(batch.id)
    with pytest.raises(NotFoundError):
        bob.batches.cancel(batch.id)
    assert batch.id not in [b.id for b in bob.batches.list()]
    with pytest.raises(NotFoundError):
        bob.files.content(batch.output_file_id)


@contextlib.contextmanager
def _as_admin(api: Api) -> Iterator[None]:
    """Airflow's REST API as its admin (who may change every DAG run): the module's deployment calls it as the admin already."""
    api.dep.log_in("admin")
    try:
        yield
    finally:
        api.dep.log_in("admin")


def _final(api: Api, batch: Batch, seaweed, before: dict[str, str]) -> None:
    """The batch, its files and everything under the API's prefix are what they were when it ended."""
    assert _objects(seaweed) == before
    again = api.clients["alice"].batches.retrieve(batch.id)
    assert (again.status, again.request_counts, again.output_file_id, again.error_file_id) == (
        batch.status,
        batch.request_counts,
        batch.output_file_id,
        batch.error_file_id,
    )


def test_a_completed_batch_replayed_into_another_batch_dag_is_refused_and_keeps_its_files(
    api: Api, completed, seaweed
):
    """Its conf copied from the run list and triggered, with its batch id, in a second batch DAG (issue 42, row 2)."""
    _, batch, _ = completed
    before = _objects(seaweed)
    real = api.dep.dag_run(DEFAULT_BATCH_DAG_ID, batch.id)["conf"]
    with _as_admin(api):
        api.dep.request(
            "POST",
            f"/api/v2/dags/{SECOND_DAG_ID}/dagRuns",
            {"dag_run_id": batch.id, "conf": real, "logical_date": None},
        )
        state = api.dep.wait_for_run(SECOND_DAG_ID, batch.id, BATCH_TIMEOUT_S)
    assert state == "failed"
    log = api.dep.task_log(SECOND_DAG_ID, batch.id, "vllm_batch", 1)
    assert f"signed for the batch DAG '{DEFAULT_BATCH_DAG_ID}', not for '{SECOND_DAG_ID}'" in log, log[-3000:]
    assert "nothing was read or written" in log
    _final(api, batch, seaweed, before)


def test_a_completed_batch_cleared_after_an_engine_change_keeps_its_files_and_runs_nothing(
    api: Api, completed, seaweed
):
    """The batch DAG's engine flags change (another run identity, as a vLLM upgrade makes), then its run is cleared (issue 42, row 2).

    The worker parses the DAG file when the task starts, so the cleared try runs under the
    new flags. Before issue 42 it found no output of its own identity and ran the batch again
    over its published files.
    """
    _, batch, _ = completed
    before = _objects(seaweed)
    dag_file = api.dep.home / "dags" / "vllm_batch_openai.py"
    original = dag_file.read_text()
    changed = original.replace("engine=engine(),", 'engine=engine("--seed", "7"),', 1)
    assert changed != original
    dag_file.write_text(changed)
    try:
        with _as_admin(api):
            api.dep.request(
                "POST",
                f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}/clearTaskInstances",
                {"dry_run": False, "dag_run_id": batch.id, "only_failed": False, "reset_dag_runs": True},
            )
            state = api.dep.wait_for_run(DEFAULT_BATCH_DAG_ID, batch.id, BATCH_TIMEOUT_S)
    finally:
        dag_file.write_text(original)
    assert state == "success"
    tries = api.dep.task_tries(DEFAULT_BATCH_DAG_ID, batch.id, "vllm_batch")
    log = api.dep.task_log(DEFAULT_BATCH_DAG_ID, batch.id, "vllm_batch", max(t["try_number"] for t in tries))
    assert "a published batch never changes" in log, log[-3000:]
    assert "Starting the vLLM engine" not in log
    _final(api, batch, seaweed, before)


def test_a_user_not_in_openai_users_may_not_use_the_api(api: Api, completed):
    """Vera is a viewer, as alice and bob, but not listed: every call is 403, an upload included."""
    vera = api.clients["vera"]
    _, batch, _ = completed
    with pytest.raises(PermissionDeniedError):
        vera.files.create(file=("v.jsonl", _lines(api.model, 1)), purpose="batch")
    with pytest.raises(PermissionDeniedError):
        vera.files.list()
    with pytest.raises(PermissionDeniedError):
        vera.batches.create(
            input_file_id="file-0123456789", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(PermissionDeniedError):
        vera.batches.list()
    with pytest.raises(PermissionDeniedError):
        vera.batches.cancel(batch.id)


#: What Airflow's own REST API would let a user do to another user's batch run: (method, path, body);
#: ``{run}`` is the run's path, ``{dag}`` the DAG's, ``{conf}`` the conf read from the run list.
#: The delete last: where it is allowed (a regression) the run is gone for the rows after it.
RUN_CHANGES = {
    "state success": ("PATCH", "{run}", {"state": "success"}),
    "state failed": ("PATCH", "{run}", {"state": "failed"}),
    "clear": ("POST", "{run}/clear", {"dry_run": False}),
    "re-trigger with the copied conf": (
        "POST",
        "{dag}/dagRuns",
        {"dag_run_id": "{new}", "conf": "{conf}", "logical_date": None},
    ),
    "pause the DAG": ("PATCH", "{dag}", {"is_paused": True}),
    "delete": ("DELETE", "{run}", None),
}


def change_as(dep: Deployment, token: str, change: str, run_id: str, conf: dict) -> int:
    """Call one of :data:`RUN_CHANGES` on ``run_id`` with ``token``; return the HTTP status."""
    method, path, body = RUN_CHANGES[change]
    dag = f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}"
    path = path.format(run=dep.run_path(DEFAULT_BATCH_DAG_ID, run_id), dag=dag)
    if body is not None:
        body = {
            k: conf if v == "{conf}" else f"batch_{uuid.uuid4().hex}" if v == "{new}" else v
            for k, v in body.items()
        }
    admin, dep.token = dep.token, token
    try:
        dep.request(method, path, body)
        return 200
    except urllib.error.HTTPError as err:
        return err.code
    finally:
        dep.token = admin


def snapshot(dep: Deployment, client: OpenAI, batch: Batch) -> dict:
    """What a user's batch is: its status and counts, its files' bytes, its DAG run's state and conf, the DAG's pause."""
    seen = client.batches.retrieve(batch.id)
    run = dep.dag_run(DEFAULT_BATCH_DAG_ID, batch.id)
    return {
        "batch": seen.model_dump(exclude={"in_progress_at"}),
        "files": {f: client.files.content(f).content for f in (seen.output_file_id, seen.error_file_id) if f},
        "run": (run["state"], run["conf"]),
        "paused": dep.request("GET", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}")["is_paused"],
    }


@pytest.mark.parametrize("change", list(RUN_CHANGES))
def test_an_api_user_cannot_change_another_users_batch_through_airflows_rest_api(api: Api, completed, change):
    """Bob, holding what the docs tell an API user to hold (role viewer, listed), on alice's batch (issue 42, item 1).

    He reads the run list (a viewer may: the conf he copies is there) and calls the endpoint:
    403, and alice's batch, its files, its run and the DAG are as they were.
    """
    _, batch, _ = completed
    alice, bob = api.clients["alice"], api.clients["bob"]
    before = snapshot(api.dep, alice, batch)
    admin, api.dep.token = api.dep.token, bob.api_key
    try:
        runs = api.dep.request("GET", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}/dagRuns?limit=100")["dag_runs"]
    finally:
        api.dep.token = admin
    conf = next(r["conf"] for r in runs if r["dag_run_id"] == batch.id)
    try:
        # Assigned first: a failed assert shows the status, not the call's arguments (the token).
        status = change_as(api.dep, bob.api_key, change, batch.id, conf)
        assert status == 403, change
    finally:
        api.dep.request("PATCH", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}", {"is_paused": False})
    assert snapshot(api.dep, alice, batch) == before


def test_a_batch_cancelled_before_it_runs_ends_cancelled(api: Api):
    alice = api.clients["alice"]
    uploaded = alice.files.create(file=("c.jsonl", _lines(api.model)), purpose="batch")
    batch = alice.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    cancelling = alice.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    assert cancelling.cancelling_at
    cancelled = _wait(api, alice, batch.id, ("cancelled", "completed", "failed"))
    assert cancelled.status == "cancelled"
    assert cancelled.cancelled_at
    assert cancelled.output_file_id is None
    # Published through the run protocol without an engine: every request is in the error file, batch_cancelled.
    assert (
        cancelled.request_counts.total,
        cancelled.request_counts.completed,
        cancelled.request_counts.failed,
    ) == (N_REQUESTS, 0, N_REQUESTS)
    errors = [json.loads(line) for line in alice.files.content(cancelled.error_file_id).text.splitlines()]
    assert sorted(e["custom_id"] for e in errors) == [f"req-{i}" for i in range(N_REQUESTS)]
    assert all(
        e["error"]["code"] == "batch_cancelled" and e["response"] is None and e["id"].startswith("batch_req_")
        for e in errors
    )
    # A cancelled batch has ended: cancelling it again is 409.
    with pytest.raises(ConflictError):
        alice.batches.cancel(batch.id)


def test_by_default_a_user_holds_half_the_batch_dags_run_slots(api: Api):
    """The default fair share, on Airflow's database: the batch DAG's max_active_runs is 4, so one user has 2 batches not ended at most.

    The third is refused in OpenAI's rate-limit shape, naming the option and the DAG's run
    slots; another user's batch is not, and once one of hers has ended she may create again.
    """
    alice, bob = api.clients["alice"], api.clients["bob"]
    uploaded = alice.files.create(file=("cap.jsonl", _lines(api.model)), purpose="batch")
    not_ended = [b.id for b in alice.batches.list(limit=100) if b.status in ACTIVE_STATUSES]

    def create() -> str:
        return alice.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id

    created = [create() for _ in range(2 - len(not_ended))]
    with pytest.raises(RateLimitError) as refused:
        create()
    assert refused.value.code == "batches_limit_exceeded"
    assert "openai_max_user_active_batches = auto" in refused.value.message
    assert "max_active_runs (4)" in refused.value.message
    bobs = bob.files.create(file=("cap.jsonl", _lines(api.model)), purpose="batch")
    theirs = bob.batches.create(
        input_file_id=bobs.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for client, batch_id in [(alice, b) for b in not_ended + created] + [(bob, theirs.id)]:
        with contextlib.suppress(ConflictError):  # ended meanwhile
            client.batches.cancel(batch_id)
    for client, batch_id in [(alice, b) for b in not_ended + created] + [(bob, theirs.id)]:
        _wait(api, client, batch_id, ("cancelled", "completed", "failed", "expired"))
    again = alice.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    alice.batches.cancel(again.id)
    _wait(api, alice, again.id, ("cancelled", "completed", "failed", "expired"))


class PeakRss:
    """Samples the summed RSS of a process and its descendants in a thread, keeping the peak."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def rss(self) -> int:
        total = 0
        for process in (self.root, *self.root.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                total += process.memory_info().rss
        return total

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(0.02)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


#: The memory benchmark's file: 10,000 request lines of ~10 KiB each (~100 MB).
BIG_LINES, BIG_LINE_CHARS = 10_000, 10_000
MAX_RSS_GROWTH = 50 * 1024 * 1024


def test_a_100_mb_upload_and_download_keep_the_api_servers_memory_flat(api: Api):
    alice = api.clients["alice"]
    filler = "x" * BIG_LINE_CHARS
    data = _lines(api.model, BIG_LINES).replace(b'"Say ', f'"{filler} '.encode())
    # Warm up: the app, boto3 and their buffers are loaded before the baseline.
    small = alice.files.create(file=("warm.jsonl", _lines(api.model, 2)), purpose="batch")
    alice.files.content(small.id).read()
    sampler = PeakRss(api.dep.processes["api-server"].pid)
    baseline = sampler.rss()
    with sampler:
        started = time.monotonic()
        uploaded = alice.files.create(file=("big.jsonl", data), purpose="batch")
        upload_s = time.monotonic() - started
        upload_peak = sampler.peak
        received = 0
        with alice.files.with_streaming_response.content(uploaded.id) as response:
            for chunk in response.iter_bytes(1 << 20):
                received += len(chunk)
    growth = (max(upload_peak, sampler.peak) - baseline) / 2**20
    print(
        f"openai API memory: {len(data) / 2**20:.0f} MiB, {BIG_LINES} lines; upload {upload_s:.1f}s; API server RSS "
        f"baseline {baseline / 2**20:.0f} MiB, peak growth upload {(upload_peak - baseline) / 2**20:.1f} MiB, "
        f"upload+download {growth:.1f} MiB"
    )
    assert uploaded.bytes == len(data) == received
    assert max(upload_peak, sampler.peak) - baseline <= MAX_RSS_GROWTH
    alice.files.delete(uploaded.id)


def _engines(api: Api) -> list:
    """The vLLM batch runners the deployment's tasks started."""
    return [p for p in api.dep.descendants("scheduler") if "run_batch" in " ".join(_cmdline(p))]


def _cmdline(process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def test_a_batch_cancelled_while_its_engine_runs_stops_the_engine(api: Api):
    alice = api.clients["alice"]
    uploaded = alice.files.create(file=("run.jsonl", _lines(api.model)), purpose="batch")
    batch = alice.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    engines = wait_until(
        "the batch's engine to start", lambda: _engines(api), BATCH_TIMEOUT_S, api.dep, interval=0.5
    )
    assert alice.batches.retrieve(batch.id).status == "in_progress"
    assert alice.batches.cancel(batch.id).status == "cancelling"
    cancelled = _wait(api, alice, batch.id, ("cancelled", "completed", "failed"))
    assert cancelled.status == "cancelled"
    assert cancelled.output_file_id is None
    _, alive = psutil.wait_procs(engines, timeout=60)
    assert alive == [], [(p.pid, _cmdline(p)) for p in alive]


def test_batches_are_listed_newest_first_in_pages(api: Api, completed):
    alice = api.clients["alice"]
    uploaded = alice.files.create(file=("listed.jsonl", _lines(api.model)), purpose="batch")
    alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    everything = [b.id for b in alice.batches.list(limit=100).data]
    assert len(everything) >= 2
    assert completed[1].id in everything
    first = alice.batches.list(limit=1)
    assert first.has_more
    assert [b.id for b in first.data] == everything[:1]
    second = alice.batches.list(limit=1, after=first.data[0].id)
    assert [b.id for b in second.data] == everything[1:2]
    assert [b.id for b in alice.batches.list(limit=100, after=everything[-1]).data] == []
    # The extra batch is cancelled so that it does not start an engine after the module.
    alice.batches.cancel(everything[0])


# -- Airflow's own OpenAI provider against the plugin ------------------------------------

PROVIDER_CONN_ID = "openai_plugin"


@pytest.fixture(scope="module")
def provider(api: Api) -> Iterator[str]:
    """An ``openai`` connection of Airflow's OpenAI provider to the plugin, as alice (her API token is the key)."""
    pytest.importorskip("airflow.providers.openai", reason="apache-airflow-providers-openai is not installed")
    name = f"AIRFLOW_CONN_{PROVIDER_CONN_ID.upper()}"
    saved = os.environ.get(name)
    os.environ[name] = json.dumps(
        {"conn_type": "openai", "host": api.base_url, "password": api.clients["alice"].api_key}
    )
    yield PROVIDER_CONN_ID
    if saved is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = saved


def _uploaded_with_the_providers_hook(api: Api, tmp_path: Path, conn_id: str) -> str:
    from airflow.providers.openai.hooks.openai import OpenAIHook

    path = tmp_path / "requests.jsonl"
    path.write_bytes(_lines(api.model))
    uploaded = OpenAIHook(conn_id=conn_id).upload_file(str(path), purpose="batch")
    assert uploaded.bytes == path.stat().st_size
    assert uploaded.purpose == "batch"
    return uploaded.id


def _trigger_event(trigger) -> dict:
    """The first event of a trigger, run here as the triggerer would run it."""

    async def first():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(first())


def test_the_providers_batch_operator_waits_for_a_batch_to_complete(api: Api, provider: str, tmp_path: Path):
    from airflow.providers.openai.operators.openai import OpenAITriggerBatchOperator

    file_id = _uploaded_with_the_providers_hook(api, tmp_path, provider)
    operator = OpenAITriggerBatchOperator(
        task_id="openai_batch",
        file_id=file_id,
        endpoint="/v1/chat/completions",
        conn_id=provider,
        deferrable=False,
        wait_seconds=2,
        timeout=BATCH_TIMEOUT_S,
        metadata={"via": "provider"},
    )
    batch_id = operator.execute({})
    batch = api.clients["alice"].batches.retrieve(batch_id)
    assert batch.status == "completed"
    assert batch.metadata == {"via": "provider"}
    assert batch.request_counts.completed == N_REQUESTS


def test_the_providers_deferrable_batch_operator_completes_through_its_trigger(
    api: Api, provider: str, tmp_path: Path
):
    from airflow.providers.openai.operators.openai import OpenAITriggerBatchOperator

    file_id = _uploaded_with_the_providers_hook(api, tmp_path, provider)
    operator = OpenAITriggerBatchOperator(
        task_id="openai_batch",
        file_id=file_id,
        endpoint="/v1/chat/completions",
        conn_id=provider,
        deferrable=True,
        poll_interval=2,
        timeout=BATCH_TIMEOUT_S,
    )
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute({})
    event = _trigger_event(deferred.value.trigger)
    assert event["status"] == "success", event
    assert operator.execute_complete({}, event) == operator.batch_id
    assert api.clients["alice"].batches.retrieve(operator.batch_id).status == "completed"


def test_the_providers_deferrable_operator_cancels_the_batch_on_its_timeout(
    api: Api, provider: str, tmp_path: Path
):
    from airflow.providers.openai.exceptions import OpenAIBatchTimeout
    from airflow.providers.openai.operators.openai import OpenAITriggerBatchOperator

    file_id = _uploaded_with_the_providers_hook(api, tmp_path, provider)
    operator = OpenAITriggerBatchOperator(
        task_id="openai_batch",
        file_id=file_id,
        endpoint="/v1/chat/completions",
        conn_id=provider,
        deferrable=True,
        poll_interval=1,
        timeout=0,
    )
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute({})
    event = _trigger_event(deferred.value.trigger)
    assert event["termination_reason"] == "timeout", event
    with pytest.raises(OpenAIBatchTimeout):
        operator.execute_complete({}, event)
    alice = api.clients["alice"]
    assert alice.batches.retrieve(operator.batch_id).status in ("cancelling", "cancelled")
    assert _wait(api, alice, operator.batch_id, ("cancelled", "completed", "failed")).status == "cancelled"


def test_a_batch_whose_engine_refuses_some_lines_completes_with_both_files(api: Api):
    """Per-request failures never fail a batch: 2 lines the engine refuses, 2 it answers: completed, 2/2/4, both files."""
    alice = api.clients["alice"]
    good = _lines(api.model, 2).splitlines(keepends=True)
    over_context = {
        "model": api.model,
        "messages": [{"role": "user", "content": "word " * 4000}],
        "max_completion_tokens": 4,
    }
    over_length = {
        "model": api.model,
        "messages": [{"role": "user", "content": "Say 9."}],
        "max_completion_tokens": 100_000,
    }
    refused = [
        json.dumps(
            {"custom_id": f"refused-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        ).encode()
        + b"\n"
        for i, body in enumerate((over_context, over_length))
    ]
    uploaded = alice.files.create(
        file=("mixed.jsonl", b"".join([good[0], refused[0], good[1], refused[1]])), purpose="batch"
    )
    batch = alice.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    ended = _wait(api, alice, batch.id, ("completed", "failed", "cancelled", "expired"))
    assert ended.status == "completed", ended
    assert (ended.request_counts.total, ended.request_counts.completed, ended.request_counts.failed) == (
        4,
        2,
        2,
    )
    assert ended.output_file_id
    assert ended.error_file_id
    assert ended.errors is None
    output = [json.loads(line) for line in alice.files.content(ended.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == ["req-0", "req-1"]
    assert all(o["id"].startswith("batch_req_") for o in output)
    errors = [json.loads(line) for line in alice.files.content(ended.error_file_id).text.splitlines()]
    assert sorted(e["custom_id"] for e in errors) == ["refused-0", "refused-1"]
    for e in errors:
        # OpenAI's shape: the HTTP failure is the response, its error in the body; no top-level error.
        assert e["error"] is None
        assert e["response"]["status_code"] >= 400
        assert e["id"].startswith("batch_req_")
        assert isinstance(e["response"]["body"]["error"]["message"], str)
        assert e["response"]["body"]["error"]["message"]


# -- the same deployment, as another API server sees it: a later clock, a new configuration (issue 42, rows 3, 4, 6) --

#: The key the reconfigured API servers sign with after a rotation.
ROTATED_KEY = "integration-rotated-key-" + "1" * 16
#: Far enough ahead that every batch of the module is past its expires_at (24 h windows).
LATER_H = 25
#: Two users that only the reconfigured server knows (its limits are checked on them, with no files yet).
LIMITED_USERS = ("carol", "dave")


@pytest.fixture(scope="module")
def restarted(api: Api, seaweed) -> Iterator[dict[str, ExtraApiServer]]:
    """Three more API servers of the module's deployment (its database, DAGs and S3), as a restart with another configuration makes them.

    - ``later``: the same configuration, its clock ``LATER_H`` hours ahead (libfaketime);
    - ``reconfigured``: the signing key rotated (``openai_signing_key`` new, the old one in
      ``openai_old_signing_keys``), per-user limits (1 file, 1 batch not ended) and two more
      viewers listed in ``openai_users``, ``carol`` and ``dave``;
    - ``old key dropped``: the new key, the old one no longer listed.

    Fresh processes: each is an ``airflow api-server`` of its own configuration (the point of
    the tests: what a restart with it shows); the scheduler, dag-processor and engines are the
    module's. They start together (about 25-40 s on two cores) and stop at the module's end.
    """
    rotated = {"AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY": ROTATED_KEY}
    configs = {
        "later": {"clock_offset_s": LATER_H * 3600},
        "reconfigured": {
            "options": {
                **rotated,
                "AIRFLOW__VLLM_BATCH__OPENAI_OLD_SIGNING_KEYS": SIGNING_KEY,
                "AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_FILES": "1",
                "AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_ACTIVE_BATCHES": "1",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": api.dep.env[
                    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"
                ]
                + "".join(f",{user}:viewer" for user in LIMITED_USERS),
                "AIRFLOW__VLLM_BATCH__OPENAI_USERS": "alice,bob," + ",".join(LIMITED_USERS),
            }
        },
        "old key dropped": {"options": rotated},
    }
    started = time.monotonic()
    with extra_api_servers(api.dep, seaweed, configs) as servers:
        print(f"three more API servers up in {time.monotonic() - started:.1f}s")
        yield servers


@contextlib.contextmanager
def _paused(api: Api) -> Iterator[None]:
    """The batch DAG paused (as its admin): batches created meanwhile stay queued, their task never starts."""
    api.dep.request("PATCH", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}", {"is_paused": True})
    try:
        yield
    finally:
        api.dep.request("PATCH", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}", {"is_paused": False})


def _delete_runs(api: Api, batch_ids: list[str]) -> None:
    """Delete queued batches' runs (as the admin), so that none starts a task after the test."""
    for batch_id in batch_ids:
        with contextlib.suppress(urllib.error.HTTPError):
            api.dep.request("DELETE", api.dep.run_path(DEFAULT_BATCH_DAG_ID, batch_id))


def test_ended_batches_keep_their_status_and_one_never_started_is_finalizing_once_the_clock_passes_expires_at(
    api: Api, completed, failed: Batch, restarted
):
    """The real API server with its clock 25 h ahead reads the module's batches (issue 42, row 3).

    A completed batch, a batch failed in preflight (its failure record) and one whose run an
    operator marked failed before it started (no record: before issue 42 it turned
    ``expired`` as the clock passed) keep their status and every field; a batch still
    queued past its ``expires_at`` shows ``finalizing``: ended, but not ``expired`` before its
    task publishes it so (the chaos campaign saw an ``expired`` batch's files appear later).
    """
    _, done, _ = completed
    alice = api.clients["alice"]
    created: list[str] = []
    uploaded = alice.files.create(file=("q.jsonl", _lines(api.model, 1)), purpose="batch")

    def create() -> str:
        created.append(
            alice.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id
        )
        return created[-1]

    with _paused(api):
        try:
            stopped = create()
            # Marked failed before the next is made: alice has one batch not ended at a time, whatever the default cap.
            api.dep.request("PATCH", api.dep.run_path(DEFAULT_BATCH_DAG_ID, stopped), {"state": "failed"})
            queued = create()
            now = {b: alice.batches.retrieve(b) for b in (done.id, failed.id, stopped, queued)}
            assert [now[b].status for b in (done.id, failed.id, stopped, queued)] == [
                "completed",
                "failed",
                "failed",
                "validating",
            ]
            later = restarted["later"].client("alice")
            raw = later.batches.with_raw_response.retrieve(done.id)
            # The server's own clock (its Date header) is past every expires_at: libfaketime took.
            assert email.utils.parsedate_to_datetime(raw.headers["date"]).timestamp() > max(
                b.expires_at for b in now.values()
            )
            for batch_id in (done.id, failed.id, stopped):
                assert later.batches.retrieve(batch_id).model_dump() == now[batch_id].model_dump(), batch_id
            assert (
                later.files.content(done.output_file_id).content
                == alice.files.content(done.output_file_id).content
            )
            # Past its window, queued: ended, but not "expired" until its task publishes it so.
            assert later.batches.retrieve(queued).status == "finalizing"
        finally:
            _delete_runs(api, created[1:])


def test_a_rotated_signing_key_keeps_earlier_batches_and_dropping_the_old_key_hides_them(
    api: Api, completed, restarted
):
    """The API server restarted with a new ``openai_signing_key`` (issue 42, row 4).

    With the old key in ``openai_old_signing_keys``, alice's batch made before is listed,
    retrieved as it was and its output downloaded (before issue 42: 404, not listed); once
    the old key is dropped from the list, it is hidden (404, not listed).
    """
    _, done, _ = completed
    alice = api.clients["alice"]
    rotated = restarted["reconfigured"].client("alice")
    assert done.id in [b.id for b in rotated.batches.list(limit=100).data]
    assert rotated.batches.retrieve(done.id).model_dump() == alice.batches.retrieve(done.id).model_dump()
    assert (
        rotated.files.content(done.output_file_id).content == alice.files.content(done.output_file_id).content
    )
    dropped = restarted["old key dropped"].client("alice")
    assert done.id not in [b.id for b in dropped.batches.list(limit=100).data]
    with pytest.raises(NotFoundError):
        dropped.batches.retrieve(done.id)


def _counted(server: ExtraApiServer, user: str) -> tuple[OpenAI, list[str]]:
    """The unmodified SDK with its default retries (2), and the requests it sent."""
    sent: list[str] = []
    client = OpenAI(
        base_url=server.api_url + URL_PREFIX,
        api_key=server.token(user),
        timeout=60,
        http_client=httpx.Client(
            event_hooks={"request": [lambda r: sent.append(f"{r.method} {r.url.path}")]}
        ),
    )
    return client, sent


def _refused(
    err: pytest.ExceptionInfo[RateLimitError], sent: list[str], kind: str, param: str, option: str
) -> None:
    """A 429 in OpenAI's shape naming the option, which the SDK did not retry."""
    assert err.value.status_code == 429
    assert err.value.response.headers["x-should-retry"] == "false"
    body = err.value.response.json()["error"]
    assert (body["type"], body["code"], body["param"]) == (kind, f"{kind}_limit_exceeded", param), body
    assert f"openai_max_user_{option}" in body["message"], body
    assert len(sent) == 1, sent


def test_over_a_per_user_limit_the_sdk_gets_rate_limit_error_and_another_user_is_not_affected(
    api: Api, restarted
):
    """``openai_max_user_files`` = 1 and ``openai_max_user_active_batches`` = 1 on the API server (issue 42, row 6).

    Carol's second upload and second batch are refused with 429 (``RateLimitError``, OpenAI's
    error shape, ``x-should-retry: false``: one request, no retries); dave, at the same time,
    uploads and creates his. The DAG is paused: the batches stay queued, and are deleted after.
    """
    server = restarted["reconfigured"]
    created: list[str] = []
    with _paused(api):
        try:
            carol, sent = _counted(server, "carol")
            kept = carol.files.create(file=("one.jsonl", _lines(api.model, 1)), purpose="batch")
            sent.clear()
            with pytest.raises(RateLimitError) as over:
                carol.files.create(file=("two.jsonl", _lines(api.model, 1)), purpose="batch")
            _refused(over, sent, "files", "file", "files")
            created.append(
                carol.batches.create(
                    input_file_id=kept.id, endpoint="/v1/chat/completions", completion_window="24h"
                ).id
            )
            sent.clear()
            with pytest.raises(RateLimitError) as over:
                carol.batches.create(
                    input_file_id=kept.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
            _refused(over, sent, "batches", "input_file_id", "active_batches")
            dave = server.client("dave")
            his = dave.files.create(file=("his.jsonl", _lines(api.model, 1)), purpose="batch")
            created.append(
                dave.batches.create(
                    input_file_id=his.id, endpoint="/v1/chat/completions", completion_window="24h"
                ).id
            )
            assert [b.status for b in map(dave.batches.retrieve, created[1:])] == ["validating"]
        finally:
            _delete_runs(api, created)


#: Requests of the warm server's batch: enough that a cancel lands while it runs (the tiny model answers
#: hundreds a second on two cores: 400 were all answered before a cancel 8 s into the run took effect).
N_WARM = 5000
WARM_CONN_ID = "vllm_warm"


@pytest.fixture(scope="module")
def warm_api(
    seaweed, tiny_model: Path, tmp_path_factory, warm_vllm
) -> Iterator[tuple[Api, VLLMServerProcess]]:
    """A second deployment whose batch DAG streams through a warm vLLM server (the server engine: checkpoints).

    The server is the session's warm one of the plain CPU flags (conftest ``warm_vllm``); its
    settings (a ``vllm`` connection, another files prefix) differ from ``api``'s, so it is a
    deployment of its own.
    """
    server = warm_vllm()
    assert server.hook is not None
    host, port = server.hook.base_url.removeprefix("http://").split(":")
    home = tmp_path_factory.mktemp("openai-api-warm-home")
    if not _entry_point_installed():
        (home / "plugins").mkdir()
        (home / "plugins" / "vllm_batch_openai_api.py").write_text(PLUGIN_SHIM)
    env = {
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,alice:user,bob:viewer",
        "AIRFLOW__VLLM_BATCH__OPENAI_FILES_URI": f"s3://{BUCKET}/warm/",
        "AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY": SIGNING_KEY,
        "AIRFLOW_VLLM_BATCH_VLLM_CONN_ID": WARM_CONN_ID,
        f"AIRFLOW_CONN_{WARM_CONN_ID.upper()}": json.dumps(
            {"conn_type": "vllm", "host": host, "port": int(port), "password": server.hook.api_key}
        ),
    }
    example = (REPO / "dags" / "vllm_batch_openai.py").read_text()
    second = example.replace('queue="gpu",', f'queue="gpu",\n    dag_id="{SECOND_DAG_ID}",', 1)
    assert second != example
    dag_files = {"vllm_batch_openai.py": example, "vllm_batch_openai_second.py": second}
    with local_executor_deployment(seaweed, tiny_model, home, dag_files, extra_env=env) as dep:
        dep.wait_for_dag(DEFAULT_BATCH_DAG_ID)
        dep.wait_for_dag(SECOND_DAG_ID)
        clients = {}
        for user in ("bob", "alice"):
            dep.log_in(user)
            clients[user] = OpenAI(
                base_url=dep.api_url + URL_PREFIX, api_key=dep.token, max_retries=0, timeout=60
            )
        yield Api(dep, clients, str(tiny_model)), server


def test_a_cancel_mid_run_keeps_and_publishes_the_answers_finished_so_far(warm_api):
    api, server = warm_api
    assert server.hook is not None
    answered_before = requests_answered(server.hook.base_url)
    alice = api.clients["alice"]
    body = lambda i: {
        "model": api.model,
        "messages": [{"role": "user", "content": f"Count to {i}."}],
        "max_completion_tokens": 32,
        "temperature": 0,
    }
    data = b"".join(
        json.dumps(
            {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body(i)}
        ).encode()
        + b"\n"
        for i in range(N_WARM)
    )
    uploaded = alice.files.create(file=("long.jsonl", data), purpose="batch")
    batch = alice.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_until(
        "the batch to run",
        lambda: alice.batches.retrieve(batch.id).status == "in_progress",
        BATCH_TIMEOUT_S,
        api.dep,
        interval=1,
    )
    # Some requests answered, most not: counted by the server itself, not guessed from a sleep
    # (on a loaded machine the first answers can come seconds after the batch shows in_progress).
    wait_until(
        "the warm server to answer some of the batch's requests",
        lambda: requests_answered(server.hook.base_url) - answered_before >= 20,
        BATCH_TIMEOUT_S,
        api.dep,
        interval=0.2,
    )
    assert alice.batches.cancel(batch.id).status == "cancelling"
    cancelled = _wait(api, alice, batch.id, ("cancelled", "completed", "failed", "expired"))
    assert cancelled.status == "cancelled", (cancelled.status, cancelled.request_counts)
    counts = cancelled.request_counts
    assert counts.total == N_WARM, counts
    assert 0 < counts.completed < N_WARM, counts
    assert counts.completed + counts.failed == N_WARM, counts
    output = [json.loads(line) for line in alice.files.content(cancelled.output_file_id).text.splitlines()]
    errors = [json.loads(line) for line in alice.files.content(cancelled.error_file_id).text.splitlines()]
    assert len(output) == counts.completed
    assert len(errors) == counts.failed
    assert len({line["custom_id"] for line in output + errors}) == N_WARM  # each request once
    for line in output:
        ChatCompletion.model_validate(line["response"]["body"])
    assert {e["error"]["code"] for e in errors if e["response"] is None} == {"batch_cancelled"}
    # The run stopped itself: the task succeeded with the cancelled manifest (no DAG run marked failed).
    log = api.dep.task_log(DEFAULT_BATCH_DAG_ID, batch.id, "vllm_batch", 1)
    assert "The batch is cancelled" in log
    with pytest.raises(ConflictError):
        alice.batches.cancel(batch.id)
    # Final is final (issue 42, row 3): the owner deletes the error file, and the batch still
    # shows cancelled, with its counts and both file ids (it showed completed with 0 counts before).
    alice.files.delete(cancelled.error_file_id)
    again = alice.batches.retrieve(batch.id)
    assert (again.status, again.request_counts, again.output_file_id, again.error_file_id) == (
        "cancelled",
        counts,
        cancelled.output_file_id,
        cancelled.error_file_id,
    )


def _manifest_key(batch_id: str, prefix: str = "warm") -> str:
    """Where a batch's manifest lands when it is published (the storage layer's layout, from the batch id)."""
    output_id = result_file_ids(batch_id)[0]
    uri = manifest_uri(f"s3://{BUCKET}/{prefix}/files/{owner_key('alice')}/{output_id}.jsonl")
    return uri.removeprefix(f"s3://{BUCKET}/")


def _under(seaweed, prefix: str) -> dict[str, str]:
    """Every object under ``prefix`` of the bucket, with its ETag."""
    pages = seaweed.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


def test_a_cancel_that_arrives_as_the_batch_publishes_leaves_it_completed_and_changes_nothing(
    warm_api, seaweed
):
    """The cancel is sent the moment the batch's manifest lands in S3, while its task finalizes (issue 42, row 3).

    The batch stays ``completed`` with its files; the cancel is answered as OpenAI's is for a
    batch that is not in progress (409, ``ConflictError``) and writes nothing: no cancel
    record, and a second cancel once the run has ended leaves every object under the API's
    prefix as it was (same keys, same ETags).
    """
    api, _ = warm_api
    alice = api.clients["alice"]
    uploaded = alice.files.create(file=("race.jsonl", _lines(api.model)), purpose="batch")
    batch = alice.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    s3, key = seaweed.client(), _manifest_key(batch.id)

    def published() -> bool:
        with contextlib.suppress(s3.exceptions.ClientError):
            return bool(s3.head_object(Bucket=BUCKET, Key=key))
        return False

    wait_until("the batch's manifest", published, BATCH_TIMEOUT_S, api.dep, interval=0.05)
    with pytest.raises(ConflictError) as late:
        alice.batches.cancel(batch.id)
    run_then = api.dep.dag_run(DEFAULT_BATCH_DAG_ID, batch.id)["state"]
    print(f"cancel sent as the manifest landed; the DAG run was {run_then} just after")
    assert "Cannot cancel a batch with status 'completed'" in late.value.message
    ended = _wait(api, alice, batch.id, ("completed", "failed", "cancelled", "expired"))
    assert api.dep.wait_for_run(DEFAULT_BATCH_DAG_ID, batch.id, BATCH_TIMEOUT_S) == "success"
    assert (ended.status, ended.request_counts.completed, ended.cancelling_at) == (
        "completed",
        N_REQUESTS,
        None,
    )
    output = alice.files.content(ended.output_file_id).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == [f"req-{i}" for i in range(N_REQUESTS)]
    assert not _under(seaweed, f"warm/batches/{batch.id}.cancel")
    before = _under(seaweed, "warm/")
    with pytest.raises(ConflictError):
        alice.batches.cancel(batch.id)
    assert _under(seaweed, "warm/") == before
    assert alice.batches.retrieve(batch.id).model_dump() == ended.model_dump()


CACHE_PREFIX = "warm-cache/"


def test_the_answer_cache_answers_a_user_from_their_own_answers_only(warm_api, seaweed):
    """The batch DAG with ``answer_cache`` on; alice, then alice again and bob, send one identical request (issue 42, row 5).

    Alice's second batch is answered from the cache (her stored line, byte for byte: the cache
    is on); bob's is not her line (its ids and ``created`` differ): his request went to the
    engine. The cache's objects are under ``owners/<owner key>/`` of each, and nowhere else.
    Before issue 42 bob got alice's stored line.
    """
    api, _ = warm_api
    dag_file = api.dep.home / "dags" / "vllm_batch_openai.py"
    original = dag_file.read_text()
    cached = original.replace(
        "engine=engine(),",
        f'engine=engine(),\n    answer_cache=AnswerCacheOptions(uri="s3://{BUCKET}/{CACHE_PREFIX}"),',
        1,
    ).replace("\ndag = ", "\nfrom airflow_vllm_batch.run import AnswerCacheOptions\n\ndag = ", 1)
    assert cached.count("AnswerCacheOptions") == 2
    # The worker parses the DAG file when the task starts: the batches below run with the cache.
    dag_file.write_text(cached)
    alice, bob = api.clients["alice"], api.clients["bob"]
    request = _lines(api.model, 1)

    def run(client: OpenAI) -> str:
        uploaded = client.files.create(file=("same.jsonl", request), purpose="batch")
        return client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id

    def answer(client: OpenAI, batch_id: str) -> bytes:
        ended = _wait(api, client, batch_id, ("completed", "failed", "cancelled", "expired"))
        assert ended.status == "completed", ended
        return client.files.content(ended.output_file_id).content

    try:
        first = answer(alice, run(alice))
        again, his = run(alice), run(bob)
        again_line, his_line = answer(alice, again), answer(bob, his)
    finally:
        dag_file.write_text(original)
    assert again_line == first
    mine, theirs = json.loads(first), json.loads(his_line)
    assert theirs["custom_id"] == mine["custom_id"]
    assert theirs["id"] != mine["id"]
    assert theirs["response"]["body"]["id"] != mine["response"]["body"]["id"]
    assert theirs["response"]["body"]["created"] != mine["response"]["body"]["created"]
    keys = list(_under(seaweed, CACHE_PREFIX))
    owners = {
        k.removeprefix(CACHE_PREFIX).split("/")[1] for k in keys if k.startswith(f"{CACHE_PREFIX}owners/")
    }
    assert owners == {owner_key("alice"), owner_key("bob")}, keys
    assert all(k.startswith(f"{CACHE_PREFIX}owners/") for k in keys), keys


def test_a_media_url_of_a_host_not_allowed_fails_the_batch_before_any_engine(warm_api):
    """A chat line names an image by an http URL of a host ``openai_media_domains`` does not list (issue 42, row 7).

    The batch ends ``failed``, ``errors.data`` naming that line and its host, and the warm
    server answered none of its requests (its ``/metrics`` count is unchanged): the check runs
    before any request is sent.
    """
    api, server = warm_api
    assert server.hook is not None
    alice = api.clients["alice"]
    image = {
        "model": api.model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "http://169.254.169.254/latest/meta-data/x.png"},
                    },
                ],
            }
        ],
        "max_completion_tokens": 4,
    }
    line = {"custom_id": "image", "method": "POST", "url": "/v1/chat/completions", "body": image}
    answered = requests_answered(server.hook.base_url)
    uploaded = alice.files.create(
        file=("media.jsonl", _lines(api.model, 1) + json.dumps(line).encode() + b"\n"), purpose="batch"
    )
    batch = alice.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    failed = _wait(api, alice, batch.id, ("completed", "failed", "cancelled", "expired"))
    assert failed.status == "failed", failed
    assert [(e.line, e.param) for e in failed.errors.data] == [(2, "body.messages")], failed.errors
    assert "'169.254.169.254'" in failed.errors.data[0].message
    assert (failed.output_file_id, failed.in_progress_at) == (None, None)
    assert requests_answered(server.hook.base_url) == answered


def test_the_batch_dag_retries_its_task_by_default(warm_api):
    """The example batch DAG, as the deployment serialized it, retries its task: 2 retries, 5 minutes apart (issue 42, row 7).

    It passes no ``retries=``: the default of ``openai_batch_dag`` (Airflow's own is none, and
    before issue 42 resume-from-parts never ran for an API batch).
    """
    api, _ = warm_api
    task = api.dep.request("GET", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}/tasks/vllm_batch")
    assert (task["retries"], task["retry_delay"]["seconds"], task["retry_delay"]["days"]) == (2, 300, 0), task


def _restart_scheduler(dep: Deployment, options: dict[str, str]) -> None:
    """Stop the deployment's scheduler (its LocalExecutor workers with it) and start it again with ``options`` set."""
    old = dep.processes["scheduler"]
    signal_group(old.pid, signal.SIGTERM)
    old.wait(timeout=60)
    dep.env = {**dep.env, **options}
    dep.start("scheduler", [str(Path(sys.executable).with_name("airflow")), "scheduler"])


def test_a_batch_created_before_a_key_rotation_runs_on_workers_restarted_with_the_new_key(warm_api):
    """The workers restart with a new ``openai_signing_key`` and the old one in ``openai_old_signing_keys`` (issue 42, row 4).

    A batch created (signed with the old key) while the DAG was paused runs on them after the
    restart and completes; before issue 42 its run failed at the signature check, as a forged one.

    Fresh processes: the deployment's scheduler (and so the workers, its children) restarts with
    the rotated configuration, the point of the test; last in the module, the deployment keeps it.
    """
    api, _ = warm_api
    alice = api.clients["alice"]
    uploaded = alice.files.create(file=("rotation.jsonl", _lines(api.model)), purpose="batch")
    api.dep.log_in("admin")
    api.dep.request("PATCH", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}", {"is_paused": True})
    try:
        batch = alice.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        started = time.monotonic()
        _restart_scheduler(
            api.dep,
            {
                "AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY": ROTATED_KEY,
                "AIRFLOW__VLLM_BATCH__OPENAI_OLD_SIGNING_KEYS": SIGNING_KEY,
            },
        )
        print(f"scheduler restarted in {time.monotonic() - started:.1f}s")
    finally:
        api.dep.request("PATCH", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}", {"is_paused": False})
    ended = _wait(api, alice, batch.id, ("completed", "failed", "cancelled", "expired"))
    assert (ended.status, ended.request_counts.completed) == ("completed", N_REQUESTS), ended
