"""The operator under Airflow's real supervisor: kills, "mark failed" and Airflow's own retries.

One LocalExecutor deployment for the module (``airflow api-server``, ``scheduler``,
``dag-processor`` on 127.0.0.1, a throw-away home and SQLite, see ``vllm_batch_embedded/airflow_deployment.py``), its
own SeaweedFS (which the S3 test crashes and brings back on the same ports) and the real
vLLM engine on the CPU with the tiny model. Every DAG run is triggered through the REST API;
each task runs as Airflow runs it in production: scheduler -> LocalExecutor worker ->
supervisor -> task runner (a forked child) -> the operator's guard -> the vLLM engine.

The engine's processes are found by a marker in their environment (the options' ``env``), which
nothing else carries. The guard (``python -I -c <GUARD_SCRIPT>``) is the marked process
whose parent is not marked; its parent is the task runner, its child the engine.

The cases run one after another (two cores): each starts an engine of its own.

Fresh processes: its own deployment and an engine per case: each case kills, marks failed or
retries a task under Airflow's real supervisor.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import psutil
import pytest

from airflow_vllm_batch.engines.vllm.launcher import ARGV_ENV
from airflow_vllm_batch.engines.vllm.process import GUARD_SCRIPT
from tests.integration.restartable_seaweedfs import RestartableSeaweedFS
from tests.integration.vllm_metrics import requests_answered
from vllm_batch_embedded.airflow_deployment import (
    Deployment,
    DeploymentError,
    local_executor_deployment,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.engine]

BUCKET = "supervised"
TASK_ID = "vllm_batch"
MARKER_VAR = "VLLM_BATCH_TEST_MARKER"
#: Big enough that the engine is still busy when a test acts (it acts at the engine's start).
N_BIG = 300
#: The retry cases run the whole batch at least once: kept small.
N_SMALL = 12
MAX_TOKENS = 64
#: From a task start to a live engine: scheduling, the engine probe, the engine-args check.
ENGINE_START_TIMEOUT_S = 240
RUN_TIMEOUT_S = 300
#: The server-engine case: enough requests that the server is still answering when it is killed.
N_SERVER = 1500
#: Its checkpoint interval: a kill leaves parts behind within seconds.
SERVER_CHECKPOINT_S = 1
#: How long an engine may outlive its task runner.
ENGINE_GONE_S = 10

DAG_FILE = """
# DAGs of test_supervised.py, written into the test deployment's own DAGs folder.
from datetime import datetime, timedelta, timezone

from airflow.sdk import DAG

from airflow_vllm_batch.engines import VLLMRunner, VLLMServer
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

# SETTINGS (a dict) is prepended by the test.


#: One marker per run (the test sets it in the run's conf), to find the run's processes.
MARKER_ENV = {SETTINGS["marker_var"]: "{{ dag_run.conf['marker'] }}"}


def batch_dag(dag_id, input_key, retries, retry_delay_s, engine=None, **extra):
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc), catchup=False) as dag:
        VLLMBatchOperator(
            task_id=SETTINGS["task_id"],
            input_uri=f"s3://{SETTINGS['bucket']}/{input_key}",
            # One output per case, and one marker per run (the test sets both in the run's conf).
            output_uri=f"s3://{SETTINGS['bucket']}/out/" + "{{ dag_run.conf['case'] }}/results.jsonl",
            model=SETTINGS["model"],
            engine=engine or VLLMRunner(args=["--enforce-eager"], env=MARKER_ENV),
            results_dir=SETTINGS["results_dir"],
            retries=retries,
            retry_delay=timedelta(seconds=retry_delay_s),
            **extra,
        )
    return dag


no_retry = batch_dag("supervised_no_retry", "in/big.jsonl", retries=0, retry_delay_s=1)
retry = batch_dag("supervised_retry", "in/small.jsonl", retries=1, retry_delay_s=1)
retry_mismatch = batch_dag(
    "supervised_retry_mismatch",
    "in/small.jsonl",
    retries=1,
    retry_delay_s=1,
    engine=VLLMRunner(command=[SETTINGS["python"], SETTINGS["wrapper"], SETTINGS["wrapper_state"]], args=["--enforce-eager"], env=MARKER_ENV),
)
# Try 2 must find S3 back: the test restarts it once try 1 has failed, which takes seconds.
retry_s3 = batch_dag("supervised_retry_s3", "in/small.jsonl", retries=1, retry_delay_s=15)
# The server engine, started by the task; checkpoints every second, so that a server killed
# mid-run leaves parts for the retry.
retry_server = batch_dag(
    "supervised_server_retry", "in/server.jsonl", retries=1, retry_delay_s=1,
    engine=VLLMServer(args=["--enforce-eager"], env=MARKER_ENV, checkpoint_interval=SETTINGS["checkpoint_s"], max_in_flight=32),
)
"""

#: The real runner, whose output loses its last line the first time only: a results mismatch on try 1.
TRUNCATING_WRAPPER = """
import subprocess, sys
from pathlib import Path

state, args = Path(sys.argv[1]), sys.argv[2:]
with open(state / "starts", "a") as starts:
    starts.write("start\\n")
rc = subprocess.call([sys.executable, "-m", "vllm.entrypoints.launchers.run_batch", *args])
truncated = state / "truncated"
if rc == 0 and not truncated.exists():
    output = Path(args[args.index("-o") + 1])
    lines = output.read_bytes().splitlines(keepends=True)
    output.write_bytes(b"".join(lines[:-1]))
    truncated.write_text(f"dropped 1 of {len(lines)} lines\\n")
sys.exit(rc)
"""


# -- processes --------------------------------------------------------------------------


def marked_processes(marker: str) -> dict[int, int]:
    """PID -> parent PID of every live (not zombie) process whose environment holds the marker."""
    needle = f"{MARKER_VAR}={marker}\0".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes():
                continue
            stat = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        if stat[0] != "Z":
            found[int(entry.name)] = int(stat[1])
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


@dataclass(frozen=True)
class EngineTree:
    """One try's engine: the task runner that started it, the guard, the engine's leader."""

    task_runner: int
    guard: int
    engine: int


def engine_tree(marker: str) -> EngineTree | None:
    """The engine of the try whose engine carries ``marker``, once the engine has been exec'd."""
    marked = marked_processes(marker)
    guards = [
        pid
        for pid, parent in marked.items()
        if parent not in marked and _cmdline(pid)[1:4] == ["-I", "-c", GUARD_SCRIPT]
    ]
    if len(guards) != 1:
        return None
    (guard,) = guards
    engines = [pid for pid, parent in marked.items() if parent == guard and "-I" not in _cmdline(pid)[1:2]]
    if len(engines) != 1:
        return None  # forked but not exec'd yet
    return EngineTree(task_runner=marked[guard], guard=guard, engine=engines[0])


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class EngineWatch:
    """Every guard (one per engine start) that carried the marker while the watch ran."""

    marker: str
    guards: set[int] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            if tree := engine_tree(self.marker):
                self.guards.add(tree.guard)


# -- the module's deployment ----------------------------------------------------------


def _chat_lines(model: str, n: int) -> bytes:
    return "".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"Count to {i}"}],
                    "max_completion_tokens": MAX_TOKENS,
                },
            }
        )
        + "\n"
        for i in range(n)
    ).encode()


@dataclass
class Supervised:
    """What the tests use: the deployment, its S3, and where the mismatch wrapper keeps its state."""

    dep: Deployment
    s3: RestartableSeaweedFS
    wrapper_state: Path

    def trigger(self, dag_id: str, case: str) -> tuple[str, str]:
        """Trigger a run of ``dag_id`` for ``case``; return its run id and its engine's marker."""
        marker = f"{case}-{uuid.uuid4().hex}"
        return self.dep.trigger(dag_id, {"case": case, "marker": marker}), marker

    def wait_for_engine(self, marker: str) -> EngineTree:
        return wait_until(
            "the task's vLLM engine to start",
            lambda: engine_tree(marker),
            ENGINE_START_TIMEOUT_S,
            self.dep,
            interval=0.2,
        )

    def diagnose(self, dag_id: str, run_id: str) -> str:
        return self.dep.diagnose(dag_id, run_id, TASK_ID)

    def log(self, dag_id: str, run_id: str, try_number: int) -> str:
        return self.dep.task_log(dag_id, run_id, TASK_ID, try_number)

    def output(self, case: str) -> tuple[list[str], dict]:
        """The published results' custom_ids (in file order) and the manifest of ``case``."""
        client = self.s3.client()
        body = client.get_object(Bucket=BUCKET, Key=f"out/{case}/results.jsonl")["Body"].read().decode()
        manifest = json.loads(
            client.get_object(Bucket=BUCKET, Key=f"out/{case}/results.manifest.json")["Body"].read()
        )
        return [json.loads(line)["custom_id"] for line in body.splitlines()], manifest

    def keys(self, prefix: str) -> list[str]:
        return [
            o["Key"]
            for o in self.s3.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
        ]


@pytest.fixture(scope="module")
def supervised(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    """A LocalExecutor deployment with its own SeaweedFS, the inputs and the DAGs; all stopped at the end."""
    root = tmp_path_factory.mktemp("supervised")
    s3 = RestartableSeaweedFS(root / "s3")
    s3.start()
    try:
        s3.create_bucket(BUCKET)
        client = s3.client()
        client.put_object(Bucket=BUCKET, Key="in/big.jsonl", Body=_chat_lines(str(tiny_model), N_BIG))
        client.put_object(Bucket=BUCKET, Key="in/small.jsonl", Body=_chat_lines(str(tiny_model), N_SMALL))
        client.put_object(Bucket=BUCKET, Key="in/server.jsonl", Body=_chat_lines(str(tiny_model), N_SERVER))
        wrapper = root / "truncate_once.py"
        wrapper.write_text(TRUNCATING_WRAPPER)
        wrapper_state = root / "wrapper-state"
        wrapper_state.mkdir()
        settings = {
            "bucket": BUCKET,
            "task_id": TASK_ID,
            "marker_var": MARKER_VAR,
            "model": str(tiny_model),
            "python": sys.executable,
            "wrapper": str(wrapper),
            "wrapper_state": str(wrapper_state),
            # Not the worker's shared /tmp/airflow-vllm-batch: other test sessions use that.
            "results_dir": str(root / "results"),
            "checkpoint_s": SERVER_CHECKPOINT_S,
        }
        source = f"SETTINGS = {settings!r}\n{DAG_FILE}"
        home = root / "airflow"
        home.mkdir()
        with local_executor_deployment(s3, tiny_model, home, {"supervised_dags.py": source}) as dep:
            for dag_id in (
                "supervised_no_retry",
                "supervised_retry",
                "supervised_retry_mismatch",
                "supervised_retry_s3",
                "supervised_server_retry",
            ):
                dep.wait_for_dag(dag_id)
            yield Supervised(dep=dep, s3=s3, wrapper_state=wrapper_state)
    finally:
        s3.stop()


# -- 1. the engine never outlives its task ------------------------------------------


def _fault_kills_the_engine_with_its_task(supervised: Supervised, fault: str) -> None:
    dep = supervised.dep
    dag_id = "supervised_no_retry"
    run_id, marker = supervised.trigger(dag_id, f"no-retry-{fault}")
    tree = supervised.wait_for_engine(marker)
    # The runner must be the real one: a descendant of the scheduler (LocalExecutor worker ->
    # supervisor -> task runner), not a process of this test.
    assert tree.task_runner in {p.pid for p in dep.descendants("scheduler")}, (
        tree,
        _cmdline(tree.task_runner),
    )
    faulted = time.monotonic()
    if fault == "sigkill":
        os.kill(tree.task_runner, signal.SIGKILL)
    elif fault == "sigterm":
        os.kill(tree.task_runner, signal.SIGTERM)
    else:
        dep.set_task_state(dag_id, run_id, TASK_ID, "failed")
    # "Mark failed" reaches the runner at the supervisor's next heartbeat (every 5 s), then
    # SIGTERM and, 5 s later, SIGKILL: the runner is gone within ~10 s.
    wait_until("the task runner to exit", lambda: not pid_alive(tree.task_runner), 30, dep, interval=0.1)
    runner_gone = time.monotonic()
    try:
        wait_until(
            "no engine process left", lambda: not marked_processes(marker), ENGINE_GONE_S, dep, interval=0.1
        )
    except DeploymentError:
        left = {pid: _cmdline(pid)[:4] for pid in marked_processes(marker)}
        pytest.fail(
            f"{fault}: engine processes still alive {ENGINE_GONE_S}s after the task runner {tree.task_runner} exited: "
            f"{left}\n{supervised.diagnose(dag_id, run_id)}"
        )
    print(
        f"{fault}: task runner gone {runner_gone - faulted:.1f}s after the fault, "
        f"no engine process {time.monotonic() - runner_gone:.1f}s after that"
    )
    state = dep.wait_for_run(dag_id, run_id, 120)
    ti = dep.task_instance(dag_id, run_id, TASK_ID)
    assert (state, ti["state"]) == ("failed", "failed"), supervised.diagnose(dag_id, run_id)
    assert ti["try_number"] == 1
    # Nothing was published: the run died before its engine finished. (A killed try's lease
    # may stay behind: it goes stale by itself, and the task's own retry takes it over.)
    left = supervised.keys(f"out/no-retry-{fault}/")
    assert not {f"out/no-retry-{fault}/results.jsonl", f"out/no-retry-{fault}/results.manifest.json"} & set(
        left
    ), left


def test_sigkill_of_the_task_runner_leaves_no_engine_process(supervised):
    """SIGKILL of the task runner (the OOM killer, the supervisor's escalation): on_kill never
    runs, yet no vLLM process is left a few seconds later, and the task ends failed."""
    _fault_kills_the_engine_with_its_task(supervised, "sigkill")


def test_sigterm_of_the_task_runner_leaves_no_engine_process(supervised):
    """SIGTERM of the task runner (a deploy, a timeout): on_kill stops the engine, the task ends failed."""
    _fault_kills_the_engine_with_its_task(supervised, "sigterm")


def test_mark_failed_through_the_rest_api_leaves_no_engine_process(supervised):
    """ "Mark failed" of the running task instance (``PATCH .../taskInstances/{task_id}``): the
    supervisor stops its runner and no vLLM process is left a few seconds later."""
    _fault_kills_the_engine_with_its_task(supervised, "mark_failed")


# -- 2. Airflow's own retry finishes the job --------------------------------------


def _assert_try_2_published_everything(
    supervised: Supervised, dag_id: str, run_id: str, case: str
) -> tuple[str, str]:
    """The run succeeded on try 2 with a complete output and manifest; return both tries' logs."""
    state = supervised.dep.wait_for_run(dag_id, run_id, RUN_TIMEOUT_S)
    ti = supervised.dep.task_instance(dag_id, run_id, TASK_ID)
    assert (state, ti["state"], ti["try_number"]) == ("success", "success", 2), supervised.diagnose(
        dag_id, run_id
    )
    tries = {t["try_number"]: t["state"] for t in supervised.dep.task_tries(dag_id, run_id, TASK_ID)}
    assert tries == {1: "failed", 2: "success"}, tries
    custom_ids, manifest = supervised.output(case)
    assert sorted(custom_ids) == sorted(f"r{i}" for i in range(N_SMALL))  # every request answered, once
    assert manifest["request_counts"] == {"total": N_SMALL, "completed": N_SMALL, "failed": 0}
    assert manifest["output_uri"] == f"s3://{BUCKET}/out/{case}/results.jsonl"
    # The run's staging is removed once published; the lease is given back.
    assert supervised.keys(f"out/{case}/") == [
        f"out/{case}/results.jsonl",
        f"out/{case}/results.manifest.json",
    ]
    return supervised.log(dag_id, run_id, 1), supervised.log(dag_id, run_id, 2)


def test_retry_after_the_engine_was_killed_runs_it_again_and_publishes(supervised):
    """Try 1's engine is SIGKILLed mid-run (not the task): try 1 fails, Airflow's retry runs
    try 2, which starts the engine again and publishes every answer and the manifest."""
    dag_id, case = "supervised_retry", "retry-engine-killed"
    run_id, marker = supervised.trigger(dag_id, case)
    with EngineWatch(marker) as watch:
        tree = supervised.wait_for_engine(marker)
        watch.guards.add(tree.guard)  # the watch may not sample it before the kill
        os.kill(tree.engine, signal.SIGKILL)
        first, second = _assert_try_2_published_everything(supervised, dag_id, run_id, case)
    assert "killed by signal 9" in first, first[-3000:]
    assert second.count("Starting the vLLM engine") == 1
    assert len(watch.guards) == 2, watch.guards


def test_retry_after_a_results_mismatch_runs_the_engine_again_and_publishes(supervised):
    """Try 1's results lack a line (the wrapper drops it, the first time only): the check fails
    try 1 and drops the staged results, so try 2 runs the engine again and publishes."""
    dag_id, case = "supervised_retry_mismatch", "retry-mismatch"
    run_id, _ = supervised.trigger(dag_id, case)
    first, second = _assert_try_2_published_everything(supervised, dag_id, run_id, case)
    assert "does not answer its input" in first, first[-3000:]
    assert (supervised.wrapper_state / "truncated").exists()
    assert (supervised.wrapper_state / "starts").read_text().count("start") == 2  # one engine start per try
    assert "without running the engine" not in second, second[-3000:]


@pytest.fixture(scope="module")
def s3_down_at_publish(supervised: Supervised) -> dict:
    """A run whose S3 crashes the moment try 1 has staged the engine's results, and comes back once try 1 failed."""
    dep, s3 = supervised.dep, supervised.s3
    dag_id, case = "supervised_retry_s3", "retry-s3-down"
    run_id, marker = supervised.trigger(dag_id, case)
    staging = f"out/{case}/results.jsonl.staging/"
    client = s3.client()

    def staged() -> bool:
        listed = client.list_objects_v2(Bucket=BUCKET, Prefix=staging).get("Contents", [])
        return any(o["Key"].endswith("/results.jsonl") for o in listed)

    with EngineWatch(marker) as watch:
        # Polled fast: the results check and the publish follow the staging within milliseconds.
        wait_until("try 1 to stage the engine's results", staged, RUN_TIMEOUT_S, dep, interval=0.005)
        s3.crash()
        crashed = time.monotonic()
        crashed_at = time.strftime("%H:%M:%S", time.gmtime()) + f".{int(time.time() % 1 * 1000):03d}Z"
        # S3 stays down until try 1 has failed: boto's own retries must not bridge the outage.
        ti_state = wait_until(
            "try 1 to fail while S3 is down",
            lambda: (
                (state := dep.task_instance(dag_id, run_id, TASK_ID)["state"])
                not in ("running", "queued", "scheduled")
                and state
            ),
            120,
            dep,
            interval=0.5,
        )
        print(
            f"s3: crashed at {crashed_at}; try 1 ended {ti_state!r} {time.monotonic() - crashed:.1f}s later"
        )
        if ti_state == "success":
            pytest.fail(
                f"S3 crashed at {crashed_at}, too late: try 1 had published already (a race of this test).\n{supervised.diagnose(dag_id, run_id)}"
            )
        s3.start()
        first, second = _assert_try_2_published_everything(supervised, dag_id, run_id, case)
    return {"first": first, "second": second, "guards": watch.guards}


def test_retry_after_s3_went_down_at_publish_publishes_without_the_engine(s3_down_at_publish):
    """S3 crashes once try 1 has staged the engine's results: try 1 fails at publish; S3 comes
    back; try 2 publishes the staged results without starting the engine again (one start in all)."""
    first, second = s3_down_at_publish["first"], s3_down_at_publish["second"]
    assert "S3 failed while publishing" in first, first[-3000:]
    assert "publishing them without running the engine" in second, second[-3000:]
    assert (first + second).count("Starting the vLLM engine") == 1
    assert len(s3_down_at_publish["guards"]) == 1, s3_down_at_publish["guards"]


def _failure(log: str) -> list[str]:
    """The exception chain of the try's "Task failed with exception" event, headline first."""
    for line in log.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if event.get("event") == "Task failed with exception":
                return [f"{d['exc_type']}: {d['exc_value'][:300]}" for d in event.get("error_detail", [])]
    return []


def test_s3_down_at_publish_fails_try_1_with_the_publish_error_that_says_a_retry_publishes(
    s3_down_at_publish,
):
    """The failure a user reads first names the fault and the remedy (PublishError: "a retry
    publishes them without running the engine again"), not a lease clean-up error."""
    chain = _failure(s3_down_at_publish["first"])
    assert chain, chain
    assert chain[0].startswith("PublishError: S3 failed while publishing"), chain


class EngineRanAgain(AssertionError):
    """Try 2 started the engine although try 1's engine had finished its batch."""


def test_retry_after_s3_went_down_while_the_engine_ran_publishes_its_results_without_the_engine(supervised):
    """S3 crashes while try 1's engine runs (it has read its input) and stays down until try 1
    failed: the finished results are kept on the worker, and try 2 (the same worker: LocalExecutor)
    publishes them without starting the engine again."""
    dep, s3 = supervised.dep, supervised.s3
    dag_id, case = "supervised_retry_s3", "retry-s3-down-mid-engine"
    run_id, marker = supervised.trigger(dag_id, case)
    with EngineWatch(marker) as watch:
        # The engine reads its whole input first; from "Running batch" on it needs no S3 (local output).
        wait_until(
            "try 1's engine to run the batch",
            lambda: "Running batch" in supervised.log(dag_id, run_id, 1),
            ENGINE_START_TIMEOUT_S,
            dep,
            interval=0.1,
        )
        s3.crash()
        wait_until(
            "try 1 to fail while S3 is down",
            lambda: (
                dep.task_instance(dag_id, run_id, TASK_ID)["state"] not in ("running", "queued", "scheduled")
            ),
            120,
            dep,
            interval=0.5,
        )
        s3.start()
        first, second = _assert_try_2_published_everything(supervised, dag_id, run_id, case)
    starts = (first + second).count("Starting the vLLM engine")
    if starts != 1 or len(watch.guards) != 1:
        raise EngineRanAgain(
            f"{starts} engine starts in the logs, {len(watch.guards)} engines seen; try 1 failed with {_failure(first)}"
        )


# -- 3. nothing is left behind ---------------------------------------------------------


def test_retry_after_the_task_started_server_was_killed_resumes_from_its_checkpoints(supervised):
    """The server engine's failure path under Airflow's own retry.

    Try 1's server is SIGKILLed once a checkpoint part is in S3: the try fails as
    retryable (the server is gone), Airflow retries, try 2 starts a new server, sends only
    what no checkpoint answers, and publishes every request exactly once.
    """
    dep = supervised.dep
    dag_id, case = "supervised_server_retry", "server-killed"
    run_id, marker = supervised.trigger(dag_id, case)
    tree = supervised.wait_for_engine(marker)
    wait_until(
        "a checkpoint part in S3",
        lambda: [k for k in supervised.keys(f"out/{case}/") if "/parts/part-" in k],
        RUN_TIMEOUT_S,
        dep,
        interval=0.2,
    )
    server = psutil.Process(tree.engine)
    for process in [*server.children(recursive=True), server]:  # vLLM's EngineCore too
        with contextlib.suppress(psutil.Error):
            process.kill()

    state = dep.wait_for_run(dag_id, run_id, RUN_TIMEOUT_S)
    ti = dep.task_instance(dag_id, run_id, TASK_ID)
    assert (state, ti["state"], ti["try_number"]) == ("success", "success", 2), supervised.diagnose(
        dag_id, run_id
    )
    first, second = supervised.log(dag_id, run_id, 1), supervised.log(dag_id, run_id, 2)
    assert "ServerUnavailableError" in first, first[-3000:]
    assert "checkpointed" in first, first[-3000:]
    resumed = re.search(r"(\d+) answered by earlier tries' checkpoints", second)
    sent = re.search(r"Server engine done: (\d+) requests sent", second)
    assert resumed, second[-3000:]
    assert sent, second[-3000:]
    assert int(resumed.group(1)) > 0
    assert int(sent.group(1)) + int(resumed.group(1)) == N_SERVER
    print(
        f"server killed: try 2 resumed {resumed.group(1)} answers from try 1's checkpoints and sent {sent.group(1)}"
    )
    custom_ids, manifest = supervised.output(case)
    assert sorted(custom_ids) == sorted(f"r{i}" for i in range(N_SERVER))
    assert manifest["request_counts"] == {"total": N_SERVER, "completed": N_SERVER, "failed": 0}
    assert not [k for k in supervised.keys(f"out/{case}/") if "/parts/" in k]  # removed once published


def _server_answered(tree: EngineTree) -> float:
    """Requests the task-started server has answered; 0 while it starts."""
    # The server's arguments travel in its environment, not on its command line (the launcher
    # hides them from ps): the environment it was started with still holds them.
    argv = json.loads(psutil.Process(tree.engine).environ()[ARGV_ENV])
    return requests_answered(f"http://127.0.0.1:{argv[argv.index('--port') + 1]}", starting=True)


# Alone: the bound on answers sent twice comes from the server's rate and the checkpoint
# interval; another worker's engine beside it delays uploads past it (answered twice 124, bound 113).
@pytest.mark.alone
def test_sigkill_of_a_server_task_at_half_then_airflows_retry_sends_only_the_unanswered(supervised):
    """SIGKILL of the task runner at about half: try 2 (Airflow's retry) finishes the batch.

    Requests answered twice (by try 1's server, then again in try 2) are those answered
    but not yet durable in a checkpoint at the kill: at most what was in flight plus the
    answers of the open checkpoint interval and of a part still uploading, i.e.
    ``max_in_flight`` + 2 intervals at the rate the server answered.
    """
    dep = supervised.dep
    dag_id, case = "supervised_server_retry", "server-task-killed"
    run_id, marker = supervised.trigger(dag_id, case)
    tree = supervised.wait_for_engine(marker)
    deadline, first_answer = time.monotonic() + RUN_TIMEOUT_S, None
    while (answered := _server_answered(tree)) < N_SERVER // 2:
        if first_answer is None and answered:
            first_answer = time.monotonic()
        if time.monotonic() > deadline:
            pytest.fail(
                f"the server answered only {answered} in {RUN_TIMEOUT_S}s\n{supervised.diagnose(dag_id, run_id)}"
            )
        time.sleep(0.05)
    os.kill(tree.task_runner, signal.SIGKILL)
    rate = answered / max(time.monotonic() - (first_answer or time.monotonic()), 1.0)

    state = dep.wait_for_run(dag_id, run_id, RUN_TIMEOUT_S)
    ti = dep.task_instance(dag_id, run_id, TASK_ID)
    assert (state, ti["state"], ti["try_number"]) == ("success", "success", 2), supervised.diagnose(
        dag_id, run_id
    )
    second = supervised.log(dag_id, run_id, 2)
    resumed = re.search(r"(\d+) answered by earlier tries' checkpoints", second)
    sent = re.search(r"Server engine done: (\d+) requests sent", second)
    assert resumed, second[-3000:]
    assert sent, second[-3000:]
    assert int(sent.group(1)) + int(resumed.group(1)) == N_SERVER
    custom_ids, _ = supervised.output(case)
    assert sorted(custom_ids) == sorted(f"r{i}" for i in range(N_SERVER))
    twice = answered - int(resumed.group(1))
    bound = 32 + 2 * SERVER_CHECKPOINT_S * rate
    print(
        f"task killed at {answered:.0f} answered ({rate:.0f}/s): try 2 resumed {resumed.group(1)} and sent {sent.group(1)}; answered twice {twice:.0f}, bound {bound:.0f}"
    )
    assert 0 <= twice <= bound


def test_every_process_started_for_the_deployment_is_gone_after_teardown(supervised):
    """Runs last: every process of the deployment, with all descendants, is stopped and gone."""
    leftover = supervised.dep.stop()
    assert leftover == []
    assert all(proc.poll() is not None for proc in supervised.dep.processes.values())
    supervised.s3.stop()
    assert not supervised.s3.running
