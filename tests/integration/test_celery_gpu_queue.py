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
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_batch_embedded.airflow_deployment import Deployment, celery_executor_deployment, wait_until
from vllm_batch_embedded.demo import BUCKET

pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.celery]

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "vllm_batch_sharded"
N_REQUESTS = 20
SHARD_SIZE = 10
RUN_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def deployment(seaweed, tiny_model, tmp_path_factory) -> Iterator[Deployment]:
    """Redis and a whole Airflow (CeleryExecutor, workers ``gpu`` and ``default``) on loopback ports; stopped at the end."""
    home = tmp_path_factory.mktemp("celery-airflow")
    # Only the DAG under test: the others (a @daily one among them) would start runs of their own.
    dag_files = {f"{DAG_ID}.py": (REPO / "dags" / f"{DAG_ID}.py").read_text()}
    with celery_executor_deployment(
        seaweed, tiny_model, home, dag_files, workers={"gpu": "gpu", "default": "default"}
    ) as dep:
        yield dep


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
    assert {"redis", "worker-gpu", "worker-default"} <= set(deployment.processes)
    leftover = deployment.stop()
    assert leftover == []
    assert all(proc.poll() is not None for proc in deployment.processes.values())
