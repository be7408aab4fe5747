"""Faults injected for real: S3 dying and coming back, the engine killed, the task SIGTERMed.

Each test names the fault and asserts what the user sees, that nothing was lost or
half-published, and that no engine process outlives the task.

Fresh processes: each test kills the engine or S3, or SIGTERMs the task: what it kills cannot be
shared.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from datetime import datetime, timezone

import pytest

from airflow_vllm_batch.engines import VLLMRunner
from tests.integration.dagrun import REPO, DagRunResult, register_dag, run_dag
from tests.processes import processes_with
from vllm_batch_embedded.seaweedfs import SeaweedFS

pytestmark = [pytest.mark.integration, pytest.mark.engine]

BUCKET = "faults"


def _chat_lines(model: str, n: int, max_tokens: int = 4) -> str:
    return "".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"Count to {i}"}],
                    "max_completion_tokens": max_tokens,
                },
            }
        )
        + "\n"
        for i in range(n)
    )


def _run(name: str, logical_date: datetime | None = None, **op_kwargs) -> DagRunResult:
    """Run one task of ``VLLMBatchOperator``; the same ``name`` and ``logical_date`` are the same
    DAG run and task instance again, as a retry or a clear is."""
    from airflow.sdk import DAG

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    with DAG(f"fault_{name}", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
        VLLMBatchOperator(task_id="vllm_batch", **op_kwargs)
    register_dag(dag)
    return run_dag(dag, logical_date=logical_date, run_after=logical_date)


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def own_s3(tmp_path, airflow_db):
    """A SeaweedFS of this test's own, behind connection ``s3_fault``, that the test may kill."""
    servers: list[SeaweedFS] = []

    def start(keys: tuple[str, str] | None = None) -> SeaweedFS:
        s3 = SeaweedFS(
            tmp_path / "s3", access_key=keys[0] if keys else None, secret_key=keys[1] if keys else None
        )
        s3.start()
        s3.create_bucket(BUCKET)
        os.environ["AIRFLOW_CONN_S3_FAULT"] = s3.airflow_connection_json()
        servers.append(s3)
        return s3

    yield start
    for s3 in servers:
        s3.stop()
    os.environ.pop("AIRFLOW_CONN_S3_FAULT", None)


def test_s3_down_at_start_then_after_inference_loses_nothing_and_retries_publish_without_the_engine(
    own_s3, tiny_model, tmp_path
):
    s3 = own_s3()
    model = str(tiny_model)
    s3.client().put_object(Bucket=BUCKET, Key="job/input.jsonl", Body=_chat_lines(model, 3).encode())
    # Runs the real engine, then kills S3 at the moment the results are due.
    wrapper = tmp_path / "engine_then_kill_s3.py"
    wrapper.write_text(
        textwrap.dedent(
            """
            import os, signal, subprocess, sys
            rc = subprocess.call([sys.executable, "-m", "vllm.entrypoints.launchers.run_batch", *sys.argv[1:]])
            os.killpg(int(os.environ["FAULT_S3_PID"]), signal.SIGKILL)
            sys.exit(rc)
            """
        )
    )
    results_dir = tmp_path / "results"
    kwargs = {
        "input_uri": f"s3://{BUCKET}/job/input.jsonl",
        "output_uri": f"s3://{BUCKET}/job/results.jsonl",
        "model": model,
        "aws_conn_id": "s3_fault",
        "results_dir": str(results_dir),
        "engine": VLLMRunner(
            command=[sys.executable, str(wrapper)],
            args=["--enforce-eager"],
            env={"FAULT_S3_PID": str(s3.pid)},
        ),
        # A rewrite, so the engine reads a cleaned copy staged in S3 beside the output.
        "default_body": {"temperature": 0.0},
    }

    # Every run below is the same task instance again (a retry): it takes over the lease the
    # first try could not give back while S3 was down.
    retry = {"name": "s3_retries", "logical_date": datetime(2026, 1, 2, tzinfo=timezone.utc)}
    first = _run(**retry, **kwargs)
    assert first.state == "failed"
    assert "S3 failed while staging the engine's results" in first.output
    assert "a retry on this worker publishes them without running the engine" in first.output
    (kept,) = (results_dir / "airflow-vllm-batch").glob("*/results.jsonl")
    first_kept = kept.read_bytes()
    assert len(first_kept.splitlines()) == 3

    # S3 still down: a clear error before anything runs.
    down = _run(**retry, **kwargs)
    assert down.state == "failed"
    assert "Nothing was run; check that S3 is reachable" in down.output
    assert "Starting the vLLM engine" not in down.output

    s3 = own_s3(keys=(s3.access_key, s3.secret_key))  # back, same data, new port
    second = _run(**retry, **kwargs)
    assert second.state == "success", second.output[-3000:]
    assert "without running the engine again" in second.output
    assert "Starting the vLLM engine" not in second.output
    body = s3.client().get_object(Bucket=BUCKET, Key="job/results.jsonl")["Body"].read()
    assert body == first_kept  # the very results of the first try, byte for byte
    assert sorted(json.loads(line)["custom_id"] for line in body.decode().splitlines()) == ["r0", "r1", "r2"]
    assert not list((results_dir / "airflow-vllm-batch").glob("*/results.jsonl"))  # published, then removed

    third = _run(**retry, **kwargs)
    assert third.state == "success"
    assert "Not running the engine again: the output at" in third.output
    assert third.xcom("vllm_batch") == second.xcom("vllm_batch")


def test_sigkill_of_the_real_engine_fails_the_task_and_leaves_no_engine_process(
    embedded, airflow_db, tiny_model
):
    from vllm_batch_embedded.demo import BUCKET as DEMO_BUCKET

    model = str(tiny_model)
    embedded.client().put_object(
        Bucket=DEMO_BUCKET, Key="sigkill/input.jsonl", Body=_chat_lines(model, 2).encode()
    )
    marker = f"BATCH_TEST_MARKER=sigkill-{uuid.uuid4().hex}"
    killed: list[int] = []

    def kill_engine_leader():
        # Wait for the engine and its EngineCore child, then kill only the leader, as the
        # kernel's OOM killer would: the child must not be left running.
        pids = _wait_for(
            lambda: len(p := processes_with(marker, guards=False)) >= 2 and p,
            120,
            "the engine and EngineCore",
        )
        leader = min(pids)
        os.kill(leader, signal.SIGKILL)
        killed.append(leader)

    watcher = threading.Thread(target=kill_engine_leader, daemon=True)
    watcher.start()
    result = _run(
        "sigkill",
        input_uri=f"s3://{DEMO_BUCKET}/sigkill/input.jsonl",
        output_uri=f"s3://{DEMO_BUCKET}/sigkill/results.jsonl",
        model=model,
        engine=VLLMRunner(args=["--enforce-eager"], env={marker.split("=")[0]: marker.split("=")[1]}),
    )
    watcher.join(5)
    assert killed, "the watcher never saw the engine"
    assert result.state == "failed"
    assert "killed by signal 9" in result.output
    _wait_for(lambda: not processes_with(marker), 15, "no engine process left")
    listed = embedded.client().list_objects_v2(Bucket=DEMO_BUCKET, Prefix="sigkill/").get("Contents", [])
    assert [o["Key"] for o in listed] == ["sigkill/input.jsonl"]


SIGTERM_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from datetime import datetime, timezone
from airflow.sdk import DAG
from airflow_vllm_batch.engines import VLLMRunner
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from tests.integration.dagrun import register_dag

with DAG("fault_sigterm", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    VLLMBatchOperator(
        task_id="vllm_batch",
        input_uri={input_uri!r},
        output_uri={output_uri!r},
        model={model!r},
        engine=VLLMRunner(args=["--enforce-eager"], env={{"BATCH_TEST_MARKER": {marker!r}}}, kill_grace=5),
    )
register_dag(dag)
dr = dag.test()
print("DAGRUN STATE", dr.state, flush=True)
"""


def test_sigterm_of_the_task_stops_every_engine_process(embedded, airflow_db, tiny_model, tmp_path):
    from vllm_batch_embedded.demo import BUCKET as DEMO_BUCKET

    model = str(tiny_model)
    embedded.client().put_object(
        Bucket=DEMO_BUCKET, Key="sigterm/input.jsonl", Body=_chat_lines(model, 2).encode()
    )
    marker = f"sigterm-{uuid.uuid4().hex}"
    script = tmp_path / "task.py"
    script.write_text(
        SIGTERM_SCRIPT.format(
            repo=str(REPO),
            input_uri=f"s3://{DEMO_BUCKET}/sigterm/input.jsonl",
            output_uri=f"s3://{DEMO_BUCKET}/sigterm/results.jsonl",
            model=model,
            marker=marker,
        )
    )
    log = tmp_path / "task.log"
    with open(log, "wb") as out:
        task = subprocess.Popen(
            [sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        try:
            _wait_for(lambda: len(processes_with(f"BATCH_TEST_MARKER={marker}")) >= 2, 120, "the engine")
            task.send_signal(signal.SIGTERM)  # what the supervisor does on a timeout, a clear, a deploy
            task.wait(timeout=90)
        finally:
            if task.poll() is None:
                task.kill()
    output = log.read_text(errors="replace")
    assert "Stopping the vLLM engine" in output
    _wait_for(lambda: not processes_with(f"BATCH_TEST_MARKER={marker}"), 15, "no engine process left")
    listed = embedded.client().list_objects_v2(Bucket=DEMO_BUCKET, Prefix="sigterm/").get("Contents", [])
    assert [o["Key"] for o in listed] == ["sigterm/input.jsonl"]
