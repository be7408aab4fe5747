"""The engines that answer a batch's requests, behind one interface (:class:`~.base.Engine`), and their options.

The operator's ``engine=`` takes an engine's options (:mod:`~.options`): :class:`VLLMRunner`
(the default) is vLLM's offline batch runner (:class:`~.runner.RunnerEngine`);
:class:`VLLMServer` its OpenAI-compatible server started by the task
(:class:`~.server.ServerEngine`); :class:`WarmVLLMServer` a warm one behind a ``vllm``
connection (:class:`~.server.ConnectionEngine`). Another engine (an OpenAI-compatible
gateway, vLLM 0.33's incremental runner) is a subclass of :class:`~.base.Engine` with a
subclass of :class:`EngineOptions` naming it; the operator, the settings and the run
layer need no change (see ``docs/contributing/architecture.md``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_vllm_batch.engines.base import Engine, EngineJob, EngineResults
from airflow_vllm_batch.engines.options import (
    EngineOptions,
    VLLMRunner,
    VLLMServer,
    WarmVLLMServer,
    YieldToInteractive,
)

if TYPE_CHECKING:
    from airflow_vllm_batch.engines.base import EngineSettings
    from airflow_vllm_batch.log_groups import TaskLog


def make_engine(settings: EngineSettings, log: TaskLog) -> Engine:
    """The engine the settings' options name."""
    engine = settings.engine.engine_class()(settings, log)
    assert isinstance(engine, Engine)  # engine_path names an Engine subclass
    return engine


__all__ = [
    "Engine",
    "EngineJob",
    "EngineOptions",
    "EngineResults",
    "VLLMRunner",
    "VLLMServer",
    "WarmVLLMServer",
    "YieldToInteractive",
    "make_engine",
]
