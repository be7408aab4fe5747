"""The engines that answer a batch's requests, behind one interface (:class:`~.base.Engine`).

``engine="runner"`` is vLLM's offline batch runner (:class:`~.runner.RunnerEngine`);
``engine="server"`` its OpenAI-compatible server, started by the task
(:class:`~.server.ServerEngine`) or, with ``vllm_conn_id``, warm behind a ``vllm``
connection (:class:`~.server.ConnectionEngine`). Another engine (an OpenAI-compatible
gateway, vLLM 0.33's incremental runner) is a subclass of :class:`~.base.Engine` made
known with :func:`register_engine`; the operator and the run layer need no change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_vllm_batch.engines.base import Engine, EngineJob, EngineResults
from airflow_vllm_batch.exceptions import ConfigurationError

if TYPE_CHECKING:
    import logging

    from airflow_vllm_batch.engines.base import EngineSettings

_ENGINES: dict[str, type[Engine]] = {}


def register_engine(name: str, engine: type[Engine]) -> None:
    """Make ``engine`` available as ``VLLMBatchOperator(engine=name)``."""
    _ENGINES[name] = engine


def engine_class(name: str, *, vllm_conn_id: str | None = None) -> type[Engine]:
    """The engine class for ``engine=name`` (a ``vllm`` connection means the warm-server engine)."""
    _register_builtin()
    if vllm_conn_id:
        from airflow_vllm_batch.engines.server import ConnectionEngine

        return ConnectionEngine
    try:
        return _ENGINES[name]
    except (KeyError, TypeError):
        raise ConfigurationError(f"engine must be one of {tuple(_ENGINES)}, got {name!r}.") from None


def make_engine(settings: EngineSettings, log: logging.Logger) -> Engine:
    """The engine the settings ask for."""
    return engine_class(settings.engine, vllm_conn_id=settings.vllm_conn_id)(settings, log)


def _register_builtin() -> None:
    # Imported on first use: the runner and server modules pull in the process and HTTP machinery.
    if "runner" in _ENGINES:
        return
    from airflow_vllm_batch.engines.runner import RunnerEngine
    from airflow_vllm_batch.engines.server import ServerEngine

    _ENGINES.setdefault("runner", RunnerEngine)
    _ENGINES.setdefault("server", ServerEngine)


__all__ = ["Engine", "EngineJob", "EngineResults", "engine_class", "make_engine", "register_engine"]
