"""Which engine serves a batch: ``[vllm_batch] openai_models`` maps the lines' ``model`` to a warm fleet or the runner.

``openai_models`` is JSON, one entry per served model name::

    {"qwen-1.5b": {"vllm_conn_id": "vllm_qwen"},     # a warm fleet behind a ``vllm`` connection
     "llama-70b": {"queue": "gpu"}}                    # the runner, on workers of the ``gpu`` queue

An entry may also give ``engine_args`` (a list of strings) for the runner. The batch DAG
(:func:`airflow_vllm_batch.openai_api.batch_dag.openai_batch_dag`) has one task per entry
and a ``route`` task that picks it; ``POST /batches`` checks that the file's lines name one
configured model and records which task runs it. Free of Airflow imports but the config read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from airflow_vllm_batch.batchfile.models import RequestBody
from airflow_vllm_batch.engines.options import EngineOptions, VLLMRunner, WarmVLLMServer
from airflow_vllm_batch.exceptions import ConfigurationError

#: The task id of the batch task when no ``openai_models`` are configured; the routes' tasks start with it.
TASK_ID = "vllm_batch"
_KEYS = {"vllm_conn_id", "queue", "engine_args"}


@dataclass(frozen=True)
class ModelRoute:
    """How one served model's batches run.

    :param model: the served name the lines' ``body.model`` give.
    :param vllm_conn_id: a ``vllm`` connection to a running server (a warm fleet), or None for the runner.
    :param queue: the Celery/executor queue of the batch task (``gpu`` for the runner), or None for the default.
    :param engine_args: more engine arguments for the runner.
    """

    model: str
    vllm_conn_id: str | None = None
    queue: str | None = None
    engine_args: tuple[str, ...] = field(default=())

    def engine(self) -> EngineOptions:
        """The engine of this model's task: the warm fleet's server, or the runner with ``engine_args``."""
        if self.vllm_conn_id:
            return WarmVLLMServer(conn_id=self.vllm_conn_id)
        return VLLMRunner(args=list(self.engine_args))

    @property
    def task_id(self) -> str:
        """The batch DAG's task that runs this model's batches."""
        return f"{TASK_ID}__{re.sub(r'[^A-Za-z0-9_.-]', '_', self.model)}"


def parse_routes(raw: str | None) -> dict[str, ModelRoute]:
    """The routes of ``openai_models`` (empty when it is unset).

    :param raw: the option's JSON text.
    :raises ConfigurationError: it is not a JSON object of objects with the known keys.
    """
    if not raw or not raw.strip():
        return {}
    where = "[vllm_batch] openai_models"
    try:
        data = json.loads(raw)
    except ValueError as err:
        raise ConfigurationError(
            f'{where} is not JSON ({err}): give {{"served-name": {{"vllm_conn_id": "..."}}}}'
        ) from None
    if not isinstance(data, dict):
        raise ConfigurationError(
            f"{where} must be a JSON object mapping served model names to an object with vllm_conn_id or queue"
        )
    routes: dict[str, ModelRoute] = {}
    for model, entry in data.items():
        if not isinstance(entry, dict) or not set(entry) <= _KEYS:
            raise ConfigurationError(
                f"{where}: the entry of {model!r} must be an object with keys among {sorted(_KEYS)}"
            )
        args = entry.get("engine_args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConfigurationError(f"{where}: engine_args of {model!r} must be a list of strings")
        route = ModelRoute(
            model=model,
            vllm_conn_id=entry.get("vllm_conn_id") or None,
            queue=entry.get("queue") or None,
            engine_args=tuple(args),
        )
        taken = [r.model for r in routes.values() if r.task_id == route.task_id]
        if taken:
            raise ConfigurationError(
                f"{where}: {model!r} and {taken[0]!r} make the same task id {route.task_id!r}: rename one"
            )
        routes[model] = route
    return routes


def load_routes() -> dict[str, ModelRoute]:
    """The routes from Airflow's configuration."""
    from airflow_vllm_batch.version_compat import conf

    return parse_routes(conf.get("vllm_batch", "openai_models", fallback="") or "")


class _ModelOf(msgspec.Struct, gc=False):
    body: RequestBody | None = None


_decode = msgspec.json.Decoder(_ModelOf).decode


def models_in(lines: Iterable[bytes], limit: int = 10) -> list[str | None]:
    """The distinct ``body.model`` of request lines, in order of appearance (None: a line names none); at most ``limit``.

    Lines that are not request JSON are left to preflight, which names them.
    """
    found: dict[str | None, None] = {}
    for raw in lines:
        if not raw.strip():
            continue
        try:
            body = _decode(raw).body
        except (msgspec.DecodeError, UnicodeDecodeError):
            continue
        found.setdefault(body.model if body is not None else None)
        if len(found) >= limit:
            break
    return list(found)


def route_of(models: list[str | None], routes: Mapping[str, ModelRoute]) -> ModelRoute:
    """The route of a file whose lines name ``models``; a ``ValueError`` says why there is none.

    Lines naming no model are left to preflight, which names them by line number.

    :param models: the file's distinct models (:func:`models_in`).
    :param routes: the configured routes.
    """
    configured = ", ".join(sorted(routes))
    named = [m for m in models if m is not None]
    if not named:
        raise ValueError(
            f"the file's lines name no body.model: name one of the models served here ({configured})"
        )
    if len(named) > 1:
        shown = ", ".join(repr(m) for m in named)
        raise ValueError(
            f"the file's lines name several models ({shown}): a batch runs one model, split the file by model"
        )
    if named[0] not in routes:
        raise ValueError(f"The model {named[0]!r} is not served here: the configured models are {configured}")
    return routes[named[0]]
