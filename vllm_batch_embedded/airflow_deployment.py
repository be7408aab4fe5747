"""A real Airflow deployment on loopback, and how to drive it: ``make demo-api`` and the integration tests.

``airflow api-server``, ``airflow scheduler`` and ``airflow dag-processor`` run as
separate processes on 127.0.0.1, with a throw-away ``AIRFLOW_HOME`` and SQLite (or a
throw-away PostgreSQL, ``tests/integration/postgres.py``, where a test needs concurrent
writers), each in a session of its own so that :meth:`Deployment.stop` can stop it with
every descendant (LocalExecutor workers, task supervisors, task runners, engines) and
report any PID that survived. It is talked to only as a user would: the REST API
(``/api/v2``, a JWT from ``POST /auth/token``) and the task log files.

:func:`local_executor_deployment` starts a LocalExecutor deployment (the executor's
workers are children of the scheduler, each task runs under Airflow's real supervisor);
:func:`celery_executor_deployment` a CeleryExecutor one (Redis as broker and result backend,
``airflow celery worker`` processes, each in a process group of its own: see
:func:`start_celery_worker`). Both are made of the same pieces (:class:`Deployment`,
:func:`deployment_env`, :func:`wait_until`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from vllm_batch_embedded.demo import REPO, embedded_env
from vllm_batch_embedded.seaweedfs import SeaweedFS, _free_ports

REPO_DAGS = REPO / "dags"
#: What the example DAGs import from their own folder (their settings), and what keeps it unparsed.
DAG_FOLDER_SUPPORT = ("vllm_batch_examples.py", ".airflowignore")

LOOPBACK = "127.0.0.1"
#: The states in which a DAG run or a task instance has ended.
RUN_DONE = ("success", "failed")


class DeploymentError(RuntimeError):
    """A deployment process died, or the deployment did not reach a state in time."""


def rest_request(
    base_url: str,
    method: str,
    path: str,
    body: dict | None = None,
    token: str | None = None,
    timeout: float = 30,
) -> Any:
    """Call Airflow's REST API at ``base_url`` (loopback); an HTTP error is raised with the body the server sent.

    :param token: a JWT from ``/auth/token``, sent as the bearer token.
    :return: the decoded JSON answer (None for an empty one).
    """
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base_url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:  # loopback only
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:2000]
        raise urllib.error.HTTPError(
            err.url, err.code, f"{err.reason}: {detail}", err.headers, None
        ) from None


@dataclass
class Deployment:
    """The processes of one Airflow deployment, and how to talk to it.

    :param home: its ``AIRFLOW_HOME`` (logs of every process are written there too).
    :param api_url: ``http://127.0.0.1:<port>``.
    :param env: the environment every process was started with.
    """

    home: Path
    api_url: str
    env: dict[str, str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    token: str | None = None
    stopped: bool = False

    # -- processes -------------------------------------------------------------------

    def start(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start one process of the deployment, its output in ``<home>/<name>.log``.

        :param env: its environment, when not the deployment's (a process that is not Airflow's).
        """
        log = open(self.home / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        # Its own session: stop() signals the whole group (executor workers, task supervisors).
        proc = subprocess.Popen(
            argv,
            env=self.env if env is None else dict(env),
            cwd=self.home,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.processes[name] = proc
        return proc

    def migrate_db(self) -> None:
        """Create the metadata database (``airflow db migrate``); a failure is raised with its output."""
        airflow = str(Path(sys.executable).with_name("airflow"))
        done = subprocess.run(
            [airflow, "db", "migrate"],
            env=self.env,
            cwd=self.home,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise DeploymentError(
                f"airflow db migrate exited with code {done.returncode}:\n{done.stderr[-3000:]}"
            )

    def log(self, name: str) -> str:
        """The output of process ``name`` so far."""
        return (self.home / f"{name}.log").read_text(errors="replace")

    def check_alive(self) -> None:
        """Raise, with its log, when a process of the deployment has exited."""
        if self.stopped:
            return
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                raise DeploymentError(f"{name} exited with code {proc.returncode}:\n{self.log(name)[-3000:]}")

    def descendants(self, name: str) -> list[psutil.Process]:
        """The live descendants of process ``name`` (for the scheduler: executor workers and tasks)."""
        try:
            return psutil.Process(self.processes[name].pid).children(recursive=True)
        except psutil.Error:
            return []

    def stop(self, grace_s: float = 20) -> list[int]:
        """Stop every process started here, with all their descendants; return the PIDs still alive (none, normally)."""
        if self.stopped:
            return []
        self.stopped = True
        tracked: list[psutil.Process] = []
        for proc in self.processes.values():
            try:
                leader = psutil.Process(proc.pid)
                # Engines run in sessions of their own (the operator's doing): collect them too.
                tracked += [leader, *leader.children(recursive=True)]
            except psutil.Error:
                pass
        for proc in self.processes.values():
            if proc.poll() is None:
                signal_group(proc.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(tracked, timeout=grace_s)
        for process in alive:
            # psutil.Process.kill() refuses a PID that was reused by someone else's process.
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=10)
        for proc in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        return [p.pid for p in tracked if is_alive(p)]

    # -- REST API --------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 30) -> Any:
        """Call the REST API (:func:`rest_request`) with the deployment's token."""
        return rest_request(self.api_url, method, path, body, self.token, timeout)

    def log_in(self, username: str = "admin") -> None:
        """Get a JWT from ``/auth/token`` with the simple auth manager's generated password."""
        password = json.loads((self.home / "passwords.json").read_text())[username]
        self.token = self.request("POST", "/auth/token", {"username": username, "password": password})[
            "access_token"
        ]

    def wait_for_dag(self, dag_id: str, timeout: float = 180) -> None:
        """Wait until the DAG processor has parsed ``dag_id``, then unpause it."""
        wait_until(
            f"the DAG processor to parse {dag_id}",
            lambda: self.request("GET", f"/api/v2/dags/{dag_id}"),
            timeout,
            self,
            interval=1,
        )
        self.request("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})

    def trigger(
        self,
        dag_id: str,
        conf: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        timeout: float = 30,
    ) -> str:
        """Trigger a DAG run through the REST API; return its run id.

        :param run_id: the run's id (Airflow makes one when None); with one, a trigger whose
            answer was lost can be sent again: a 409 then says the run exists.
        """
        body: dict[str, Any] = {"logical_date": None, "conf": dict(conf or {})}
        if run_id is not None:
            body["dag_run_id"] = run_id
        run = self.request("POST", f"/api/v2/dags/{dag_id}/dagRuns", body, timeout=timeout)
        return run["dag_run_id"]

    @staticmethod
    def run_path(dag_id: str, run_id: str) -> str:
        return f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}"

    def dag_run(self, dag_id: str, run_id: str) -> dict:
        return self.request("GET", self.run_path(dag_id, run_id))

    def task_instance(self, dag_id: str, run_id: str, task_id: str) -> dict:
        return self.request("GET", f"{self.run_path(dag_id, run_id)}/taskInstances/{task_id}")

    def task_tries(self, dag_id: str, run_id: str, task_id: str) -> list[dict]:
        """Every try of a task instance (``/tries``): try number, state, start and end."""
        return self.request("GET", f"{self.run_path(dag_id, run_id)}/taskInstances/{task_id}/tries")[
            "task_instances"
        ]

    def set_task_state(self, dag_id: str, run_id: str, task_id: str, state: str) -> Any:
        """What "mark failed" (or success) in the UI does: ``PATCH .../taskInstances/{task_id}``."""
        return self.request(
            "PATCH", f"{self.run_path(dag_id, run_id)}/taskInstances/{task_id}", {"new_state": state}
        )

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float) -> str:
        """Wait until the DAG run has ended; return its state."""

        def ended():
            state = self.dag_run(dag_id, run_id)["state"]
            return state if state in RUN_DONE else None

        return wait_until(f"DAG run {dag_id} {run_id} to end", ended, timeout, self, interval=1)

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        """The log of one try, from the deployment's log folder (JSON lines, one event each)."""
        path = (
            self.home
            / "logs"
            / f"dag_id={dag_id}"
            / f"run_id={run_id}"
            / f"task_id={task_id}"
            / f"attempt={try_number}.log"
        )
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def diagnose(
        self,
        dag_id: str | None = None,
        run_id: str | None = None,
        task_id: str | None = None,
        tail: int = 4000,
    ) -> str:
        """The tails of the scheduler's log and, given a run, of every try's task log."""
        parts = [
            f"--- {name} ---\n{self.log(name)[-tail:]}" for name in ("scheduler",) if name in self.processes
        ]
        if dag_id and run_id and task_id:
            parts.extend(
                f"--- {dag_id} {run_id} {task_id} try {attempt} ---\n{text[-tail:]}"
                for attempt in (1, 2, 3)
                if (text := self.task_log(dag_id, run_id, task_id, attempt))
            )
        return "\n".join(parts)


def signal_group(pgid: int, sig: int) -> None:
    """Signal a process group; one that is gone already is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def is_alive(process: psutil.Process) -> bool:
    """Whether a process is running (a zombie is not)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_until(
    what: str,
    check: Callable[[], Any],
    timeout: float,
    deployment: Deployment | None = None,
    interval: float = 1.0,
) -> Any:
    """Call ``check`` until it returns something true; raise after ``timeout`` seconds.

    The deployment's processes are checked alive on each round, so a crash fails at once
    with its log instead of a time-out.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if deployment is not None:
            deployment.check_alive()
        try:
            result = check()
            if result:
                return result
        except (urllib.error.URLError, ConnectionError, OSError, KeyError, ValueError) as err:
            last = err
        time.sleep(interval)
    raise DeploymentError(f"Timed out after {timeout:.0f}s waiting for {what} (last error: {last})")


def deployment_env(
    s3: SeaweedFS,
    tiny_model: Path,
    home: Path,
    dags: Path,
    api_port: int,
    executor: str,
    database_url: str | None = None,
) -> dict[str, str]:
    """The environment of every process of a deployment: Airflow on loopback, S3 and vLLM embedded.

    Writes ``<home>/passwords.json`` (user ``admin``, a random password).

    :param database_url: Airflow's metadata database (see ``tests/integration/postgres.py``). Default: SQLite
        in ``home``.
    """
    (home / "passwords.json").write_text(json.dumps({"admin": secrets.token_urlsafe(16)}))
    env = embedded_env(s3, tiny_model, home, database_url=database_url)
    env.update(
        {
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__EXECUTOR": executor,
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://{LOOPBACK}:{api_port}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
            "AIRFLOW__API__HOST": LOOPBACK,
            "AIRFLOW__API__PORT": str(api_port),
            "AIRFLOW__API__BASE_URL": f"http://{LOOPBACK}:{api_port}",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            # The test's own Airflow home must not leak in from pytest's process.
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def dags_folder(home: Path, dag_files: Mapping[str, str]) -> Path:
    """A deployment's DAGs folder: only ``dag_files`` (name -> source), with the example DAGs' settings beside them.

    The example DAGs import their settings from their own folder, as Airflow puts it on
    ``sys.path``; a folder holding a DAG without them fails to parse ("No module named
    'vllm_batch_examples'").
    """
    dags = home / "dags"
    dags.mkdir()
    for name, source in dag_files.items():
        (dags / name).write_text(source)
    for name in DAG_FOLDER_SUPPORT:
        (dags / name).write_bytes((REPO_DAGS / name).read_bytes())
    return dags


def _start_airflow(dep: Deployment, api_port: int) -> None:
    """Start the api-server, the scheduler and the dag-processor of ``dep``."""
    airflow = str(Path(sys.executable).with_name("airflow"))
    dep.start(
        "api-server",
        [airflow, "api-server", "--host", LOOPBACK, "--port", str(api_port), "--workers", "1"],
    )
    dep.start("scheduler", [airflow, "scheduler"])
    dep.start("dag-processor", [airflow, "dag-processor"])


@contextlib.contextmanager
def local_executor_deployment(
    s3: SeaweedFS,
    tiny_model: Path,
    home: Path,
    dag_files: Mapping[str, str],
    extra_env: Mapping[str, str] | None = None,
    database_url: str | None = None,
) -> Iterator[Deployment]:
    """Run api-server, scheduler (LocalExecutor) and dag-processor on loopback; stop them all at the end.

    :param s3: the SeaweedFS behind connection ``aws_default``.
    :param tiny_model: the tiny chat model's directory.
    :param home: an empty directory: ``AIRFLOW_HOME``, SQLite database, logs, DAGs folder.
    :param dag_files: file name -> source of the DAG files to write into the DAGs folder
        (only these: the repo's example DAGs, a ``@daily`` one among them, would start
        runs of their own).
    :param extra_env: more environment variables for every process.
    :param database_url: Airflow's metadata database; default SQLite in ``home``.
    """
    dags = dags_folder(home, dag_files)
    (api_port,) = _free_ports(1)
    env = deployment_env(s3, tiny_model, home, dags, api_port, "LocalExecutor", database_url)
    env.update(extra_env or {})
    dep = Deployment(home=home, api_url=f"http://{LOOPBACK}:{api_port}", env=env)
    dep.migrate_db()
    try:
        _start_airflow(dep, api_port)
        wait_until("the API server", lambda: dep.request("GET", "/api/v2/monitor/health"), 180, dep)
        dep.log_in()
        yield dep
    finally:
        dep.stop()


# -- CeleryExecutor ----------------------------------------------------------------------


def celery_env(redis_port: int, concurrency: int = 1) -> dict[str, str]:
    """The ``[celery]`` settings of a deployment whose broker and result backend is one Redis on loopback.

    :param redis_port: the Redis server's port (database 0 is the broker, 1 the result backend).
    :param concurrency: tasks each worker runs at once (``worker_concurrency``).
    """
    return {
        "AIRFLOW__CELERY__BROKER_URL": f"redis://{LOOPBACK}:{redis_port}/0",
        "AIRFLOW__CELERY__RESULT_BACKEND": f"redis://{LOOPBACK}:{redis_port}/1",
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(concurrency),
    }


def start_redis(dep: Deployment, port: int) -> subprocess.Popen:
    """Start Redis (the Celery broker) as process ``redis`` of ``dep``: loopback only, nothing saved to disk.

    It is stopped with the deployment's other processes (:meth:`Deployment.stop`), and its
    queues, kept only in memory, go with it.
    """
    redis = shutil.which("redis-server")
    if redis is None:
        raise DeploymentError(
            "redis-server is not installed: `make system-deps` installs it (apt-get install redis-server)."
        )
    argv = [redis, "--bind", LOOPBACK, "--port", str(port), "--save", "", "--appendonly", "no"]
    # Not an Airflow process: none of what the deployment preloads into Airflow's (the chaos
    # campaign's libfaketime, which Redis does not survive: "Cannot recover from unexpected
    # recursive calls to clock_gettime()"). A broker is another machine, on its own clock.
    env = {k: v for k, v in dep.env.items() if k != "LD_PRELOAD" and not k.startswith("FAKETIME")}
    return dep.start("redis", [*argv, "--dir", str(dep.home)], env=env)


def start_celery_worker(
    dep: Deployment, name: str, queue: str = "default", concurrency: int = 1, wait_s: float | None = None
) -> subprocess.Popen:
    """Start ``airflow celery worker`` as process ``worker-<name>`` of ``dep``, with hostname ``<name>@<host>``.

    Each worker is a process group of its own (:meth:`Deployment.start`): its pool processes,
    the task supervisors they run and the tasks under those go with it when the group is signalled.

    :param queue: the Celery queue it consumes.
    :param concurrency: tasks it runs at once (``--concurrency``).
    :param wait_s: wait this long for it to say it is ready (new output of its log); None: do not wait.
    """
    airflow = str(Path(sys.executable).with_name("airflow"))
    log = dep.home / f"worker-{name}.log"
    # A worker started again appends to the same log: only what this one writes counts.
    written = log.stat().st_size if log.exists() else 0
    # --skip-serve-logs: several workers on one host would all bind the log server's port.
    proc = dep.start(
        f"worker-{name}",
        [
            airflow,
            "celery",
            "worker",
            "-q",
            queue,
            "-c",
            str(concurrency),
            "-H",
            f"{name}@%h",
            "--skip-serve-logs",
        ],
    )
    if wait_s is not None:
        wait_until(
            f"Celery worker {name}",
            lambda: " ready." in dep.log(f"worker-{name}")[written:],
            wait_s,
            dep,
        )
    return proc


@contextlib.contextmanager
def celery_executor_deployment(
    s3: SeaweedFS,
    tiny_model: Path,
    home: Path,
    dag_files: Mapping[str, str],
    workers: Mapping[str, str],
    extra_env: Mapping[str, str] | None = None,
    concurrency: int = 1,
) -> Iterator[Deployment]:
    """Run Redis, api-server, scheduler (CeleryExecutor), dag-processor and Celery workers on loopback; stop them all at the end.

    Airflow 3 runs the CeleryExecutor on SQLite: the workers reach the database only through
    the API server's execution API.

    :param s3: the SeaweedFS behind connection ``aws_default``.
    :param tiny_model: the tiny chat model's directory.
    :param home: an empty directory: ``AIRFLOW_HOME``, SQLite database, logs, DAGs folder.
    :param dag_files: file name -> source of the DAG files to write into the DAGs folder (only these).
    :param workers: worker name -> the queue it consumes; each is process ``worker-<name>``
        (:func:`start_celery_worker`), started at once (not waited for).
    :param extra_env: more environment variables for every process.
    :param concurrency: tasks each worker runs at once.
    """
    dags = dags_folder(home, dag_files)
    redis_port, api_port = _free_ports(2)
    env = deployment_env(s3, tiny_model, home, dags, api_port, "CeleryExecutor")
    env.update(celery_env(redis_port, concurrency))
    env.update(extra_env or {})
    dep = Deployment(home=home, api_url=f"http://{LOOPBACK}:{api_port}", env=env)
    dep.migrate_db()
    try:
        start_redis(dep, redis_port)
        _start_airflow(dep, api_port)
        for name, queue in workers.items():
            start_celery_worker(dep, name, queue, concurrency)
        wait_until("the API server", lambda: dep.request("GET", "/api/v2/monitor/health"), 180, dep)
        dep.log_in()
        yield dep
    finally:
        dep.stop()
