"""The sharded DAG on a real Airflow deployment: CeleryExecutor, Redis, a ``gpu`` worker.

Everything a production install runs, on 127.0.0.1 and a throw-away home: Redis (the
Celery broker), ``airflow api-server``, ``scheduler``, ``dag-processor``, one
``airflow celery worker -q gpu`` and one for the ``default`` queue (the upload, split,
merge and validate tasks). The DAG is triggered through the REST API (``/api/v2``,
a JWT from ``POST /auth/token``), polled until it ends, and every process started here
is stopped by its process group at the end and checked gone.

Airflow 3 runs the CeleryExecutor on SQLite (the workers reach the database only
through the API server's execution API), so no PostgreSQL is needed here.

Fresh processes: a CeleryExecutor deployment (executor, broker and queues of its own) that no
LocalExecutor deployment can stand in for; each shard's runner engine is its task's child process.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_batch_embedded.airflow_deployment import Deployment, dags_folder, deployment_env, wait_until
from vllm_batch_embedded.demo import BUCKET
from vllm_batch_embedded.seaweedfs import _free_ports

pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.celery]

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "vllm_batch_sharded"
N_REQUESTS = 20
SHARD_SIZE = 10
RUN_TIMEOUT_S = 420
LOOPBACK = "127.0.0.1"


def _celery_env(seaweed, tiny_model: Path, home: Path, redis_port: int, api_port: int) -> dict[str, str]:
    # Only the DAG under test: the others (a @daily one among them) would start runs of their own.
    dags = dags_folder(home, {f"{DAG_ID}.py": (REPO / "dags" / f"{DAG_ID}.py").read_text()})
    env = deployment_env(seaweed, tiny_model, home, dags, api_port, "CeleryExecutor")
    env.update(
        {
            "AIRFLOW__CELERY__BROKER_URL": f"redis://{LOOPBACK}:{redis_port}/0",
            "AIRFLOW__CELERY__RESULT_BACKEND": f"redis://{LOOPBACK}:{redis_port}/1",
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": "1",
        }
    )
    return env


@pytest.fixture(scope="module")
def deployment(seaweed, tiny_model, tmp_path_factory) -> Iterator[Deployment]:
    """Redis and a whole Airflow (CeleryExecutor) on loopback ports; stopped and checked gone at the end."""
    redis = shutil.which("redis-server")
    if redis is None:
        pytest.fail("redis-server is not installed: `make test` installs it (apt-get install redis-server).")
    home = tmp_path_factory.mktemp("celery-airflow")
    redis_port, api_port = _free_ports(2)
    env = _celery_env(seaweed, tiny_model, home, redis_port, api_port)
    airflow = str(Path(sys.executable).with_name("airflow"))
    dep = Deployment(home=home, api_url=f"http://{LOOPBACK}:{api_port}", env=env)
    dep.migrate_db()
    try:
        dep.start(
            "redis",
            [
                redis,
                "--bind",
                LOOPBACK,
                "--port",
                str(redis_port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(home),
            ],
        )
        dep.start(
            "api-server",
            [airflow, "api-server", "--host", LOOPBACK, "--port", str(api_port), "--workers", "1"],
        )
        dep.start("scheduler", [airflow, "scheduler"])
        dep.start("dag-processor", [airflow, "dag-processor"])
        # --skip-serve-logs: two workers on one host would both bind the log server's port.
        dep.start(
            "worker-gpu",
            [airflow, "celery", "worker", "-q", "gpu", "-c", "1", "-H", "gpu@%h", "--skip-serve-logs"],
        )
        dep.start(
            "worker-default",
            [
                airflow,
                "celery",
                "worker",
                "-q",
                "default",
                "-c",
                "1",
                "-H",
                "default@%h",
                "--skip-serve-logs",
            ],
        )
        wait_until("the API server", lambda: dep.request("GET", "/api/v2/monitor/health"), 180, dep)
        password = json.loads((home / "passwords.json").read_text())["admin"]
        dep.token = dep.request("POST", "/auth/token", {"username": "admin", "password": password})[
            "access_token"
        ]
        yield dep
    finally:
        dep.stop()


@pytest.fixture(scope="module")
def celery_run(deployment: Deployment) -> dict:
    """Trigger the sharded DAG through the REST API and wait for the run to end."""
    dep = deployment
    wait_until(
        f"the DAG processor to parse {DAG_ID}",
        lambda: dep.request("GET", f"/api/v2/dags/{DAG_ID}"),
        180,
        dep,
        interval=2,
    )
    dep.request("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})
    conf = {"n_requests": N_REQUESTS, "shard_size": SHARD_SIZE, "max_tokens": 4}
    run = dep.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
    run_path = f"/api/v2/dags/{DAG_ID}/dagRuns/{run['dag_run_id']}"
    started = time.monotonic()

    def finished():
        state = dep.request("GET", run_path)["state"]
        return state if state in ("success", "failed") else None

    state = wait_until("the DAG run to finish", finished, RUN_TIMEOUT_S, dep, interval=3)
    tis = dep.request("GET", f"{run_path}/taskInstances")["task_instances"]
    merged = None
    if state == "success":
        merged = dep.request("GET", f"{run_path}/taskInstances/merge/xcomEntries/return_value")["value"]
    return {
        "state": state,
        "task_instances": tis,
        "merged": merged,
        "duration_s": time.monotonic() - started,
        "run_id": run["dag_run_id"],
    }


def _diagnose(dep: Deployment) -> str:
    return "\n".join(
        f"--- {name} ---\n{dep.log(name)[-2500:]}" for name in ("scheduler", "worker-gpu", "worker-default")
    )


def test_sharded_dag_triggered_through_the_rest_api_succeeds_on_celery(celery_run, deployment):
    assert celery_run["state"] == "success", _diagnose(deployment)
    states = {(ti["task_id"], ti["map_index"]): ti["state"] for ti in celery_run["task_instances"]}
    assert states == {
        ("upload", -1): "success",
        ("split", -1): "success",
        ("vllm_batch", 0): "success",
        ("vllm_batch", 1): "success",
        ("merge", -1): "success",
        ("validate", -1): "success",
    }


def test_inference_tasks_are_queued_on_gpu_and_run_by_the_gpu_worker_only(celery_run, deployment):
    queues = {(ti["task_id"], ti["map_index"]): ti["queue"] for ti in celery_run["task_instances"]}
    assert queues[("vllm_batch", 0)] == queues[("vllm_batch", 1)] == "gpu"
    assert {q for (task_id, _), q in queues.items() if task_id != "vllm_batch"} == {"default"}
    gpu_log, default_log = deployment.log("worker-gpu"), deployment.log("worker-default")
    assert gpu_log.count("task_id='vllm_batch'") == 2, gpu_log[-3000:]
    assert "task_id='vllm_batch'" not in default_log
    for task_id in ("upload", "split", "merge", "validate"):
        assert f"task_id='{task_id}'" in default_log
        assert f"task_id='{task_id}'" not in gpu_log


def test_merged_output_of_the_celery_run_answers_every_request_in_order(celery_run, seaweed):
    merged = celery_run["merged"]
    assert merged["request_counts"] == {"total": N_REQUESTS, "completed": N_REQUESTS, "failed": 0}
    assert merged["shards"] == 2
    bucket, _, key = merged["output_uri"].removeprefix("s3://").partition("/")
    assert bucket == BUCKET
    body = seaweed.client().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    assert [json.loads(line)["custom_id"] for line in body.splitlines()] == [
        f"request-{i}" for i in range(N_REQUESTS)
    ]


def test_every_process_started_for_the_deployment_is_gone_after_teardown(deployment, celery_run):
    # Runs last in this module: stop now (the fixture's finalizer then finds nothing to stop).
    leftover = deployment.stop()
    assert leftover == []
    assert all(proc.poll() is not None for proc in deployment.processes.values())
