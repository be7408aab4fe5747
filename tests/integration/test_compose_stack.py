"""``docker compose up``, for real: the images of ``docker/`` built, the stack of ``docker-compose.yaml`` started.

Everything the compose file starts with the ``cpu`` profile: PostgreSQL, Redis, SeaweedFS (and
its bucket), the API server, scheduler, DAG processor, triggerer, the ``default`` Celery worker
and the ``gpu``-queue worker on vLLM for CPUs. The example pipeline DAG is triggered through
the REST API (a JWT from ``/auth/token`` with the compose file's user), waited for, and its
manifest and results are read from the stack's S3.

Docker Hub is out of reach here, so the official images are stood in for by images built from
a debootstrapped Debian (``compose_stack.py``); the images the compose file builds come from
``docker/``'s Dockerfiles, on that stand-in base. The tiny local model is mounted into the
worker (no model hub). The phases' durations go to ``.cache/compose/timings.json``.

Fresh processes: the stack docker compose starts is what is tested.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration import compose_stack as cs
from vllm_batch_embedded.airflow_deployment import rest_request, wait_until
from vllm_batch_embedded.seaweedfs import _free_ports

# Cold, the images take minutes (timings.json); the build runs in the background from the
# start of the session (conftest.py), so the test usually waits for less.
IMAGES_TIMEOUT_S = 1800
pytestmark = [
    pytest.mark.integration,
    pytest.mark.engine,
    pytest.mark.compose,
    pytest.mark.timeout(IMAGES_TIMEOUT_S + 1200),
]

DAG_ID = "vllm_batch_pipeline"
N_REQUESTS = 4
USER = ("airflow", "airflow")  # the compose file's default UI user


class RestAPI:
    """Airflow's REST API on the stack's published port."""

    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.token: str | None = None

    def request(self, method: str, path: str, body: dict | None = None) -> Any:
        return rest_request(self.url, method, path, body, self.token)


@pytest.fixture(scope="module")
def stack(tiny_model) -> Iterator[tuple[cs.ComposeStack, cs.Timings]]:
    """The images built and the stack up; the stack and its volumes removed at the end (the images stay, as a cache)."""
    standins = cs.IMAGES.wait(timeout=IMAGES_TIMEOUT_S)
    timings = cs.IMAGES.timings
    stack = cs.ComposeStack(standins, tiny_model, tuple(_free_ports(3)))
    try:
        with timings.phase("stack up (compose up -d, services healthy)"):
            stack.up()
        yield stack, timings
    finally:
        with timings.phase("stack down"):
            stack.down()
        cs.IMAGES.close()


@pytest.fixture(scope="module")
def pipeline_run(stack) -> dict:
    """Trigger the example pipeline through the REST API and wait for it to end."""
    compose, timings = stack
    api = RestAPI(compose.api_port)
    with timings.phase("pipeline run (trigger to end)"):
        wait_until("the API server", lambda: api.request("GET", "/api/v2/version"), 300, interval=2)
        api.token = api.request("POST", "/auth/token", {"username": USER[0], "password": USER[1]})[
            "access_token"
        ]
        wait_until(
            f"the DAG processor to parse {DAG_ID}",
            lambda: api.request("GET", f"/api/v2/dags/{DAG_ID}"),
            300,
            interval=2,
        )
        api.request("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})
        conf = {"n_requests": N_REQUESTS, "max_tokens": 4}
        run_id = api.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})[
            "dag_run_id"
        ]
        run_path = f"/api/v2/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run_id, safe='')}"

        def ended():
            state = api.request("GET", run_path)["state"]
            return state if state in ("success", "failed") else None

        state = wait_until(f"DAG run {run_id} to end", ended, 600, interval=3)
    tis = {ti["task_id"]: ti for ti in api.request("GET", f"{run_path}/taskInstances")["task_instances"]}
    validated = None
    if state == "success":
        validated = api.request("GET", f"{run_path}/taskInstances/validate/xcomEntries/return_value")["value"]
    return {"state": state, "run_id": run_id, "task_instances": tis, "validated": validated}


def _diagnose(compose: cs.ComposeStack) -> str:
    return compose.logs("airflow-scheduler", "airflow-worker", "airflow-worker-gpu-cpu", tail=60)


def test_example_pipeline_triggered_through_the_rest_api_succeeds_on_the_compose_stack(stack, pipeline_run):
    compose, _ = stack
    assert pipeline_run["state"] == "success", _diagnose(compose)
    states = {task_id: ti["state"] for task_id, ti in pipeline_run["task_instances"].items()}
    assert states == {"upload": "success", "vllm_batch": "success", "validate": "success"}
    assert pipeline_run["task_instances"]["vllm_batch"]["queue"] == "gpu"
    # Run by the cpu profile's gpu-queue worker (its container), not by the default worker.
    assert (
        pipeline_run["task_instances"]["vllm_batch"]["hostname"]
        != pipeline_run["task_instances"]["upload"]["hostname"]
    )
    assert pipeline_run["validated"]["request_counts"] == {
        "total": N_REQUESTS,
        "completed": N_REQUESTS,
        "failed": 0,
    }


def test_manifest_and_results_of_the_compose_run_are_in_the_stacks_s3(stack, pipeline_run):
    compose, _ = stack
    assert pipeline_run["state"] == "success", _diagnose(compose)
    from vllm_batch_examples import key_safe

    s3 = compose.s3_client()
    # Only this run's prefix: unpausing the @daily DAG within 2.4 h after midnight UTC also
    # starts today's scheduled run (CronTriggerTimetable runs the past trigger when it is within
    # a tenth of the interval), which publishes a manifest of its own beside this one.
    prefix = f"vllm-batch/{DAG_ID}/{key_safe(pipeline_run['run_id'])}/"
    listed = s3.list_objects_v2(Bucket=compose.bucket, Prefix=prefix).get("Contents", [])
    manifests = [o["Key"] for o in listed if o["Key"].endswith(".manifest.json")]
    assert len(manifests) == 1, [o["Key"] for o in listed]
    manifest = json.loads(s3.get_object(Bucket=compose.bucket, Key=manifests[0])["Body"].read())
    assert manifest["model"] == cs.MODEL_IN_CONTAINER
    assert manifest["request_counts"] == {"total": N_REQUESTS, "completed": N_REQUESTS, "failed": 0}
    bucket, _, key = manifest["output_uri"].removeprefix("s3://").partition("/")
    assert bucket == compose.bucket
    lines = [
        json.loads(line)
        for line in s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode().splitlines()
    ]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"request-{i}" for i in range(N_REQUESTS))
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in lines)
