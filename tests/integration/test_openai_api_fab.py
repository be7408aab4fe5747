"""The OpenAI API under FAB's auth manager: its own permission lets users in, and gives them nothing on the batch DAG.

A deployment of its own: Airflow's API server only (the plugin mounted), FAB's auth manager,
SQLite, SeaweedFS as S3, the repo's batch DAG serialized with ``airflow dags reserialize``.
No scheduler and no engine: alice's batch stays queued (``validating``) and must stay so.
The API registers its resource when it is built; a role holding only its four permissions
(``OpenAI API user``, made with FAB's REST API as an admin would with ``airflow roles``) is
what the docs tell an API user to hold; ``nora`` has FAB's ``Viewer`` role and not the API's.

Fresh processes: FAB's auth manager is a deployment setting of its own (its users, roles and
tables), which the simple-auth-manager deployments of ``test_openai_api.py`` cannot share;
only the API server is started (no scheduler, dag-processor or engine).
"""

from __future__ import annotations

import importlib.metadata
import secrets
import subprocess
import sys
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import AuthenticationError, NotFoundError, OpenAI, PermissionDeniedError

from airflow_vllm_batch.openai_api.access import FAB_ACTIONS, FAB_AUTH_MANAGER, RESOURCE_NAME
from airflow_vllm_batch.openai_api.settings import DEFAULT_BATCH_DAG_ID, URL_PREFIX
from tests.integration.dagrun import REPO
from tests.integration.test_openai_api import PLUGIN_SHIM, RUN_CHANGES, SIGNING_KEY, change_as
from vllm_batch_embedded.airflow_deployment import (
    LOOPBACK,
    Deployment,
    DeploymentError,
    dags_folder,
    deployment_env,
    wait_until,
)
from vllm_batch_embedded.seaweedfs import _free_ports

pytestmark = [pytest.mark.integration]

BUCKET = "openai-fab"
API_ROLE = "OpenAI API user"
LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}}\n'


def _entry_point_installed() -> bool:
    return any(
        ep.value.startswith("airflow_vllm_batch.openai_api.plugin")
        for ep in importlib.metadata.entry_points(group="airflow.plugins")
    )


@dataclass
class FabApi:
    dep: Deployment
    clients: dict[str, OpenAI]
    passwords: dict[str, str]


def _airflow(dep: Deployment, *args: str) -> None:
    airflow = str(Path(sys.executable).with_name("airflow"))
    done = subprocess.run(
        [airflow, *args], env=dep.env, cwd=dep.home, capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        raise DeploymentError(
            f"airflow {' '.join(args[:2])} exited {done.returncode}:\n{done.stderr[-3000:]}"
        )


def _token(dep: Deployment, user: str, password: str) -> str:
    return dep.request("POST", "/auth/token", {"username": user, "password": password})["access_token"]


@pytest.fixture(scope="module")
def fab(seaweed, tiny_model: Path, tmp_path_factory) -> Iterator[FabApi]:
    seaweed.create_bucket(BUCKET)
    home = tmp_path_factory.mktemp("openai-api-fab-home")
    if not _entry_point_installed():
        (home / "plugins").mkdir()
        (home / "plugins" / "vllm_batch_openai_api.py").write_text(PLUGIN_SHIM)
    dags = dags_folder(home, {"vllm_batch_openai.py": (REPO / "dags" / "vllm_batch_openai.py").read_text()})
    (port,) = _free_ports(1)
    env = deployment_env(seaweed, tiny_model, home, dags, port, "LocalExecutor")
    env.update(
        {
            "AIRFLOW__CORE__AUTH_MANAGER": FAB_AUTH_MANAGER,
            "AIRFLOW__VLLM_BATCH__OPENAI_FILES_URI": f"s3://{BUCKET}/api/",
            "AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY": SIGNING_KEY,
        }
    )
    dep = Deployment(home=home, api_url=f"http://{LOOPBACK}:{port}", env=env)
    passwords = {user: secrets.token_urlsafe(12) for user in ("admin", "alice", "bob", "nora")}
    dep.migrate_db()  # FAB's tables too (its db manager), as `airflow fab-db migrate` would
    _airflow(
        dep,
        "users",
        "create",
        "-u",
        "admin",
        "-p",
        passwords["admin"],
        "-r",
        "Admin",
        "-f",
        "a",
        "-l",
        "a",
        "-e",
        "admin@example.com",
    )
    _airflow(dep, "dags", "reserialize")
    try:
        dep.start(
            "api-server",
            [
                str(Path(sys.executable).with_name("airflow")),
                "api-server",
                "--host",
                LOOPBACK,
                "--port",
                str(port),
                "--workers",
                "1",
            ],
        )
        wait_until("the API server", lambda: dep.request("GET", "/api/v2/monitor/health"), 180, dep)
        dep.token = _token(dep, "admin", passwords["admin"])
        # Any request builds the API's app, which registers its resource with FAB.
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=dep.api_url + URL_PREFIX, api_key="x", max_retries=0).files.list()
        dep.request(
            "POST",
            "/auth/fab/v1/roles",
            {
                "name": API_ROLE,
                "actions": [
                    {"action": {"name": a}, "resource": {"name": RESOURCE_NAME}} for a in FAB_ACTIONS.values()
                ],
            },
        )
        for user, role in (("alice", API_ROLE), ("bob", API_ROLE), ("nora", "Viewer")):
            dep.request(
                "POST",
                "/auth/fab/v1/users",
                {
                    "username": user,
                    "password": passwords[user],
                    "email": f"{user}@example.com",
                    "first_name": user,
                    "last_name": user,
                    "roles": [{"name": role}],
                },
            )
        dep.request("PATCH", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}", {"is_paused": False})
        clients = {
            user: OpenAI(
                base_url=dep.api_url + URL_PREFIX,
                api_key=_token(dep, user, passwords[user]),
                max_retries=0,
                timeout=60,
            )
            for user in ("alice", "bob", "nora")
        }
        yield FabApi(dep, clients, passwords)
    finally:
        dep.stop()


@pytest.fixture(scope="module")
def queued(fab: FabApi):
    """Alice's batch, created through the API: queued for good (no scheduler)."""
    alice = fab.clients["alice"]
    uploaded = alice.files.create(file=("in.jsonl", LINES), purpose="batch")
    return alice.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def _objects(seaweed) -> dict[str, bytes]:
    client = seaweed.client()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix="api/").get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listed}


def test_a_user_with_the_apis_permission_uses_it_and_one_without_gets_403(fab: FabApi, queued):
    alice, bob, nora = fab.clients["alice"], fab.clients["bob"], fab.clients["nora"]
    assert queued.status == "validating"
    assert alice.batches.retrieve(queued.id).status == "validating"
    assert [b.id for b in alice.batches.list().data] == [queued.id]
    # Another holder of the permission: the batch is not his (404, not listed).
    with pytest.raises(NotFoundError):
        bob.batches.retrieve(queued.id)
    assert bob.batches.list().data == []
    # FAB's Viewer, without the API's permission: every call is 403, an upload included.
    with pytest.raises(PermissionDeniedError):
        nora.files.create(file=("in.jsonl", LINES), purpose="batch")
    with pytest.raises(PermissionDeniedError):
        nora.batches.list()
    # The API role holds nothing on the batch DAG: Airflow's own API shows alice none of its runs.
    admin, fab.dep.token = fab.dep.token, alice.api_key
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            fab.dep.request("GET", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}/dagRuns")
        assert refused.value.code == 403
    finally:
        fab.dep.token = admin


@pytest.mark.parametrize("change", list(RUN_CHANGES))
def test_an_api_user_cannot_change_another_users_batch_through_airflows_rest_api(
    fab: FabApi, queued, seaweed, change
):
    """Bob holds the API role only; the conf he would copy is alice's run's as the admin reads it (he cannot even list runs)."""
    dep, alice = fab.dep, fab.clients["alice"]
    run = dep.dag_run(DEFAULT_BATCH_DAG_ID, queued.id)
    files = _objects(seaweed)
    try:
        status = change_as(
            dep, fab.clients["bob"].api_key, change, queued.id, run["conf"]
        )  # no token in a failed assert
        assert status == 403, change
    finally:
        dep.request("PATCH", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}", {"is_paused": False})
    assert dep.dag_run(DEFAULT_BATCH_DAG_ID, queued.id) == run
    assert not dep.request("GET", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}")["is_paused"]
    assert [
        r["dag_run_id"]
        for r in dep.request("GET", f"/api/v2/dags/{DEFAULT_BATCH_DAG_ID}/dagRuns")["dag_runs"]
    ] == [queued.id]
    assert alice.batches.retrieve(queued.id).status == "validating"
    assert _objects(seaweed) == files
