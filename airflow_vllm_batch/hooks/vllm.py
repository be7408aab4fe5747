"""The provider's Airflow hooks: a vLLM server (:class:`VLLMServerHook`) and vLLM's batch runner (:class:`VLLMEngineHook`).

:class:`VLLMServerHook` talks to a running vLLM OpenAI-compatible server: a warm one on a
GPU node or a load-balanced deployment, reached through an Airflow connection of type
``vllm`` (host, port, scheme, the API key as password), or one the task started itself
(:class:`~airflow_vllm_batch.engines.vllm.server_process.VLLMServerProcess`), built from
its URL and key. Requests themselves go through :func:`airflow_vllm_batch.serving.run_stream`,
given the hook's ``base_url`` and ``api_key``.

:class:`VLLMEngineHook` is to vLLM what Airflow's ``SubprocessHook`` is to a shell
command: an argv list (never a shell string), its own process group so that the
whole engine (API frontend and ``EngineCore`` children) can be stopped at once, and
output streamed line by line. It differs in three ways that matter here:

* the engine's life is bound to the task process
  (:mod:`~airflow_vllm_batch.engines.vllm.process`): if the task is SIGKILLed (the OOM
  killer, Airflow's supervisor escalating after SIGTERM), the engine and its children are
  stopped within ``kill_grace_s`` seconds instead of holding the GPU until their next
  write to a closed pipe;

* every line goes through :func:`redact_urls` before it is logged, because vLLM logs
  its input and output URLs in full ("args: ...", "Reading batch from ...",
  "Uploading outputs to ...") and a presigned URL is a bearer credential. The URLs
  are also registered with Airflow's secrets masker by the operator, but vLLM
  sometimes cuts a long URL with "...", which exact-string masking cannot catch;
* the last lines are kept, so that an engine failure can be explained in the
  exception without re-reading the log.
"""

from __future__ import annotations

import collections
import json
import queue
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk.log import mask_secret

from airflow_vllm_batch.batchfile import redact_urls
from airflow_vllm_batch.engines.base import EngineRun
from airflow_vllm_batch.engines.vllm.process import DEFAULT_GRACE_S, reap, signal_group, start_bound_process
from airflow_vllm_batch.exceptions import ModelNotServedError, ServerAuthError, ServerUnavailableError
from airflow_vllm_batch.log_groups import log_engine_line, log_group
from airflow_vllm_batch.redaction import redact_secrets
from airflow_vllm_batch.serving import DEFAULT_MAX_IN_FLIGHT, Journal, StreamStats, run_stream
from airflow_vllm_batch.serving.processes import run_stream_processes
from airflow_vllm_batch.serving.stream import DEFAULT_REQUEST_TIMEOUT_S
from airflow_vllm_batch.version_compat import BaseHook

if TYPE_CHECKING:
    from airflow_vllm_batch.serving.neighbour import NeighbourPlan

#: The line in which vLLM's batch runner says its version at start.
_VERSION_LINE = re.compile(r"vLLM batch processing API version (\S+)")


class VLLMServerHook(BaseHook):
    """Talk to a vLLM OpenAI-compatible server: health, the models it serves.

    Either from an Airflow connection of type ``vllm`` (host, port, schema as the scheme,
    ``http`` by default, password as the API key, and optionally ``{"max_in_flight": N}``
    in extra), or, with ``base_url``, without one.

    :param vllm_conn_id: the connection. Default ``vllm_default``; ignored with ``base_url``.
    :param base_url: the server's root URL, e.g. ``http://127.0.0.1:8000``, instead of a
        connection.
    :param api_key: the server's API key, with ``base_url``. Default: none.
    :param timeout_s: seconds each call to the server may take. Default 30.
    """

    conn_name_attr = "vllm_conn_id"
    default_conn_name = "vllm_default"
    conn_type = "vllm"
    hook_name = "vLLM server"

    def __init__(
        self,
        vllm_conn_id: str = default_conn_name,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.vllm_conn_id = vllm_conn_id
        self._base_url = base_url
        self._api_key = api_key
        self.timeout_s = timeout_s

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """Return the connection form's custom field behaviour."""
        return {
            "hidden_fields": ["login"],
            "relabeling": {"password": "API Key", "schema": "Scheme"},
            "placeholders": {
                "host": "vllm.example.internal (or https://vllm.example.internal)",
                "port": "8000",
                "schema": "http or https (default http)",
                "password": "the server's --api-key; empty if it has none",
                "extra": '{"max_in_flight": 1024}  (the server\'s --max-num-seqs times its replicas)',
            },
        }

    @cached_property
    def base_url(self) -> str:
        """The server's root URL (no trailing ``/`` nor ``/v1``); request URLs such as ``/v1/models`` follow it."""
        return _normalize_base_url(self._base_url or self._url_from_connection())

    @cached_property
    def api_key(self) -> str | None:
        """The API key (registered with the secrets masker), or None when the server has none."""
        key = self._api_key if self._base_url is not None else self.get_connection(self.vllm_conn_id).password
        if key:
            mask_secret(key)
        return key or None

    @cached_property
    def max_in_flight(self) -> int | None:
        """The connection's ``max_in_flight`` extra: how many requests the server takes at once; None when unset.

        A deployment knows its own capacity (``--max-num-seqs`` times its replicas); the
        connection is where to say it, once for every DAG that uses the server.
        """
        if self._base_url is not None:
            return None
        value = self.get_connection(self.vllm_conn_id).extra_dejson.get("max_in_flight")
        return int(value) if value is not None else None

    @cached_property
    def stated_scheduling_policy(self) -> str | None:
        """The connection's ``scheduling_policy`` extra (``"priority"`` or ``"fcfs"``): what its admin says the server runs."""
        if self._base_url is not None:
            return None
        value = self.get_connection(self.vllm_conn_id).extra_dejson.get("scheduling_policy")
        return str(value).strip().lower() if value else None

    def scheduling_policy(self) -> str | None:
        """The scheduler policy the server says it runs (``"priority"``, ``"fcfs"``), or None when it does not say.

        vLLM 0.32 says it only at ``/server_info``, which it serves only in its development mode
        (``VLLM_SERVER_DEV_MODE=1``); neither ``/metrics``, ``/version`` nor ``/v1/models`` hold it.
        """
        try:
            with self._open("/server_info?config_format=json", timeout=self.timeout_s) as response:
                info = json.load(response)
        except (urllib.error.URLError, OSError, ValueError):
            return None
        config = info.get("vllm_config") if isinstance(info, dict) else None
        scheduler = config.get("scheduler_config") if isinstance(config, dict) else None
        policy = scheduler.get("policy") if isinstance(scheduler, dict) else None
        return str(policy).lower() if isinstance(policy, str) and policy else None

    def _url_from_connection(self) -> str:
        conn = self.get_connection(self.vllm_conn_id)
        if not conn.host:
            raise ValueError(
                f"Connection {self.vllm_conn_id!r} has no host; set it to the vLLM server's host name."
            )
        host = conn.host if "://" in conn.host else f"{conn.schema or 'http'}://{conn.host}"
        return f"{host}:{conn.port}" if conn.port else host

    def health(self) -> bool:
        """Return whether ``/health`` answers 200 (the engine is up); False when unreachable."""
        try:
            with self._open("/health", timeout=min(self.timeout_s, 5.0)) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def served_models(self) -> list[str]:
        """Return the ids of the models the server serves (``GET /v1/models``).

        :raises ServerAuthError: the server refused the API key.
        :raises ServerUnavailableError: the server could not be reached.
        """
        return [card["id"] for card in self.model_cards()]

    def model_cards(self) -> list[dict[str, Any]]:
        """Return the server's model cards (``GET /v1/models``): ``id``, ``root``, and ``parent`` for a LoRA adapter.

        :raises ServerAuthError: the server refused the API key.
        :raises ServerUnavailableError: the server could not be reached.
        """
        try:
            with self._open("/v1/models", timeout=self.timeout_s) as response:
                listing = json.load(response)
        except urllib.error.HTTPError as err:
            if err.code in (401, 403):
                raise ServerAuthError(
                    f"The vLLM server at {self.base_url} refused the API key (HTTP {err.code} for /v1/models). "
                    f"Check the password of connection {self.vllm_conn_id!r} (the server's --api-key)."
                ) from None
            raise ServerUnavailableError(f"GET {self.base_url}/v1/models failed: HTTP {err.code}") from None
        except (urllib.error.URLError, OSError) as err:
            raise ServerUnavailableError(
                f"Could not reach the vLLM server at {self.base_url}: {err}"
            ) from None
        return [
            card
            for card in listing.get("data", [])
            if isinstance(card, dict) and isinstance(card.get("id"), str)
        ]

    def check_serves(self, model: str) -> None:
        """Raise unless the server serves ``model``, naming the models it does serve.

        :param model: the model the batch's requests name (their ``body.model``).
        :raises ModelNotServedError: it does not.
        """
        served = self.served_models()
        if model not in served:
            raise ModelNotServedError(
                f"The vLLM server at {self.base_url} does not serve model {model!r}; it serves "
                f"{', '.join(map(repr, served)) or 'no model'}. Set model to one of these, or point the "
                "connection at a server that serves it."
            )

    def version(self) -> str | None:
        """Return the server's vLLM version (``GET /version``), or None when it does not say (a proxy, say)."""
        try:
            with self._open("/version", timeout=self.timeout_s) as response:
                version = json.load(response).get("version")
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return None
        return str(version) if version else None

    def stream_batch(
        self,
        requests: Iterable[tuple[int, bytes]],
        *,
        journal: Journal,
        max_in_flight: int | None = None,
        skip: Callable[[str], bool] | None = None,
        on_progress: Callable[[StreamStats], None] | None = None,
        progress_every_s: float = 15.0,
        processes: int = 1,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        stop: Callable[[], object] | None = None,
        neighbour: NeighbourPlan | None = None,
    ) -> StreamStats:
        """Stream request lines through this server into ``journal``; see :func:`~airflow_vllm_batch.serving.run_stream`.

        :param max_in_flight: most requests in flight (all client processes together).
            Default: the connection's ``max_in_flight`` extra, else serving's default (512).
        :param processes: client processes; more than 1 runs
            :func:`~airflow_vllm_batch.serving.processes.run_stream_processes`. Default 1.
        :param request_timeout_s: seconds one request may take, its retries included (a server
            that answers nothing for this long ends the stream). Default 1800.
        :param stop: asked before each request is sent in this process (see ``run_stream``); with several
            client processes the feed they read from stops instead. Default: never.
        :param neighbour: yield to the server's other users (one client process only). Default None.
        """
        if neighbour is not None and processes > 1:
            raise ValueError("A stream that yields to interactive users runs in one client process.")
        stream = run_stream_processes if processes > 1 else run_stream
        extra: dict[str, Any] = (
            {"processes": processes} if processes > 1 else {"stop": stop, "neighbour": neighbour}
        )
        return stream(
            requests,
            base_url=self.base_url,
            api_key=self.api_key,
            journal=journal,
            max_in_flight=max_in_flight or self.max_in_flight or DEFAULT_MAX_IN_FLIGHT,
            skip=skip,
            on_progress=on_progress,
            progress_every_s=progress_every_s,
            request_timeout_s=request_timeout_s,
            **extra,
        )

    def test_connection(self) -> tuple[bool, str]:
        """Test the connection from the UI: list the served models."""
        try:
            return True, f"Serves: {', '.join(self.served_models())}"
        except Exception as err:  # noqa: BLE001 - the UI shows whatever went wrong, and nothing is raised
            return False, str(err)

    def _open(self, path: str, timeout: float) -> Any:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        request = urllib.request.Request(self.base_url + path, headers=headers)
        return urllib.request.urlopen(request, timeout=timeout)


def _normalize_base_url(url: str) -> str:
    """Strip a trailing ``/`` and ``/v1``: an OpenAI-style base URL names the same server."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"A vLLM server URL must start with http:// or https://, got {redact_urls(url)!r}")
    return url.removesuffix("/v1")


class VLLMEngineHook(BaseHook):
    """Run vLLM's batch runner in its own process group, bound to the task, and stream its log.

    :param kill_grace_s: seconds between SIGTERM and SIGKILL when stopping the engine.
        Default 4: shorter than the ~5 s after which Airflow's supervisor follows its
        SIGTERM of the task with SIGKILL, so ``on_kill`` finishes in the task's time.
    :param tail_lines: how many of the last output lines to keep for error messages.
    :param drain_s: seconds of silence after the leader exited before the rest of its
        group is killed (children that outlive it would hold the log pipe open forever).
    """

    def __init__(
        self, kill_grace_s: float = DEFAULT_GRACE_S, tail_lines: int = 40, drain_s: float = 10.0, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.kill_grace_s = kill_grace_s
        self.drain_s = drain_s
        self.tail_lines = tail_lines
        self.process: subprocess.Popen[bytes] | None = None

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        on_line: Callable[[str], None] | None = None,
        pass_fds: Sequence[int] = (),
        watch: Callable[[str], None] | None = None,
    ) -> EngineRun:
        """Start the engine, stream its output and wait for it to exit.

        The engine is stopped (whole process group) if anything interrupts the wait,
        including Airflow's ``execution_timeout``, so no vLLM process outlives the task.

        :param argv: the command, e.g. from :func:`build_engine_argv`.
        :param env: the engine's full environment. Default: this process's.
        :param on_line: called with every output line, already redacted.
        :param pass_fds: descriptors the engine inherits (a GPU lease's locks).
        :param watch: also called with every output line, already redacted (the runner's stall bound
            reads its progress there). Default: nothing.
        """
        emit = on_line or (lambda line: log_engine_line(self.log, line))
        tail: collections.deque[str] = collections.deque(maxlen=self.tail_lines)
        version = None
        started = time.monotonic()
        # Folded in the UI: a long run's thousands of engine lines must not bury the outcome.
        with log_group(self.log, "vLLM engine output"):
            self.process = start_bound_process(argv, env=env, grace_s=self.kill_grace_s, pass_fds=pass_fds)
            try:
                for raw in self._output_lines(self.process):
                    line = redact_secrets(redact_urls(raw.decode("utf-8", errors="replace").rstrip()))
                    if version is None and (match := _VERSION_LINE.search(line)):
                        version = match.group(1)
                    tail.append(line)
                    if watch is not None:
                        watch(line)
                    emit(line)
                returncode = self.process.wait()
            finally:
                # Reached with a live process only on an interruption (timeout, SIGTERM).
                self.terminate()
        return EngineRun(
            returncode=returncode,
            duration_s=time.monotonic() - started,
            vllm_version=version,
            tail=list(tail),
        )

    def _output_lines(self, process: subprocess.Popen[bytes]) -> Iterator[bytes]:
        """Yield the engine's output lines until its pipe closes, or its leader is gone for good.

        End of file alone is not enough: when the leader dies (OOM-killed, say), its
        ``EngineCore`` child still holds the pipe open and may live on. Once the leader
        has exited and ``drain_s`` seconds passed with no more output, the rest of the
        group is killed, which closes the pipe.
        """
        assert process.stdout is not None
        stdout = process.stdout
        lines: queue.Queue[bytes | None] = queue.Queue()

        def pump() -> None:
            for raw in iter(stdout.readline, b""):
                lines.put(raw)
            lines.put(None)

        threading.Thread(target=pump, name="vllm-engine-output", daemon=True).start()
        quiet_since: float | None = None
        while True:
            try:
                raw = lines.get(timeout=0.5)
            except queue.Empty:
                if process.poll() is None:
                    continue
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > self.drain_s:
                    self.log.warning("The engine's leader exited; stopping what is left of its process group")
                    signal_group(process.pid, signal.SIGKILL)
                continue
            if raw is None:
                return
            quiet_since = None
            yield raw

    def terminate(self) -> None:
        """Stop the engine's whole process group: SIGTERM, then SIGKILL after the grace period.

        Safe to call at any time, from ``on_kill`` too; does nothing when no engine runs.
        """
        proc = self.process
        if proc is None:
            return
        # start_new_session made the engine the leader of its own group: pgid == pid,
        # still valid after the leader exited while EngineCore children live on.
        pgid = proc.pid
        if proc.poll() is None:
            self.log.info("Stopping the vLLM engine (process group %s)", pgid)
            signal_group(pgid, signal.SIGTERM)
            if not reap(proc, timeout=self.kill_grace_s):
                self.log.warning("vLLM engine ignored SIGTERM for %ss; sending SIGKILL", self.kill_grace_s)
        # The leader may be gone while EngineCore children live on: kill the group regardless.
        signal_group(pgid, signal.SIGKILL)
        reap(proc, timeout=self.kill_grace_s)
