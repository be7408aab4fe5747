"""The chaos campaign: the real stack under seeded kills, pauses and S3 faults, and what is really left in S3.

Stands up on this machine what a user runs (the pieces of ``vllm_batch_embedded/airflow_deployment.py``):
SeaweedFS (``weed mini``) as S3, a warm vLLM server (the tiny CPU model), Airflow's
``api-server`` (with the OpenAI plugin), ``scheduler`` (LocalExecutor; with ``--celery`` the
CeleryExecutor, Redis as its broker and two ``airflow celery worker`` processes, each a process
group of its own with its own hostname) and ``dag-processor``, and a fault proxy
(``tests/integration/s3_fault_proxy.py``) between every Airflow process and S3. Then it drives
a workload:

- ``--runs N`` operator DAG runs, their engines in turn: the warm server, the warm server with
  the answer cache, vLLM's batch runner (started by the task), a vLLM server started by the task;
- ``--batches M`` OpenAI API batches from three users through the real API (the ``openai`` SDK),
  on the warm server; some with lines the engine refuses, some cancelled while they run;
- ``--expiring K`` more batches past a short window, created through one more API server
  whose clock is set back (libfaketime) by a day less ``--window-s`` seconds, so that their
  ``24h`` window (the API's shortest is an hour) ends ``--window-s`` seconds after they were
  created, for the deployment (its scheduler, workers and main API server keep their clock:
  the real one, give or take the ``clock_jump`` steps below): half of them first and ten times the size (to expire while they run), the others
  last (to expire queued). They end ``expired`` (or ``completed`` if they finished in time),
  every request they did not answer in their error file as ``batch_expired``;

and, until everything has ended or the fault phase is over, injects faults, each logged with
its time and target; their gaps and kinds drawn from one RNG seeded by ``--seed``, and each
fault's target and amounts from an RNG of its own, seeded by ``--seed`` and its number:

- ``task_kill`` / ``task_stop``: SIGKILL, or SIGSTOP then SIGCONT, of a process under the
  scheduler (executor workers, task supervisors and runners, engines; an idle LocalExecutor
  worker is only paused, never killed: see ``inject``), or with ``--celery`` under either
  Celery worker (pool processes, which are the task supervisors, task runners, engines);
- ``worker_kill`` (``--celery``): SIGKILL of a Celery worker's whole process group, the tasks it
  runs with it; started again at once or after a seeded delay (up to ``WORKER_DOWN_S``);
  ``worker_stop``: SIGSTOP then SIGCONT of the group;
- ``scheduler_kill`` / ``api_kill`` (restarted at once), ``scheduler_stop`` / ``api_stop``;
- ``vllm_kill`` (the warm server, restarted on its port and key) and ``vllm_stop``;
- ``s3_kill`` (SeaweedFS, restarted on its ports and data) and ``s3_stop``;
- ``proxy``: a few seconds during which a share of the S3 calls are delayed, reset, answered
  503 SlowDown or 500, or forwarded with their answer lost (``proxy_<kind>`` counts each one);
- ``clock_jump``: the wall clock of every Airflow process (scheduler, dag-processor, API
  server, and the tasks and engines under them, all under libfaketime) stepped forward or back
  by 20 s to 5 minutes, as NTP steps a host's clock; the total offset stays within 10 minutes
  (SeaweedFS, on the real clock, refuses requests signed 15 minutes off), and the fault-free
  tail sets it back to 0 first. ``--no-clock-jumps``: no libfaketime, no such fault;
- ``scratch_full``: the tasks' scratch disk (their ``results_dir``: a 256 MiB tmpfs the
  campaign mounts, as root) filled for a few seconds, then freed; a try that writes then fails
  with ``ScratchFullError`` (``tries_failed_scratch_full`` counts them from the task logs).
  ``--no-scratch-disk``: no tmpfs, no such fault.

Which request a proxy fault hits, and which process is where, depend on timing: a seed replays
the campaign's schedule (each fault's time, kind and amounts, and its target's draw among the
targets live then), not the machine.

After a fault-free tail every run and batch must end; then the checks read what is really
there (S3 listed and read directly, not through the proxy; Airflow's REST API):

- every input request answered exactly once across the output and error file of every run and
  batch (``answers_lost``, ``duplicates_published``), a run or batch that did not end well counted;
- each manifest's ``output_etag`` / ``error_etag`` are its files' ETags;
- an ended run or batch never changes after it was first seen ended (its files' ETags then and now);
- no object outside the runs' and batches' own keys (the buckets listed);
- no credential (the S3 secret key, the users' API tokens, the vLLM API key, the signing key) in
  any task log;
- every task instance ended, within its bound (``execution_timeout``; 20 minutes more once the clock
  was stepped: the dates are stamped on the stepped clock);
- requests the warm server answered (``vllm:request_success_total`` of each of its lives) against
  answers published through it: ``duplicate_sends``, a cost figure, not a failure.

Once the stack is down, no process it started may be left (Redis, a worker, a killed
scheduler's or worker's orphaned task): one left fails the campaign too.

Prints the fault log, the figures and a final JSON line; exits 1 when a check fails.
Every fault kind the issue names is injected (``not_done`` in the JSON is empty).

``--scenario resume`` replaces the workload and the seeded faults with one targeted fault: one
warm-server run (``--max-requests``, default 4,000, each request's message carrying its
custom_id) behind a counting proxy in front of the warm server; its task runner is SIGKILLed as
soon as the run's staging shows a checkpoint part, and the parts are read at once. After the
retry has published, the checks above run, and one more: no request answered in those parts was
sent again after the kill ("resent durable answers"; the run protocol's Durability). A kill
after the last answer tests no resume: the scenario exits 2 instead of passing.

Usage::

    nice .venv/bin/python benchmarks/chaos.py --smoke --seed 334                # ~2 min on 2 cores
    nice .venv/bin/python benchmarks/chaos.py --seed 1 --runs 14 --batches 16 --max-requests 40 --gap-s 2 --fault-s 1200  # ~10 min
    nice .venv/bin/python benchmarks/chaos.py --celery --seed 5 --runs 16 --batches 18 --max-requests 150 --gap-s 1.0 --fault-s 1200

A deliberately broken build: ``--mutant NAME`` runs every Airflow process of the deployment on
a copy of the package with one mutant of ``tests/simulation/mutation.py`` applied (first on their
``PYTHONPATH``; the worktree is not changed), e.g.::

    nice .venv/bin/python benchmarks/chaos.py --smoke --seed 334 --mutant failed-lines-not-published  # answers lost
    nice .venv/bin/python benchmarks/chaos.py --smoke --seed 7 --mutant skip-set-ignored            # duplicate sends only
    nice .venv/bin/python benchmarks/chaos.py --scenario resume --seed 7 --mutant skip-set-ignored  # resent durable answers

What each reported is in docs/reliability.md ("The checks against a broken build").
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.metadata
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.error
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

import openai
import psutil
from botocore.exceptions import BotoCoreError, ClientError

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from airflow_vllm_batch.engines.vllm import server_process  # noqa: E402
from airflow_vllm_batch.engines.vllm.server_process import VLLMServerProcess  # noqa: E402
from airflow_vllm_batch.exceptions import EngineError  # noqa: E402
from airflow_vllm_batch.openai_api.access import owner_key  # noqa: E402
from airflow_vllm_batch.openai_api.files import result_file_ids  # noqa: E402
from airflow_vllm_batch.openai_api.settings import URL_PREFIX  # noqa: E402
from tests.integration.extra_api_server import (  # noqa: E402
    ExtraApiServer,
    FaketimeUnavailable,
    ResigningS3Proxy,
    faketime_preload,
    start_api_server,
    stop as stop_api_server,
    wait_ready,
)
from tests.integration.restartable_seaweedfs import RestartableSeaweedFS  # noqa: E402
from tests.integration.s3_fault_proxy import (  # noqa: E402
    KINDS as PROXY_KINDS,
    FaultProxy,
)
from tests.integration.vllm_metrics import requests_answered  # noqa: E402
from tests.small_disk import MountError, mounted_tmpfs  # noqa: E402
from vllm_batch_embedded.airflow_deployment import (  # noqa: E402
    Deployment,
    celery_executor_deployment,
    local_executor_deployment,
    signal_group,
    start_celery_worker,
)
from vllm_batch_embedded.demo import CPU_ENGINE_ARGS, CPU_ENGINE_ENV  # noqa: E402
from vllm_batch_embedded.seaweedfs import _free_ports  # noqa: E402
from vllm_batch_embedded.tiny_model import build_tiny_chat_model  # noqa: E402

T = TypeVar("T")

BUCKET = "chaos"
API_BUCKET = "chaos-api"
API_ROOT = "api/"
CACHE_PREFIX = "cache/"
WARM_CONN_ID = "chaos_vllm"
USERS = ("alice", "bob", "carol")
BATCH_DAG_ID = "chaos_openai"
#: The operator runs' DAGs, by engine, in the order runs take them.
RUN_DAGS = ("chaos_warm", "chaos_warm_cache", "chaos_runner", "chaos_started")
#: Retries per task: enough to outlast the campaign's faults. ``task_kill`` picks among processes, so a
#: task-started server's task (its supervisor, runner, server and EngineCore: four targets, for the
#: minute its server takes to start here) draws four times a runner's share: with 6, seed 3 with
#: ``--expiring 4`` (388 faults in 800 s) killed one such run's 7 tries, each before its server was up.
RETRIES = 10
#: The longest wait between two tries (the backoff doubles from 3 s): the tail must see the last ones.
MAX_RETRY_DELAY_S = 120
#: The scheduler's task_instance_heartbeat_timeout: longer than an API-server restart (see _deployment).
HEARTBEAT_TIMEOUT_S = 120
#: A task's bound (its execution_timeout), which the checks hold every try to.
TASK_BOUND_S = 600
ENDED_RUN = ("success", "failed")
ENDED_BATCH = ("completed", "failed", "cancelled", "expired")
PROCESS_FAULTS = (
    "task_kill",
    "task_stop",
    "scheduler_kill",
    "scheduler_stop",
    "api_kill",
    "api_stop",
    "vllm_kill",
    "vllm_stop",
    "s3_kill",
    "s3_stop",
)
#: Relative weights of the fault kinds (a proxy window hits many calls; kills of the
#: warm server cost a 25 s restart on two cores, so they are rarer).
WEIGHTS = {
    "task_kill": 5,
    "task_stop": 3,
    "scheduler_kill": 1,
    "scheduler_stop": 1,
    "api_kill": 1,
    "api_stop": 1,
    "vllm_kill": 1,
    "vllm_stop": 2,
    "s3_kill": 1,
    "s3_stop": 2,
    "proxy": 5,
    # SIGKILL of a task's runner process (the one running the operator, ``airflow worker -- <ti>``),
    # mid-stream if it streams: its retry resumes from its checkpoint parts. Off by default (a
    # zero weight last keeps every recorded seed's draws); ``--fault-weights runner_kill=10``.
    "runner_kill": 0,
    # ``--celery`` only (CELERY_WEIGHTS): SIGKILL of a whole Celery worker's process group (restarted
    # at once or after a seeded delay), or SIGSTOP/SIGCONT of it. Zero and last on the LocalExecutor.
    "worker_kill": 0,
    "worker_stop": 0,
    # A step of the wall clock of every Airflow process (libfaketime; see ``clock_env``), and the
    # tasks' scratch disk (a small tmpfs) filled for a few seconds (see ``scratch_disk``).
    "clock_jump": 2,
    "scratch_full": 2,
}
NOT_DONE: list[str] = []
#: A clock jump moves the wall clock by this many seconds at least and at most (either way) ...
CLOCK_JUMP_S = (20.0, 300.0)
#: ... keeping the total offset within this: SeaweedFS refuses a request signed more than 15
#: minutes off its clock (``RequestTimeTooSkewed``), and the campaign's S3 stays on the real clock.
CLOCK_MAX_OFFSET_S = 600
#: The tasks' scratch disk (their ``results_dir``): a tmpfs this large, which the runs fit in.
SCRATCH_DISK_MIB = 256

#: ``--celery``: the Celery workers (``airflow celery worker -H <name>@<host>``, queue ``default``),
#: each running this many tasks at once; together as many as the deployment's parallelism (4).
CELERY_WORKERS = ("w1", "w2")
CELERY_CONCURRENCY = 2
#: ``--celery``: the worker faults' weights (``--fault-weights`` still overrides them).
CELERY_WEIGHTS = {"worker_kill": 2, "worker_stop": 2}
#: ``--celery``: the longest a killed worker stays down before it is started again (0 to this, seeded).
WORKER_DOWN_S = 90
#: ``--celery``: the scheduler's task_queued_timeout. A message a worker had taken off the broker
#: but not yet started when it was SIGKILLed is never delivered again (unacked in Redis for
#: Airflow's visibility_timeout, a day), so its task stays queued until this: then the scheduler
#: revokes it and schedules it again (twice at most; a third time fails the task). Longer than a
#: task may wait for a slot while a worker is down (WORKER_DOWN_S and its start-up).
CELERY_QUEUED_TIMEOUT_S = 300

DAG_FILE = """
# The chaos campaign's DAGs (benchmarks/chaos.py), written into its deployment's DAGs folder.
from datetime import datetime, timedelta, timezone

from airflow.sdk import DAG

from airflow_vllm_batch.engines import VLLMRunner, VLLMServer, WarmVLLMServer
from airflow_vllm_batch.openai_api.batch_dag import openai_batch_dag
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.run import AnswerCacheOptions

MODEL = {model!r}
CASE = "{{{{ dag_run.conf['case'] }}}}"
COMMON = dict(
    model=MODEL,
    results_dir={results_dir!r},
    retries={retries},
    retry_delay=timedelta(seconds=3),
    # 3, 6, 12, ... 96, then 120 s: the retries outlast a warm server's restart (30 s to 2 minutes here);
    # 3 s apart, seed 2 used a batch's 7 tries up in 20 s against a server that was down for 31.
    retry_exponential_backoff=2.0,
    max_retry_delay=timedelta(seconds={max_delay}),
    execution_timeout=timedelta(seconds={bound}),
    # Lines the engine refuses are answers (in the error file), not a reason to fail the run.
    max_failed_ratio=1.0,
)
ENGINES = {{
    "chaos_warm": (WarmVLLMServer(conn_id={conn!r}, checkpoint_interval=2), None),
    "chaos_warm_cache": (
        WarmVLLMServer(conn_id={conn!r}, checkpoint_interval=2),
        AnswerCacheOptions(uri="s3://{bucket}/{cache}"),
    ),
    "chaos_runner": (VLLMRunner(args=["--enforce-eager"]), None),
    "chaos_started": (VLLMServer(args=["--enforce-eager"], checkpoint_interval=2), None),
}}
for dag_id, (engine, cache) in ENGINES.items():
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc), catchup=False) as dag:
        VLLMBatchOperator(
            task_id="vllm_batch",
            input_uri=f"s3://{bucket}/in/{{CASE}}.jsonl",
            output_uri=f"s3://{bucket}/out/{{CASE}}/results.jsonl",
            engine=engine,
            answer_cache=cache,
            **COMMON,
        )
    globals()[dag_id] = dag

openai_dag = openai_batch_dag(
    model=MODEL,
    dag_id="{batch_dag}",
    engine=WarmVLLMServer(conn_id={conn!r}, checkpoint_interval=2),
    retries={retries},
    retry_delay=timedelta(seconds=3),
    retry_exponential_backoff=2.0,
    max_retry_delay=timedelta(seconds={max_delay}),
    results_dir={results_dir!r},
)
"""


_QUIET = logging.getLogger("chaos.vllm")
_QUIET.setLevel(logging.ERROR)


class CampaignError(RuntimeError):
    """The campaign could not stand up or drive its stack (not a failed check)."""


# -- the warm server ------------------------------------------------------------------------


class WarmServer(VLLMServerProcess):
    """The warm vLLM server, whose API key and port stay the same across its restarts.

    The deployment's ``vllm`` connection names both, and its processes read it from their
    environment, set once: a restarted server must be reachable under the same.

    :param api_key: the key of every life of the server.
    """

    def __init__(self, *args: Any, api_key: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fixed_key = api_key
        #: Requests answered by the server's earlier lives (read before each kill).
        self.answered_before = 0.0

    @property
    def log(self) -> Any:
        # Its start-up lines (and its CPU warnings) would drown the campaign's fault log; errors still show.
        return _QUIET

    def _start_on(self, port: int) -> Any:
        # The module draws a new key per start; this server keeps one.
        fixed = types.SimpleNamespace(token_urlsafe=lambda n=32: self.fixed_key)
        with mock.patch.object(server_process, "secrets", fixed):
            return super()._start_on(port)

    def answered(self) -> float:
        """Requests answered over every life so far (the live one's ``/metrics`` included, when it answers)."""
        assert self.hook is not None
        try:
            return self.answered_before + requests_answered(self.hook.base_url)
        except (urllib.error.URLError, OSError):
            return self.answered_before


# -- the workload ---------------------------------------------------------------------------


def request_lines(model: str, n: int, refused: int, tag: str, *, unique: bool = False) -> bytes:
    """``n`` deterministic chat requests (``<tag>-<i>``), and ``refused`` more the engine refuses (too long an answer asked).

    :param unique: put the custom_id into each request's message, so that a proxy in front of
        the server tells the requests apart (:func:`sent_id`).
    """
    lines = []
    for i in range(n):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Say {i % 12}." + (f" [{tag}-{i}]" if unique else "")}],
            "max_completion_tokens": 4,
            "temperature": 0,
        }
        lines.append(
            {"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    for i in range(refused):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Refuse {i}."}],
            "max_completion_tokens": 100_000,
        }
        lines.append(
            {"custom_id": f"{tag}-refused-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def sent_id(body: bytes) -> str | None:
    """The custom_id a request sent to the server carries in its message (``request_lines(..., unique=True)``), or None."""
    try:
        content = json.loads(body)["messages"][0]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    found = re.search(r"\[([^\]]+)\]$", content) if isinstance(content, str) else None
    return found.group(1) if found else None


@dataclass
class Job:
    """One operator run or API batch, and what the campaign saw of it."""

    kind: str  # the DAG id of a run, or "batch"
    name: str  # the case (run) or the batch id
    custom_ids: list[str]
    dag_id: str
    run_id: str
    output_keys: tuple[str, str, str]  # results, error file, manifest (in ``bucket``)
    bucket: str
    user: str | None = None
    cancel_at: float | None = None
    cancelled: bool = False
    #: Created through the API server whose clock is set back: its window ends ``--window-s`` after it was created.
    expiring: bool = False
    state: str | None = None
    ended_at: float | None = None
    #: The ETags of its files when first seen ended.
    snapshot: dict[str, str | None] = field(default_factory=dict)


@dataclass
class Figures:
    faults: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    #: Batches the API refused with 429 (its per-user cap): owed no answer, not a failure.
    refused: int = 0
    #: Of the batches past their window: how many expired with some answers published, and with none.
    expired_with_answers: int = 0
    expired_without_answers: int = 0
    #: Requests published as ``batch_expired`` (in the expired batches' error files).
    batch_expired_lines: int = 0


class Campaign:
    """One seeded campaign: the stack, the workload, the faults and the checks.

    :param args: the command line.
    :param work: a scratch directory (removed by the caller).
    """

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        #: The workload's draws (sizes, refused lines, cancels) and the fault schedule's (gaps, kinds).
        self.rng = random.Random(args.seed)
        #: The draws of one fault: its target among the live ones, how long, how much. Seeded again
        #: for each fault from the seed and the fault's number (:meth:`run_faults`), so what one
        #: fault finds live (how many processes, none at all) never shifts a later fault's draws.
        self.fault_rng = random.Random(f"{args.seed}-fault")
        self.started = time.monotonic()
        self.figures = Figures()
        self.jobs: list[Job] = []
        self.log_lines: list[str] = []
        self.old_groups: set[int] = set()
        self.seen: dict[int, psutil.Process] = {}
        # Secrets, not draws: no seed tells them.
        self.api_key = "chaos-vllm-key-" + secrets.token_hex(12)
        self.signing_key = "chaos-signing-key-" + secrets.token_hex(16)
        self.tokens: dict[str, str] = {}
        self.clients: dict[str, Any] = {}
        #: The users' SDK clients of the early API server (``--expiring``).
        self.early_clients: dict[str, Any] = {}
        #: ``--scenario resume``: each request the warm server was sent (when, its custom_id), as the counting proxy saw it.
        self.sends: list[tuple[float, str | None]] = []
        self.sends_lock = threading.Lock()
        self.scenario: dict[str, Any] = {}
        #: ``--celery``: workers killed and not started again yet, the timers that start them, and
        #: a lock that keeps a timer's start from racing the stack's teardown.
        self.workers_down: set[str] = set()
        self.worker_timers: list[threading.Timer] = []
        self.worker_lock = threading.Lock()
        self.tearing_down = False
        #: The wall clock's offset of every Airflow process, seconds (``clock_jump``).
        self.clock_offset = 0
        self.clock_file = work / "faketime.rc"
        #: Every API token the campaign was issued (it logs in again after a clock jump).
        self.old_tokens: list[str] = []
        self.log_in_lock = threading.Lock()

    # -- logging -------------------------------------------------------------------------

    def note(self, line: str) -> None:
        stamped = f"[{time.monotonic() - self.started:7.1f}s] {line}"
        self.log_lines.append(stamped)
        print(stamped, flush=True)

    def fault(self, kind: str, target: str) -> None:
        self.figures.faults[kind] += 1
        self.note(f"FAULT {kind} {target}")

    # -- stack ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def stack(self) -> Iterator[None]:
        """SeaweedFS, the proxy, the warm server and the deployment; all stopped at the end."""
        model = build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat")
        self.model = str(model)
        with contextlib.ExitStack() as stack:
            # Last, once everything is stopped: nothing the campaign started may outlive it.
            stack.callback(self._check_left_behind)
            self.s3 = RestartableSeaweedFS(self.work / "s3")
            self.s3.start()
            stack.callback(self.s3.stop)
            for bucket in (BUCKET, API_BUCKET):
                self.s3.create_bucket(bucket)
            host, port = self.s3.endpoint_url.removeprefix("http://").split(":")
            self.proxy = FaultProxy(host, int(port), seed=self.rng.randrange(2**32)).start()
            stack.callback(self.proxy.stop)
            self.results_dir = stack.enter_context(self.scratch_disk())
            (vllm_port,) = _free_ports(1)
            conn_port = vllm_port
            if self.args.scenario == "resume":
                # Every request the tasks send to the warm server passes it and is counted by custom_id.
                self.counter = FaultProxy("127.0.0.1", vllm_port, seed=0, observe=self._observe).start()
                stack.callback(self.counter.stop)
                conn_port = self.counter.port
            self.vllm = WarmServer(
                str(model),
                engine_args=CPU_ENGINE_ARGS.split(),
                env={**os.environ, **CPU_ENGINE_ENV},
                port=vllm_port,
                startup_timeout_s=300,
                api_key=self.api_key,
            )
            # Airflow starts while the server does: both take tens of seconds of the two cores.
            # The server from this thread: it dies with the thread that started it (its
            # parent-death signal is the starting thread's), and it must outlive the start.
            deployment = self._deployment(model, conn_port)
            started: list[Deployment] = []
            errors: list[BaseException] = []

            def start_airflow() -> None:
                try:
                    started.append(deployment.__enter__())
                except BaseException as err:  # noqa: BLE001 - raised again in the main thread
                    errors.append(err)

            airflow = threading.Thread(target=start_airflow, name="airflow-start")
            airflow.start()
            server_error: EngineError | None = None
            try:
                self.vllm.start()
            except EngineError as err:  # a start-up that failed on a loaded machine: no check ran
                server_error = err
            finally:
                airflow.join()
                stack.callback(self.vllm.terminate)
            if started:
                stack.push(deployment.__exit__)
            if errors:
                raise CampaignError(f"the deployment did not start: {errors[0]!r}") from errors[0]
            if server_error is not None:
                raise CampaignError(f"the warm vLLM server did not start: {server_error}") from server_error
            self.dep = started[0]
            stack.callback(self._kill_orphans)
            if self.args.expiring:
                self.early = self._early_api_server(stack)
            stack.callback(self._stop_worker_restarts)
            self.note(
                f"stack up: S3 {self.s3.endpoint_url} behind proxy :{self.proxy.port}, vLLM :{vllm_port}"
                + (f", Celery workers {', '.join(CELERY_WORKERS)}" if self.args.celery else "")
            )
            yield

    def _early_api_server(self, stack: contextlib.ExitStack) -> ExtraApiServer:
        """One more API server of the deployment, its clock a day less ``--window-s`` behind: the expiring batches' way in.

        A batch it creates is signed ``created_at`` its (early) now and ``expires_at`` that plus
        24 h: ``--window-s`` seconds after it was created, by everybody else's clock. Its S3
        calls go through a proxy that signs them again on the real clock (SeaweedFS refuses a
        signature 15 minutes off), around the fault proxy: the faults are the main server's.
        """
        resigning = stack.enter_context(ResigningS3Proxy(self.s3))
        server = start_api_server(
            self.dep,
            "api-server-early",
            {},
            clock_offset_s=-(24 * 3600 - self.args.window_s),
            s3_connection=resigning.connection_json(),
        )
        stack.callback(stop_api_server, server)
        wait_ready(server)
        self.note(f"early API server {server.api_url}: its clock {24 * 3600 - self.args.window_s}s behind")
        return server

    def _observe(self, method: str, path: str, body: bytes) -> None:
        """The counting proxy's hook: one send of the request whose custom_id the body carries."""
        if method == "POST" and path.endswith("/chat/completions"):
            with self.sends_lock:
                self.sends.append((time.monotonic(), sent_id(body)))

    def _deployment(self, model: Path, vllm_port: int) -> contextlib.AbstractContextManager[Deployment]:
        home = self.work / "airflow"
        home.mkdir()
        plugin_shim = "from airflow_vllm_batch.openai_api.plugin import VLLMBatchOpenAIPlugin  # noqa: F401\n"
        (home / "plugins").mkdir()
        if not any(
            ep.value.startswith("airflow_vllm_batch.openai_api.plugin")
            for ep in importlib.metadata.entry_points(group="airflow.plugins")
        ):
            (home / "plugins" / "vllm_batch_openai_api.py").write_text(plugin_shim)
        proxied = json.loads(self.s3.airflow_connection_json())
        proxied["extra"]["endpoint_url"] = f"http://127.0.0.1:{self.proxy.port}"
        dag = DAG_FILE.format(
            model=str(model),
            results_dir=str(self.results_dir),
            retries=RETRIES,
            max_delay=MAX_RETRY_DELAY_S,
            bound=TASK_BOUND_S,
            conn=WARM_CONN_ID,
            bucket=BUCKET,
            cache=CACHE_PREFIX,
            batch_dag=BATCH_DAG_ID,
        )
        env = {
            "AIRFLOW_CONN_AWS_DEFAULT": json.dumps(proxied),
            f"AIRFLOW_CONN_{WARM_CONN_ID.upper()}": json.dumps(
                {"conn_type": "vllm", "host": "127.0.0.1", "port": vllm_port, "password": self.api_key}
            ),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(
                ["admin:admin", *(f"{u}:user" for u in USERS)]
            ),
            "AIRFLOW__VLLM_BATCH__OPENAI_FILES_URI": f"s3://{API_BUCKET}/{API_ROOT}",
            "AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY": self.signing_key,
            "AIRFLOW__VLLM_BATCH__OPENAI_BATCH_DAG_ID": BATCH_DAG_ID,
            # Two cores: a few tasks at once (each may start a vLLM of its own).
            "AIRFLOW__CORE__PARALLELISM": "4",
            # A task whose supervisor was killed is found in 2 minutes, not Airflow's default 5 -- and
            # not sooner: a task heartbeats through the API server, and a try whose heartbeat is
            # older than this is failed by the scheduler ("Detected a task instance without a
            # heartbeat"). With 30 s, every API-server restart (20-50 s here) failed every try
            # running then, and seed 2 ran tasks out of retries (docs/reliability.md).
            # The smoke slice keeps 30 s: its 2-minute tail could not wait out a killed supervisor's
            # 120 s, and it kills no API server (run_faults).
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(
                30 if self.args.smoke else HEARTBEAT_TIMEOUT_S
            ),
            # The supervisor's own side of it: it kills its task after this many failed heartbeats
            # in a row (each one a call retried for up to ~15 s, 5 s apart); Airflow's 3 is about a minute.
            "AIRFLOW__WORKERS__MAX_FAILED_HEARTBEATS": "10",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
            # A scheduler killed leaves its running tasks to the next one, which looks for them
            # only every orphaned_tasks_check_interval (5 minutes by default; the LocalExecutor
            # cannot adopt them, so they are reset and run again).
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "10",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "15",
        }
        # The API's per-user cap on batches not ended (a fair share by default): the campaign's
        # users create their batches all at once, and a refused one would only be counted as refused.
        env["AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_ACTIVE_BATCHES"] = "0"
        env.update(self.clock_env())
        if self.args.mutant:
            # Before the clone, which the embedded default puts on it (vllm_batch_embedded/demo.py).
            env["PYTHONPATH"] = self.mutant_tree()
        if self.args.celery:
            return self._celery_deployment(model, home, dag, env)
        return local_executor_deployment(self.s3, model, home, {"chaos_dags.py": dag}, extra_env=env)

    # -- --celery: the CeleryExecutor and its two workers ------------------------------------

    def _celery_deployment(
        self, model: Path, home: Path, dag: str, env: dict[str, str]
    ) -> contextlib.AbstractContextManager[Deployment]:
        """The same deployment on the CeleryExecutor: Redis, and the workers of CELERY_WORKERS on queue ``default``."""
        env = {**env, "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": str(CELERY_QUEUED_TIMEOUT_S)}
        return celery_executor_deployment(
            self.s3,
            model,
            home,
            {"chaos_dags.py": dag},
            workers=dict.fromkeys(CELERY_WORKERS, "default"),
            extra_env=env,
            concurrency=CELERY_CONCURRENCY,
        )

    def _executor_processes(self) -> list[psutil.Process]:
        """What runs the tasks: the scheduler's descendants (LocalExecutor), or every Celery worker's (``--celery``).

        A Celery worker's descendants are its pool processes (each the supervisor of the task
        it runs), the task runners and the engines they start.
        """
        if not self.args.celery:
            return self.dep.descendants("scheduler")
        return [proc for name in CELERY_WORKERS for proc in self.dep.descendants(f"worker-{name}")]

    def inject_worker(self, kind: str) -> None:
        """``worker_kill``: SIGKILL a live Celery worker's whole group, started again at once or after a seeded delay; ``worker_stop``: pause it.

        The group is the worker, its pool processes and the tasks they run (an engine, in a
        session of its own, dies with its task: its parent-death guard). The tasks that were
        running are failed by the scheduler once their heartbeat is older than its timeout, a
        message taken but not yet started once it has been queued for CELERY_QUEUED_TIMEOUT_S.
        """
        live = [name for name in CELERY_WORKERS if name not in self.workers_down]
        if not live:
            self.note(f"(no live Celery worker for {kind})")
            return
        name = self.pick(live)
        pid = self.dep.processes[f"worker-{name}"].pid
        self.fault(kind, f"Celery worker {name} group {pid}")
        if kind == "worker_stop":
            self.pause(f"Celery worker {name}", pid, group=True)
            return
        delay = 0.0 if self.fault_rng.random() < 0.5 else self.fault_rng.uniform(5, WORKER_DOWN_S)
        self.task_processes()  # remember the group's processes: _kill_orphans makes sure of them at the end
        with self.worker_lock:
            self.workers_down.add(name)
            signal_group(pid, signal.SIGKILL)
            self.old_groups.add(pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.dep.processes[f"worker-{name}"].wait(timeout=30)
        if not delay:
            self._start_worker(name)
            return
        self.note(f"  Celery worker {name} stays down {delay:.0f}s")
        timer = threading.Timer(delay, self._start_worker, (name,))
        timer.daemon = True
        self.worker_timers.append(timer)
        timer.start()

    def _start_worker(self, name: str) -> None:
        """Start Celery worker ``name`` again (same hostname, queue and concurrency), unless the stack is going down."""
        with self.worker_lock:
            if self.tearing_down:
                return
            start_celery_worker(self.dep, name, "default", CELERY_CONCURRENCY)
            self.workers_down.discard(name)
        self.note(f"  Celery worker {name} started again")

    def _stop_worker_restarts(self) -> None:
        """No worker is started again once the teardown begins (a timer still pending would outlive the stack)."""
        with self.worker_lock:
            self.tearing_down = True
        for timer in self.worker_timers:
            timer.cancel()

    def _check_left_behind(self) -> None:
        """Fail the campaign for any process it started that outlived the stack (Redis, a worker, an orphaned task).

        Looked for by process group (every deployment process leads one; the groups of killed
        schedulers, API servers and workers are remembered) and among the processes seen under
        the executor (engines run in sessions of their own).
        """
        groups = set(self.old_groups)
        if hasattr(self, "dep"):
            groups |= {proc.pid for proc in self.dep.processes.values()}
        candidates: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(proc.pid) in groups:
                    candidates[proc.pid] = proc
        for proc in list(self.seen.values()):
            with contextlib.suppress(psutil.Error):
                if proc.is_running():
                    candidates.setdefault(proc.pid, proc)
        _, alive = psutil.wait_procs(list(candidates.values()), timeout=10)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    self.figures.failures.append(
                        f"left behind: pid {proc.pid} {' '.join(proc.cmdline())[:100]}"
                    )

    def mutant_tree(self) -> str:
        """A copy of the package with ``--mutant`` applied, which every process of the deployment imports first.

        It goes first on their ``PYTHONPATH`` (before the editable install's finder, which
        Python asks after ``sys.path``); a process of the deployment's environment is asked
        where it imports the package from, so a mutant that did not take fails the campaign
        instead of passing it for nothing.
        """
        from tests.simulation.mutation import PACKAGE, by_name

        (mutant,) = by_name([self.args.mutant])
        root = self.work / "mutant"
        shutil.copytree(REPO / PACKAGE, root / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
        changed = mutant.apply(root)
        path = os.pathsep.join(p for p in (str(root), str(REPO), os.environ.get("PYTHONPATH")) if p)
        probe = subprocess.run(
            [sys.executable, "-c", "import airflow_vllm_batch; print(airflow_vllm_batch.__file__)"],
            env={**os.environ, "PYTHONPATH": path},
            cwd=self.work,
            capture_output=True,
            text=True,
            check=True,
        )
        if not probe.stdout.strip().startswith(str(root)):
            raise CampaignError(f"--mutant: the deployment would import {probe.stdout.strip()}, not {root}")
        self.note(f"mutant {mutant.name} ({mutant.what}) applied to {changed.relative_to(root)}")
        return path

    # -- the clock (clock_jump) ----------------------------------------------------------

    def clock_env(self) -> dict[str, str]:
        """The environment that puts every Airflow process of the deployment on a wall clock the campaign steps.

        libfaketime (``LD_PRELOAD``; Debian's ``libfaketime`` 0.9.10) reads the offset from
        :attr:`clock_file` (``FAKETIME_TIMESTAMP_FILE``: ``+N`` / ``-N`` seconds), again at most a
        second after it changed (``FAKETIME_CACHE_DURATION``), so the scheduler, the dag-processor,
        the API server and every task process and engine under them see one jump at once, as
        processes on one host do when NTP steps its clock. Only the wall clock moves
        (``FAKETIME_DONT_FAKE_MONOTONIC``): timers and timeouts keep their pace, as in such a step.
        SeaweedFS, the warm vLLM server and the campaign itself stay on the real clock (another
        machine's, which is why S3 needs no re-signing proxy while the offset stays within
        :data:`CLOCK_MAX_OFFSET_S`). An environment variable ``FAKETIME`` would take precedence
        over the file: it must not be set for these processes. Empty with ``--no-clock-jumps``.

        Before libfaketime goes ``benchmarks/monotonic_sleep_fix.c``, compiled here (``cc``,
        :func:`faketime_preload`): without it, libfaketime 0.9.10 fails every ``time.sleep`` of
        Python 3.11 with ``EINVAL`` when the monotonic clock is not faked (see that file).
        """
        if not self.args.clock_jumps:
            return {}
        try:
            preload = faketime_preload(self.work)
        except FaketimeUnavailable as err:
            raise CampaignError(f"{err}, or run with --no-clock-jumps") from None
        self.set_clock(0)
        return {
            "LD_PRELOAD": preload,
            "FAKETIME_TIMESTAMP_FILE": str(self.clock_file),
            "FAKETIME_CACHE_DURATION": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    def set_clock(self, offset: int) -> None:
        """Write the wall clock's offset (seconds) for every process under libfaketime, whole (a rename)."""
        staged = self.clock_file.with_suffix(".tmp")
        staged.write_text(f"{offset:+d}\n")
        os.replace(staged, self.clock_file)
        self.clock_offset = offset

    def clock_jump(self) -> None:
        """Step the wall clock forward or back by a seeded amount, the total offset kept within :data:`CLOCK_MAX_OFFSET_S`."""
        delta = round(self.fault_rng.uniform(*CLOCK_JUMP_S)) * self.fault_rng.choice((1, -1))
        if abs(self.clock_offset + delta) > CLOCK_MAX_OFFSET_S:
            delta = -delta  # back toward the real clock: |offset| <= 600 and |delta| <= 300 keep it within
        before = self.clock_offset
        self.set_clock(before + delta)
        self.fault(
            "clock_jump",
            f"wall clock {delta:+d}s at {time.strftime('%H:%M:%S', time.gmtime())} UTC (real): "
            f"offset {before:+d}s -> {self.clock_offset:+d}s",
        )

    # -- the tasks' scratch disk (scratch_full) ------------------------------------------

    @contextlib.contextmanager
    def scratch_disk(self) -> Iterator[Path]:
        """The tasks' ``results_dir``: a :data:`SCRATCH_DISK_MIB` MiB tmpfs mounted for the campaign, unmounted at its end.

        A real small filesystem, so that ``scratch_full`` fills it as a worker's disk fills up
        (``ENOSPC`` on the tasks' own writes). Mounting needs root: without it the campaign
        refuses to start (``--no-scratch-disk`` runs it on the scratch directory's disk and
        without ``scratch_full``). Unmounted also when the campaign stops on an error or a signal.
        """
        results = self.work / "results"
        results.mkdir()
        if not self.args.scratch_disk:
            yield results
            return
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(mounted_tmpfs(results, SCRATCH_DISK_MIB, mode="0755"))
            except MountError as err:
                raise CampaignError(
                    f"the tasks' scratch disk: mount -t tmpfs on {results} failed ({err}): "
                    "run as root, or with --no-scratch-disk"
                ) from None
            yield results

    def fill_scratch(self) -> None:
        """Fill the tasks' scratch disk with a file for a seeded few seconds, then remove it.

        The filler lies beside the runs' own directory (``airflow-vllm-batch``), never in it: the
        runs own only what they name (invariant: No strangers).
        """
        seconds = self.fault_rng.uniform(2, 10)
        filler = self.results_dir / "chaos-filler"
        written = 0
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for chunk in (b"\0" * (1 << 20), b"\0" * 4096):  # 1 MiB at a time, then the last pages
                try:
                    while True:
                        written += os.write(fd, chunk)
                except OSError as err:
                    if err.errno != errno.ENOSPC:
                        raise
            free = shutil.disk_usage(self.results_dir).free
            self.fault(
                "scratch_full",
                f"{filler} {written / 2**20:.1f} MiB, {free} bytes left, for {seconds:.1f}s",
            )
            time.sleep(seconds)
        finally:
            os.close(fd)
            filler.unlink()
        self.note("  scratch disk freed")

    def _kill_orphans(self) -> None:
        """Processes a killed scheduler left behind (its executor workers and their tasks), and any other seen."""
        for group in self.old_groups:
            signal_group(group, signal.SIGKILL)
        for process in list(self.seen.values()):
            with contextlib.suppress(psutil.Error):
                if process.is_running():
                    process.kill()

    def log_in(self) -> None:
        """Log every user in (again): a token issued at one offset of the clock is not yet valid after a step back."""
        with self.log_in_lock:  # the poller's thread logs in again too
            self._log_in()

    def _log_in(self) -> None:
        self.old_tokens.extend(self.tokens.values())
        self.dep.token = None  # a token not yet valid would be refused with the log-in
        for user in ("admin", *USERS):
            self.dep.log_in(user)
            self.tokens[user] = self.dep.token or ""
            if user != "admin":
                self.clients[user] = openai.OpenAI(
                    base_url=self.dep.api_url + URL_PREFIX, api_key=self.dep.token, max_retries=3, timeout=60
                )
                if self.args.expiring:
                    # Its own token: one the main server issued reads as issued a day ahead there.
                    self.tokens[f"{user}@early"] = token = self.early.token(user)
                    self.early_clients[user] = openai.OpenAI(
                        base_url=self.early.api_url + URL_PREFIX, api_key=token, max_retries=3, timeout=60
                    )
        self.dep.token = self.tokens["admin"]

    # -- workload ------------------------------------------------------------------------

    def submit(self) -> None:
        """Upload the inputs and trigger every run and create every batch (all before the faults)."""
        client = self.s3.client()
        for dag_id in RUN_DAGS:
            self.dep.wait_for_dag(dag_id)
        self.dep.wait_for_dag(BATCH_DAG_ID)
        # Half of the expiring batches first and ten times the size, to expire while they run; the
        # others last, to expire queued behind everything else. Their sizes from an RNG of their own:
        # a seed's other draws stay what they were without them.
        expiring_rng = random.Random(f"{self.args.seed}-expiring")
        running = (self.args.expiring + 1) // 2
        for i in range(running):
            self.create_batch(f"x{i:03d}", USERS[i % len(USERS)], expiring_rng, expiring=True, scale=10)
        kinds = [f"chaos_{engine}" for engine in self.args.engines]
        for i in range(self.args.runs):
            dag_id = kinds[i % len(kinds)]
            case = f"run{i:03d}-{dag_id.removeprefix('chaos_')}"
            n, refused = (
                self.rng.randint(self.args.max_requests // 3, self.args.max_requests),
                self.rng.choice((0, 0, 2)),
            )
            client.put_object(
                Bucket=BUCKET, Key=f"in/{case}.jsonl", Body=request_lines(self.model, n, refused, case)
            )
            ids = [f"{case}-{j}" for j in range(n)] + [f"{case}-refused-{j}" for j in range(refused)]
            run_id = self.trigger(dag_id, case)
            out = f"out/{case}/results"
            self.jobs.append(
                Job(
                    dag_id,
                    case,
                    ids,
                    dag_id,
                    run_id,
                    (f"{out}.jsonl", f"{out}.errors.jsonl", f"{out}.manifest.json"),
                    BUCKET,
                )
            )
            self.note(f"run {case}: {len(ids)} requests ({refused} refused), {dag_id} {run_id}")
        for i in range(self.args.batches):
            self.create_batch(f"b{i:03d}", USERS[i % len(USERS)], self.rng)
        for i in range(running, self.args.expiring):
            self.create_batch(f"x{i:03d}", USERS[i % len(USERS)], expiring_rng, expiring=True)

    def trigger(self, dag_id: str, case: str) -> str:
        """Trigger the run of ``case``, sent again if its answer does not come or is a 5xx (the API server loaded by the tasks).

        With the run id its own, a trigger that went through but whose answer was lost is
        not a second run: sent again, it is refused 409 (the run exists).
        """
        run_id = f"chaos__{case}"
        for attempt in range(3):
            try:
                return self.dep.trigger(dag_id, {"case": case}, run_id=run_id, timeout=120)
            except urllib.error.HTTPError as err:
                if err.code == 409 and attempt:
                    return run_id
                if err.code < 500:
                    raise
                # A 500 from a database insert that failed under load (SQLite's lock, seen on
                # --celery): nothing was made, or the next attempt's 409 says it was.
                self.note(f"trigger {case}: HTTP {err.code}, sending it again")
            except OSError as err:  # a timeout, or the connection dropped
                self.note(f"trigger {case}: {type(err).__name__}, sending it again")
        raise CampaignError(f"the API server did not answer the trigger of {case} three times")

    def create_batch(
        self, tag: str, user: str, rng: random.Random, expiring: bool = False, scale: int = 1
    ) -> None:
        """Upload a batch's input and create it as ``user`` (through the early API server if ``expiring``).

        :param scale: its size's multiple of an ordinary batch's (a third of ``--max-requests`` to all of it).
        """
        n, refused = (
            scale * rng.randint(self.args.max_requests // 3, self.args.max_requests),
            rng.choice((0, 0, 2)),
        )
        sdk = (self.early_clients if expiring else self.clients)[user]
        uploaded = sdk.files.create(
            file=(f"{tag}.jsonl", request_lines(self.model, n, refused, tag)), purpose="batch"
        )
        try:
            batch = sdk.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        except openai.RateLimitError as err:
            # The API's per-user cap refused it (429): nothing was started, so nothing is owed.
            self.figures.refused += 1
            self.note(f"batch {tag} of {user} refused: {err.status_code}")
            return
        # An expiring batch is not cancelled: its window ends it.
        cancel_at = time.monotonic() + rng.uniform(3, 30) if not expiring and rng.random() < 0.3 else None
        out_id, err_id = result_file_ids(batch.id)
        files = f"{API_ROOT}files/{owner_key(user)}/"
        ids = [f"{tag}-{j}" for j in range(n)] + [f"{tag}-refused-{j}" for j in range(refused)]
        self.jobs.append(
            Job(
                "batch",
                batch.id,
                ids,
                BATCH_DAG_ID,
                batch.id,
                (f"{files}{out_id}.jsonl", f"{files}{err_id}.jsonl", f"{files}{out_id}.manifest.json"),
                API_BUCKET,
                user=user,
                cancel_at=cancel_at,
                expiring=expiring,
            )
        )
        self.note(
            f"batch {batch.id} of {user}: {len(ids)} requests ({refused} refused)"
            + (" (to be cancelled)" if cancel_at else "")
            + (f" (expires in {batch.expires_at - time.time():.0f}s)" if expiring else "")
        )

    def poll(self) -> None:
        """Look at every job not seen ended yet (cancel those due); snapshot a job's files when first seen ended."""
        now = time.monotonic()
        self.task_processes()  # remember the tasks' processes: a killed scheduler orphans them
        for job in self.jobs:
            if job.ended_at is not None:
                continue
            try:
                if job.kind == "batch":
                    sdk = self.clients[job.user or ""]
                    if job.cancel_at is not None and now >= job.cancel_at and not job.cancelled:
                        try:
                            sdk.batches.cancel(job.name)
                            self.note(f"cancel {job.name}")
                        except openai.ConflictError:
                            # It ended before the cancel came (409): nothing to cancel, and asking
                            # again every round would hold up the polling of every job after it.
                            self.note(f"cancel {job.name}: it had ended (409)")
                        job.cancelled = True
                    state = sdk.batches.retrieve(job.name).status
                    ended = state in ENDED_BATCH
                else:
                    state = self.dep.dag_run(job.dag_id, job.run_id)["state"]
                    ended = state in ENDED_RUN
            except (OSError, ValueError, openai.APIError) as err:  # the API server down or paused: next round
                code = getattr(err, "code", None) or getattr(err, "status_code", None)
                self.note(f"poll {job.name}: {type(err).__name__}" + (f" {code}" if code else ""))
                if code in (401, 403):
                    # Its tokens were issued ahead of the API server's clock now (a clock jump back).
                    try:
                        self.log_in()
                        self.note("  logged in again")
                    except Exception as again:  # noqa: BLE001 - the next round tries again
                        self.note(f"  log-in failed: {again!r}")
                return
            job.state = state
            if ended:
                try:
                    job.snapshot = self.etags(job)
                except (BotoCoreError, ClientError) as err:  # S3 down or paused: snapshot it next round
                    self.note(f"poll {job.name}: snapshot {type(err).__name__}")
                    return
                job.ended_at = now
                self.note(f"ended {job.name}: {state}")

    @contextlib.contextmanager
    def poller(self) -> Iterator[None]:
        """Poll the jobs every 2 s from a thread of its own, so that slow answers of a loaded API server do not space the faults out."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(2):
                try:
                    self.poll()
                except Exception as err:  # noqa: BLE001 - the poller must outlive any fault
                    self.note(f"poll failed: {err!r}")

        thread = threading.Thread(target=loop, name="chaos-poller", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=120)

    def all_ended(self) -> bool:
        return all(job.ended_at is not None for job in self.jobs)

    # -- faults --------------------------------------------------------------------------

    def task_processes(self) -> list[psutil.Process]:
        """Every live process under the executor (the scheduler, or the Celery workers), or under one killed before, in a stable order (oldest first)."""
        for proc in self._executor_processes():
            self.seen.setdefault(proc.pid, proc)
        procs = []
        for proc in list(self.seen.values()):  # the poller's thread adds to it
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    procs.append((proc.create_time(), proc.pid, proc))
        return [p for _, _, p in sorted(procs)]

    def pause(self, what: str, pgid_or_pid: int, group: bool) -> None:
        """SIGSTOP, a seeded while, SIGCONT."""
        seconds = self.fault_rng.uniform(1, 5)
        send = (
            (lambda sig: signal_group(pgid_or_pid, sig)) if group else (lambda sig: _signal(pgid_or_pid, sig))
        )
        send(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            send(signal.SIGCONT)
        self.note(f"  {what} resumed after {seconds:.1f}s")

    def restart(self, name: str, argv_of: Callable[[], list[str]]) -> None:
        old = self.dep.processes[name]
        with contextlib.suppress(Exception):
            old.wait(timeout=30)
        self.old_groups.add(old.pid)
        self.dep.start(name, argv_of())

    def pick(self, live: Sequence[T]) -> T:
        """One of ``live``, from one draw of the fault's RNG whatever its length (``choice`` draws more bits for a longer list)."""
        return live[int(self.fault_rng.random() * len(live))]

    def inject(self, kind: str) -> None:
        airflow = str(Path(sys.executable).with_name("airflow"))
        if kind in ("task_kill", "task_stop"):
            procs = self.task_processes()
            if kind == "task_kill":
                # Not an idle LocalExecutor worker: the one reading the executor's work queue holds
                # the queue's lock, and a SIGKILL never releases it: every other worker then waits on
                # it forever and the tasks stay queued (Airflow's, seen with seed 2; docs/reliability.md).
                # A worker running a task holds no lock: killing it is the lost-worker fault.
                procs = [p for p in procs if not _idle_local_worker(p)]
            if not procs:
                self.note(f"(no task process for {kind})")
                return
            proc = self.pick(procs)
            with contextlib.suppress(psutil.Error):
                target = f"pid {proc.pid} {' '.join(' '.join(proc.cmdline()[:3]).split())[:80]}"
                self.fault(kind, target)
                if kind == "task_kill":
                    proc.kill()
                else:
                    self.pause(target, proc.pid, group=False)
        elif kind == "runner_kill":
            runners = [p for p in self.task_processes() if _task_runner(p)]
            if not runners:
                self.note("(no task runner for runner_kill)")
                return
            proc = self.pick(runners)
            with contextlib.suppress(psutil.Error):
                self.fault(kind, f"pid {proc.pid} {' '.join(proc.cmdline())[:80]}")
                proc.kill()
        elif kind in ("scheduler_kill", "scheduler_stop"):
            pid = self.dep.processes["scheduler"].pid
            self.fault(kind, f"scheduler pid {pid}")
            if kind == "scheduler_stop":
                self.pause("scheduler", pid, group=False)
                return
            _signal(pid, signal.SIGKILL)
            self.restart("scheduler", lambda: [airflow, "scheduler"])
        elif kind in ("api_kill", "api_stop"):
            pid = self.dep.processes["api-server"].pid
            self.fault(kind, f"api-server group {pid}")
            if kind == "api_stop":
                self.pause("api-server", pid, group=True)
                return
            signal_group(pid, signal.SIGKILL)
            port = self.dep.api_url.rsplit(":", 1)[1]
            self.restart(
                "api-server",
                lambda: [airflow, "api-server", "--host", "127.0.0.1", "--port", port, "--workers", "1"],
            )
            _wait(lambda: self.dep.request("GET", "/api/v2/monitor/health"), 180, "the API server back")
        elif kind in ("vllm_kill", "vllm_stop"):
            assert self.vllm.process is not None
            pid = self.vllm.process.pid
            self.fault(kind, f"warm vLLM server group {pid}")
            if kind == "vllm_stop":
                self.pause("vLLM server", pid, group=True)
                return
            self.vllm.answered_before = self.vllm.answered()
            signal_group(pid, signal.SIGKILL)
            self.vllm.terminate()
            self.vllm.start()
            self.note("  warm vLLM server back")
        elif kind in ("s3_kill", "s3_stop"):
            assert self.s3.pid is not None
            self.fault(kind, f"SeaweedFS group {self.s3.pid}")
            if kind == "s3_stop":
                self.pause("SeaweedFS", self.s3.pid, group=True)
                return
            self.s3.crash()
            self.s3.start()
            self.note("  SeaweedFS back")
        elif kind == "proxy":
            rate = self.fault_rng.uniform(0.05, 0.3)
            kinds = tuple(
                sorted(self.fault_rng.sample(PROXY_KINDS, self.fault_rng.randint(1, len(PROXY_KINDS))))
            )
            seconds = self.fault_rng.uniform(2, 8)
            before = Counter(self.proxy.injected)
            self.proxy.set_faults(rate, kinds)
            time.sleep(seconds)
            self.proxy.set_faults(0.0)
            hit = Counter(self.proxy.injected)
            hit.subtract(before)
            for proxy_kind, count in hit.items():
                if count:
                    self.figures.faults[f"proxy_{proxy_kind}"] += count
            self.note(
                f"FAULT proxy window {seconds:.1f}s rate {rate:.2f} {kinds}: "
                + (", ".join(f"{k} {c}" for k, c in sorted(hit.items()) if c) or "no call hit")
            )
        elif kind in ("worker_kill", "worker_stop"):
            self.inject_worker(kind)
        elif kind == "clock_jump":
            self.clock_jump()
        elif kind == "scratch_full":
            self.fill_scratch()
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

    def run_faults(self) -> None:
        """Inject seeded faults until the fault phase is over or everything has ended."""
        kinds = list(WEIGHTS)
        weights = [self.args.fault_weights.get(k, WEIGHTS[k]) for k in kinds]
        if self.args.smoke:
            # The smoke slice: no warm-server kill (its restart is a quarter of the budget), and no
            # API-server kill: with the slice's 30 s heartbeat timeout its restart fails every try
            # running then, and the 2-minute tail may not outlast their retries (the clean-clone
            # suite at 024565d drew one for seed 7, whose later kinds then depended on the machine:
            # a target's choice drew from the schedule's RNG, by the number of live processes).
            weights[kinds.index("vllm_kill")] = 0
            weights[kinds.index("api_kill")] = 0
            # No clock step either: Airflow's scheduler can mark its own job failed across a step
            # ("Marked 1 SchedulerJob instances as failed") and then resets its own running task
            # every orphan check (10 s here), forever: Job.heartbeat never sets it running again.
            # The clean-clone suite at b386818 saw 13 tries of one task in the 2-minute tail
            # (docs/reliability.md). The full campaign keeps the steps.
            weights[kinds.index("clock_jump")] = 0
        if not self.args.clock_jumps:
            weights[kinds.index("clock_jump")] = 0
        if not self.args.scratch_disk:
            weights[kinds.index("scratch_full")] = 0
        deadline = time.monotonic() + self.args.fault_s
        injected = 0
        while time.monotonic() < deadline and not self.all_ended() and injected < self.args.max_faults:
            time.sleep(self.rng.uniform(self.args.gap_s / 2, self.args.gap_s * 1.5))
            kind = self.rng.choices(kinds, weights)[0]
            self.fault_rng = random.Random(f"{self.args.seed}-fault-{injected}")
            try:
                self.inject(kind)
            except Exception as err:
                raise CampaignError(f"injecting {kind} failed: {err!r}") from err
            injected += 1
        self.proxy.set_faults(0.0)
        if self.clock_offset:
            # The fault-free tail runs on the real clock: one last step, back.
            before = self.clock_offset
            self.set_clock(0)
            self.note(f"clock back to the real one: {-before:+d}s (offset {before:+d}s -> 0)")
            # A token issued while the clock was ahead is not valid yet on the real one, and the
            # checks read Airflow's API once every job has ended (when the poller no longer logs
            # in again): new tokens, once the API server has read the file (FAKETIME_CACHE_DURATION).
            time.sleep(2)
            try:
                self.log_in()
                self.note("  logged in again on the real clock")
            except Exception as err:  # noqa: BLE001 - the poller logs in again on a 401/403
                self.note(f"  log-in on the real clock failed: {err!r}")
        self.note(f"fault phase over ({injected} fault decisions); fault-free tail")

    def tail(self) -> None:
        """Wait, faults off, for every run and batch to end, then for the DAG runs behind the batches.

        A batch reads ended once its task has published its ending; the task may still be
        running in Airflow's database then: its process killed after the publish is a zombie
        until the scheduler fails it (its heartbeat timeout), and its retry finds the ending
        published. :meth:`check_tasks` reads the tasks' states, so the tail waits for those
        runs too; one not ended by the deadline is reported there.
        """
        deadline = time.monotonic() + self.args.tail_s
        while not self.all_ended():
            if time.monotonic() > deadline:
                left = [f"{j.name} ({j.state})" for j in self.jobs if j.ended_at is None]
                self.figures.failures.append(f"not ended after the {self.args.tail_s:.0f}s tail: {left}")
                return
            time.sleep(2)
        batches = [job for job in self.jobs if job.kind == "batch"]
        while batches and time.monotonic() < deadline:
            try:
                batches = [
                    job
                    for job in batches
                    if self.dep.dag_run(job.dag_id, job.run_id)["state"] not in ENDED_RUN
                ]
            except OSError as err:  # the API server slow to answer, or a token not valid yet: again
                self.note(f"tail: {type(err).__name__} reading a batch's DAG run")
                if getattr(err, "code", None) in (401, 403):
                    with contextlib.suppress(Exception):
                        self.log_in()
            if batches:
                time.sleep(2)
        if batches:
            self.note(f"tail: {len(batches)} batches' DAG runs still running at the deadline")

    # -- the resume scenario -------------------------------------------------------------

    def resume_scenario(self) -> None:
        """One warm-server run, its task runner SIGKILLed once a checkpoint part is durable; its retry must not resend the part's answers.

        The run's requests carry their custom_id in their message, and the counting proxy in
        front of the warm server sees every send (:meth:`_observe`). The kill comes when a
        listing of the run's staging (read directly, not through the S3 proxy) shows a part;
        the parts listed once the runner is gone are what any retry resumes from. Checked in
        :meth:`check_resume`.
        """
        client = self.s3.client()
        self.dep.wait_for_dag("chaos_warm")
        case = "resume-warm"
        n = self.args.max_requests
        client.put_object(
            Bucket=BUCKET, Key=f"in/{case}.jsonl", Body=request_lines(self.model, n, 0, case, unique=True)
        )
        run_id = self.dep.trigger("chaos_warm", {"case": case})
        out = f"out/{case}/results"
        job = Job(
            "chaos_warm",
            case,
            [f"{case}-{j}" for j in range(n)],
            "chaos_warm",
            run_id,
            (f"{out}.jsonl", f"{out}.errors.jsonl", f"{out}.manifest.json"),
            BUCKET,
        )
        self.jobs.append(job)
        self.note(f"run {case}: {n} requests, chaos_warm {run_id}")
        staging = f"{out}.jsonl.staging/"

        def parts() -> list[str]:
            listed = client.list_objects_v2(Bucket=BUCKET, Prefix=staging).get("Contents", [])
            return [o["Key"] for o in listed if re.search(r"/parts/part-\d+[^/]*\.jsonl$", o["Key"])]

        deadline = time.monotonic() + 600
        while not parts():  # often: the kill must come while most requests are still unanswered
            if time.monotonic() > deadline:
                raise CampaignError(
                    f"--scenario resume: no checkpoint part under s3://{BUCKET}/{staging} in 600s"
                )
            time.sleep(0.2)
        runners = [p for p in self.task_processes() if _task_runner(p)]
        if len(runners) != 1:
            raise CampaignError(f"--scenario resume: {len(runners)} task runners at the first part, not 1")
        (runner,) = runners
        self.fault("runner_kill", f"pid {runner.pid} {' '.join(runner.cmdline())[:80]} (a part is durable)")
        runner.kill()
        killed_at = time.monotonic()
        with self.sends_lock:
            before = list(self.sends)
        # Read at once: the parts stay until a try publishes, and the retry starts seconds later.
        durable: set[str] = set()
        keys = parts()
        for key in keys:
            durable.update(line["custom_id"] for line in self.read_lines(BUCKET, key))
        self.note(f"  {len(keys)} part(s) durable at the kill, answering {len(durable)} of {n} requests")
        if not durable or len(durable) >= n or self.etags(job)[job.output_keys[2]] is not None:
            # A kill after the last answer (or the publish) tests no resume: the check would pass for nothing.
            raise CampaignError(
                f"--scenario resume: the kill came too late ({len(durable)} of {n} requests answered in parts, "
                f"{len(before)} sent); raise --max-requests (now {n})"
            )
        self.scenario = {
            "case": case,
            "killed_at": killed_at,
            "durable": durable,
            "sent_before_kill": len(before),
            "parts_at_kill": len(keys),
        }

    def check_resume(self) -> dict[str, Any]:
        """What the retry sent after the kill against what a correct resume may send.

        A correct resume sends only requests no durable part answers (plus, late, the dead
        try's own sends that were still in the proxy's socket at the kill: never a request
        answered in a part). A request of a durable part sent again is a resent durable answer.
        """
        durable: set[str] = self.scenario["durable"]
        killed_at: float = self.scenario["killed_at"]
        with self.sends_lock:
            sends = list(self.sends)
        after = [cid for at, cid in sends if at > killed_at]
        unknown = sum(1 for _, cid in sends if cid is None)
        resent = Counter(cid for cid in after if cid in durable)
        job = self.jobs[0]
        allowed = len(job.custom_ids) - len(durable)
        if unknown:
            self.figures.failures.append(f"{unknown} request(s) to the warm server carried no custom_id")
        if resent:
            self.figures.failures.append(
                f"resent durable answers: {len(resent)} of the {len(durable)} requests answered in a checkpoint "
                f"part before the kill were sent again after it ({sum(resent.values())} sends; "
                f"e.g. {sorted(resent)[:5]})"
            )
        tries = len(self.dep.task_tries(job.dag_id, job.run_id, "vllm_batch"))
        if tries < 2:
            self.figures.failures.append(f"{job.name}: {tries} try: the kill did not make a retry")
        return {
            "resume": {
                "requests": len(job.custom_ids),
                "answered_in_parts_at_kill": len(durable),
                "parts_at_kill": self.scenario["parts_at_kill"],
                "sends": len(sends),
                "sends_before_kill": self.scenario["sent_before_kill"],
                "sends_after_kill": len(after),
                "may_send_after_kill": allowed,
                "resent_durable_answers": len(resent),
                "tries": tries,
            }
        }

    # -- checks --------------------------------------------------------------------------

    def etags(self, job: Job) -> dict[str, str | None]:
        client = self.s3.client()
        found: dict[str, str | None] = {}
        for key in job.output_keys:
            try:
                found[key] = client.head_object(Bucket=job.bucket, Key=key)["ETag"].strip('"')
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                    raise
                found[key] = None
        return found

    def read_lines(self, bucket: str, key: str) -> list[dict]:
        client = self.s3.client()
        try:
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
        except client.exceptions.NoSuchKey:
            return []
        return [json.loads(line) for line in body.splitlines() if line.strip()]

    def check(self) -> dict[str, Any]:
        if self.args.clock_jumps:
            # The tokens may be from a clock ahead of the API server's now (the tail set it back).
            def logged_in() -> bool:
                self.log_in()
                return True

            _wait(logged_in, 120, "a log-in for the checks")
        client = self.s3.client()
        fail = self.figures.failures.append
        lost = duplicates = requests = 0
        published_sent = 0  # answers published through the warm server (not from the cache)
        states: Counter[str] = Counter()
        for job in self.jobs:
            requests += len(job.custom_ids)
            states[f"{job.kind}:{job.state}"] += 1
            manifest_key = job.output_keys[2]
            manifest = None
            with contextlib.suppress(client.exceptions.NoSuchKey):
                manifest = json.loads(client.get_object(Bucket=job.bucket, Key=manifest_key)["Body"].read())
            if (manifest is None or "tombstone" in manifest) and job.state == "cancelled":
                # Cancelled before its task started an engine: no answer is owed, and no file may exist.
                left = [key for key, etag in self.etags(job).items() if etag is not None]
                if left:
                    fail(f"{job.name}: cancelled without a manifest, yet {left} exist")
                continue
            if manifest is None or "tombstone" in manifest:
                lost += len(job.custom_ids)
                fail(f"{job.name}: no manifest (state {job.state}): all {len(job.custom_ids)} answers lost")
                continue
            endings = ("success", "completed", "cancelled") + (("expired",) if job.expiring else ())
            if job.state not in endings:
                fail(f"{job.name}: ended {job.state} although it published")
            answered = Counter()
            ok = 0
            for uri_field, etag_field in (("output_uri", "output_etag"), ("error_uri", "error_etag")):
                uri = manifest.get(uri_field)
                if not uri:
                    continue
                bucket, _, key = uri.removeprefix("s3://").partition("/")
                lines = self.read_lines(bucket, key)
                for line in lines:
                    answered[line["custom_id"]] += 1
                    if ((line.get("error") or {}).get("code")) == "batch_expired":
                        self.figures.batch_expired_lines += 1
                    if uri_field == "output_uri" and (line.get("response") or {}).get("status_code") == 200:
                        ok += 1
                try:
                    etag = client.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
                except client.exceptions.ClientError:
                    etag = None
                recorded = (manifest.get(etag_field) or "").strip('"') or None
                if recorded != etag:
                    fail(f"{job.name}: manifest {etag_field} {recorded} but {uri_field}'s ETag is {etag}")
            if job.state == "expired":
                if ok:
                    self.figures.expired_with_answers += 1
                else:
                    self.figures.expired_without_answers += 1
            missing = set(job.custom_ids) - set(answered)
            twice = {cid: n for cid, n in answered.items() if n > 1}
            unknown = set(answered) - set(job.custom_ids)
            lost += len(missing)
            duplicates += sum(n - 1 for n in twice.values())
            if missing:
                fail(f"{job.name}: {len(missing)} requests unanswered: {sorted(missing)[:5]}")
            if twice:
                fail(f"{job.name}: answered more than once: {dict(list(twice.items())[:5])}")
            if unknown:
                fail(f"{job.name}: answers to requests not in its input: {sorted(unknown)[:5]}")
            if job.kind in ("chaos_warm", "chaos_warm_cache", "batch"):
                published_sent += ok - int(manifest.get("from_cache") or 0)
            now = self.etags(job)
            if job.snapshot and now != job.snapshot:
                fail(f"{job.name}: changed after it was seen ended: {job.snapshot} -> {now}")
        self.check_keys()
        self.check_logs()
        self.check_tasks()
        sent = self.vllm.answered()
        return {
            **self.fault_effects(),
            "requests": requests,
            "states": dict(states),
            "answers_lost": lost,
            "duplicates_published": duplicates,
            "warm_server_answered": int(sent),
            "published_through_warm_server": published_sent,
            "duplicate_sends": int(sent) - published_sent,
            "expired_with_answers": self.figures.expired_with_answers,
            "expired_without_answers": self.figures.expired_without_answers,
            "batch_expired_lines": self.figures.batch_expired_lines,
        }

    def fault_effects(self) -> dict[str, int]:
        """What the clock jumps and the full scratch disk did, read from the logs (a figure, not a check).

        ``task_tries``: every try of every task (each logs to a file of its own).
        ``tries_failed_scratch_full``: tries whose log has a ``ScratchFullError``.
        ``heartbeat_timeouts``: the scheduler's reports of a task without a heartbeat (a clock
        jump forward makes a running try look like a zombie). ``tokens_not_yet_valid``: calls
        the API server refused for a token issued later than its clock now says (a step back
        makes every token issued in the last minutes "not yet valid": task heartbeats, state
        updates and XComs of the tries then running, beyond Airflow's 10 s ``jwt_leeway``).
        """
        tries = [path.read_text(errors="replace") for path in (self.dep.home / "logs").rglob("attempt=*.log")]
        zombies = sum(
            path.read_text(errors="replace").count("without a heartbeat")
            for path in self.dep.home.glob("scheduler*.log")
        )
        api_log = self.dep.home / "api-server.log"
        immature = api_log.read_text(errors="replace").count("is not yet valid") if api_log.exists() else 0
        return {
            "task_tries": len(tries),
            "tries_failed_scratch_full": sum(1 for text in tries if "ScratchFullError" in text),
            "heartbeat_timeouts": zombies,
            "tokens_not_yet_valid": immature,
        }

    def check_keys(self) -> None:
        """Every object in the two buckets is an input, a cache entry, or a key of one of the jobs."""
        client = self.s3.client()
        cases = "|".join(re.escape(j.name) for j in self.jobs if j.kind != "batch") or "-"
        hexes = "|".join(j.name.removeprefix("batch_") for j in self.jobs if j.kind == "batch") or "-"
        allowed = {
            BUCKET: re.compile(
                rf"^(in/({cases})\.jsonl|{CACHE_PREFIX}.+|out/({cases})/results\."
                r"(jsonl|errors\.jsonl|manifest\.json|lease\.json|jsonl\.staging/.+|jsonl\.probe-.+))$"
            ),
            API_BUCKET: re.compile(
                rf"^{API_ROOT}(files/[^/]+/file-[0-9a-z]+\.jsonl?|"
                rf"files/[^/]+/file-({hexes})(out|err)\.(jsonl|manifest\.json|lease\.json|jsonl\.staging/.+|jsonl\.probe-.+)|"
                rf"batches/batch_({hexes})\.(json|input\.jsonl|failure\.json|cancel\.json|progress\.json))$"
            ),
        }
        for bucket, pattern in allowed.items():
            paginator = client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=bucket):
                for obj in page.get("Contents", []):
                    if not pattern.match(obj["Key"]):
                        self.figures.failures.append(
                            f"object outside every run's keys: s3://{bucket}/{obj['Key']}"
                        )

    def check_logs(self) -> None:
        """No credential in any task log (nor in the deployment's process logs)."""
        credentials = {
            "the S3 secret key": self.s3.secret_key,
            "the vLLM API key": self.api_key,
            "the OpenAI signing key": self.signing_key,
            **{f"{user}'s API token": token for user, token in self.tokens.items()},
            **{f"an earlier API token ({i})": token for i, token in enumerate(self.old_tokens)},
        }
        logs = list((self.dep.home / "logs").rglob("*.log")) + list(self.dep.home.glob("*.log"))
        for path in logs:
            text = path.read_text(errors="replace")
            for what, value in credentials.items():
                if value and value in text:
                    self.figures.failures.append(f"{what} is in {path.relative_to(self.dep.home)}")

    def check_tasks(self) -> None:
        """Every task instance of every job ended, and every try within its bound."""
        from datetime import datetime

        def when(value: str) -> float:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()

        # The dates are stamped on the stepped wall clock: a try that started at -10 minutes and
        # ended at +10 looks 20 minutes longer than it was (its timeout is a timer, setitimer, not a date).
        slack = 60 + (2 * CLOCK_MAX_OFFSET_S if self.figures.faults["clock_jump"] else 0)
        for job in self.jobs:
            try:
                tis = self.dep.request("GET", f"{self.dep.run_path(job.dag_id, job.run_id)}/taskInstances")[
                    "task_instances"
                ]
            except urllib.error.HTTPError as err:
                self.figures.failures.append(f"{job.name}: task instances unreadable: {err}")
                continue
            for ti in tis:
                if ti["state"] not in ("success", "failed", "skipped", "upstream_failed", "removed"):
                    self.figures.failures.append(f"{job.name}: task {ti['task_id']} is {ti['state']}")
                    continue
                for attempt in self.dep.task_tries(job.dag_id, job.run_id, ti["task_id"]):
                    if attempt.get("start_date") and attempt.get("end_date"):
                        took = when(attempt["end_date"]) - when(attempt["start_date"])
                        # A minute's slack: the bound is the try's own timer, the dates the database's.
                        if took > TASK_BOUND_S + slack:
                            self.figures.failures.append(
                                f"{job.name}: {ti['task_id']} try {attempt['try_number']} took {took:.0f}s"
                            )


def _idle_local_worker(proc: psutil.Process) -> bool:
    """A LocalExecutor worker waiting for work (its process title says ``<idle>``)."""
    with contextlib.suppress(psutil.Error):
        return "LocalExecutor: <idle>" in " ".join(proc.cmdline())
    return False


def _task_runner(proc: psutil.Process) -> bool:
    """The process running a task's operator: Airflow's task runner titles it ``airflow worker -- <ti id>``."""
    with contextlib.suppress(psutil.Error):
        title = " ".join(proc.cmdline())
        return title.startswith("airflow worker -- ") and "LocalExecutor" not in title
    return False


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _wait(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if result := check():
                return result
        time.sleep(1)
    raise CampaignError(f"timed out after {timeout:.0f}s waiting for {what}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seed", type=int, default=1, help="the campaign's seed: every fault decision comes from it"
    )
    parser.add_argument("--runs", type=int, default=None, help="operator DAG runs (default 8; smoke 3)")
    parser.add_argument("--batches", type=int, default=None, help="OpenAI API batches (default 8; smoke 2)")
    parser.add_argument(
        "--engines",
        default=None,
        help="the operator runs' engines, in turn (default warm,warm_cache,runner,started; smoke: the first three)",
    )
    parser.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="requests per run or batch: a third of this to all of it (default 30)",
    )
    parser.add_argument(
        "--expiring",
        type=int,
        default=None,
        help="more batches, created first through an API server whose clock is set back, so that their window "
        "ends --window-s after they were created (default 3; smoke 0)",
    )
    parser.add_argument(
        "--window-s",
        type=int,
        default=20,
        help="seconds from an expiring batch's creation to its expires_at (default 20)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a few faults on a small workload (~3 min on 2 cores)"
    )
    parser.add_argument(
        "--celery",
        action="store_true",
        help="the CeleryExecutor with two workers (Redis as the broker) instead of the LocalExecutor, "
        f"and the worker faults worker_kill and worker_stop (weights {CELERY_WEIGHTS})",
    )
    parser.add_argument(
        "--fault-s", type=float, default=None, help="the fault phase's longest length, seconds"
    )
    parser.add_argument("--gap-s", type=float, default=None, help="mean seconds between two faults")
    parser.add_argument("--max-faults", type=int, default=None, help="fault decisions at most")
    parser.add_argument("--tail-s", type=float, default=None, help="how long the fault-free tail may take")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the scratch directory (every process's and task's log) even when every check passes",
    )
    parser.add_argument(
        "--mutant",
        default=None,
        help="run the deployment on a deliberately broken build: a mutant of tests/simulation/mutation.py "
        "(e.g. skip-set-ignored, failed-lines-not-published) applied to a copy of the package",
    )
    parser.add_argument(
        "--fault-weights",
        default="",
        help=f"KIND=WEIGHT,... over the default weights {WEIGHTS} (e.g. runner_kill=10)",
    )
    parser.add_argument(
        "--clock-jumps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run every Airflow process under libfaketime and inject clock_jump faults (needs Debian's faketime)",
    )
    parser.add_argument(
        "--scratch-disk",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"mount a {SCRATCH_DISK_MIB} MiB tmpfs as the tasks' results_dir (root) and inject scratch_full faults",
    )
    parser.add_argument(
        "--scenario",
        choices=("campaign", "resume"),
        default="campaign",
        help="campaign: the seeded faults above; resume: one warm-server run whose task runner is killed once a "
        "checkpoint part is durable, and a check that its retry sends none of the part's requests again "
        "(counted by a proxy in front of the warm server; --max-requests is its size, default 4000)",
    )
    args = parser.parse_args(argv)
    weights: dict[str, float] = {}
    for item in filter(None, args.fault_weights.split(",")):
        kind, _, value = item.partition("=")
        if kind not in WEIGHTS or not value.replace(".", "", 1).isdigit():
            parser.error(
                f"--fault-weights: {item!r} is not KIND=WEIGHT with KIND one of {', '.join(WEIGHTS)}"
            )
        weights[kind] = float(value)
    if args.celery:
        weights = {**CELERY_WEIGHTS, **weights}
    elif celery_only := sorted(k for k in CELERY_WEIGHTS if weights.get(k)):
        parser.error(
            f"--fault-weights: {', '.join(celery_only)} needs --celery (the LocalExecutor has no Celery worker)"
        )
    args.fault_weights = weights
    if args.mutant:
        from tests.simulation.mutation import by_name

        try:
            by_name([args.mutant])
        except SystemExit as err:
            parser.error(f"--mutant: {err}")
    smoke = args.smoke
    engines = [name.removeprefix("chaos_") for name in RUN_DAGS]
    args.engines = args.engines.split(",") if args.engines else engines[:3] if smoke else engines
    if unknown := set(args.engines) - set(engines):
        parser.error(f"--engines: unknown {sorted(unknown)}; choose among {','.join(engines)}")
    if args.scenario == "resume":
        if args.smoke:
            parser.error("--scenario resume has a workload of its own: leave out --smoke")
        args.runs, args.batches, args.expiring, args.engines = 1, 0, 0, ["warm"]
        args.max_requests = 4000 if args.max_requests is None else args.max_requests
        args.tail_s = 600 if args.tail_s is None else args.tail_s
    args.max_requests = 30 if args.max_requests is None else args.max_requests
    args.runs = args.runs if args.runs is not None else (3 if smoke else 8)
    args.batches = args.batches if args.batches is not None else (2 if smoke else 8)
    args.expiring = args.expiring if args.expiring is not None else (0 if smoke else 3)
    if not 0 < args.window_s < 3600:
        parser.error("--window-s: give seconds between 1 and 3599 (the API's shortest window is an hour)")
    args.fault_s = args.fault_s if args.fault_s is not None else (50 if smoke else 900)
    args.gap_s = args.gap_s if args.gap_s is not None else (1.5 if smoke else 3)
    args.max_faults = args.max_faults if args.max_faults is not None else (8 if smoke else 10_000)
    args.tail_s = args.tail_s if args.tail_s is not None else (120 if smoke else 900)
    # The warm server's start-up lines and the SDK's requests would drown the fault log.
    for name in ("airflow.task.hooks", "httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="vllm-batch-chaos-"))

    def stop(signum: int, _frame: Any) -> None:
        # SIGTERM (and SIGINT, ignored in a shell's background job) stop the stack as an error would.
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    campaign = Campaign(args, work)
    started = time.monotonic()
    try:
        with campaign.stack():
            campaign.log_in()
            if args.scenario == "resume":
                with campaign.poller():
                    campaign.resume_scenario()
                    campaign.tail()
                figures = {**campaign.check(), **campaign.check_resume()}
            else:
                campaign.submit()
                with campaign.poller():
                    campaign.run_faults()
                    campaign.tail()
                figures = campaign.check()
    except CampaignError as err:
        print(f"chaos: {err}", file=sys.stderr)
        return 2
    finally:
        if campaign.figures.failures or args.keep:
            # The task logs and the deployment's logs, to find out why.
            why = "for a failed check" if campaign.figures.failures else "(--keep)"
            print(f"chaos: kept {work} (logs of every process and task) {why}", file=sys.stderr)
        else:
            with contextlib.suppress(OSError):
                shutil.rmtree(work)
    faults = campaign.figures.faults
    result = {
        "seed": args.seed,
        "smoke": smoke,
        "mutant": args.mutant,
        "scenario": args.scenario,
        "executor": "CeleryExecutor" if args.celery else "LocalExecutor",
        "faults": sum(faults.values()),
        "faults_by_kind": dict(sorted(faults.items())),
        "runs": args.runs,
        "batches": args.batches,
        **figures,
        "expiring": args.expiring,
        "batches_refused": campaign.figures.refused,
        "runs_ended": all(job.ended_at is not None for job in campaign.jobs),
        "failures": campaign.figures.failures,
        "not_done": NOT_DONE,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print("\n=== chaos campaign ===")
    print(
        f"seed {args.seed} ({result['executor']}): {args.runs} runs, {args.batches} batches, "
        f"{figures['requests']} requests"
    )
    print(f"faults injected: {result['faults']}")
    for kind, count in result["faults_by_kind"].items():
        print(f"  {kind:16} {count}")
    print(f"answers lost: {figures['answers_lost']}, duplicates published: {figures['duplicates_published']}")
    if args.expiring:
        print(
            f"past their window: {figures['expired_with_answers']} expired with answers, "
            f"{figures['expired_without_answers']} before any; {figures['batch_expired_lines']} requests published batch_expired"
        )
    print(
        f"task tries: {figures['task_tries']}; failed with ScratchFullError: {figures['tries_failed_scratch_full']}; "
        f"tasks without a heartbeat (the scheduler's reports): {figures['heartbeat_timeouts']}; "
        f"API calls refused for a token not yet valid (clock steps back): {figures['tokens_not_yet_valid']}"
    )
    print(
        f"duplicate sends: {figures['duplicate_sends']} (warm server answered {figures['warm_server_answered']}, "
        f"{figures['published_through_warm_server']} published through it)"
    )
    if resume := figures.get("resume"):
        print(
            f"resume: {resume['answered_in_parts_at_kill']} of {resume['requests']} requests answered in "
            f"{resume['parts_at_kill']} part(s) at the kill; {resume['sends_after_kill']} sends after it "
            f"(a correct resume sends at most {resume['may_send_after_kill']}, none of the parts' requests); "
            f"resent durable answers: {resume['resent_durable_answers']}"
        )
    for failure in campaign.figures.failures:
        print(f"CHECK FAILED: {failure}")
    print(f"wall time {result['wall_s']:.0f}s")
    print(json.dumps(result))
    return 1 if campaign.figures.failures else 0


if __name__ == "__main__":
    sys.exit(main())
