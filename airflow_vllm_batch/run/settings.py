"""The settings of one batch run, checked once: a frozen dataclass the run layer and the engines read.

:func:`check_static_settings` runs at DAG parse time on what is not templated (a wrong
mode fails the DAG's import, not a task at 2 am); :meth:`BatchSettings.from_rendered`
runs when the task starts, on the rendered values, and coerces them (a Param-driven
``max_failed_ratio`` arrives as the string ``"0.1"``). Every mistake is a
:class:`~airflow_vllm_batch.exceptions.ConfigurationError` naming the parameter and the
fix; it is never retried.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from datetime import timedelta
from typing import Any

from airflow_vllm_batch.batchfile import DEFAULT_MAX_LINE_BYTES
from airflow_vllm_batch.batchfile.requests import INDEX, check_requests_options
from airflow_vllm_batch.batchfile.structured import OutputSchema, check_output_type_path, resolve_output_type
from airflow_vllm_batch.exceptions import ConfigurationError, PresignError
from airflow_vllm_batch.engines.vllm.process import DEFAULT_GRACE_S
from airflow_vllm_batch.engines.vllm.server_process import DEFAULT_STARTUP_TIMEOUT_S
from airflow_vllm_batch.redaction import register_engine_secrets
from airflow_vllm_batch.run.answer_cache import split_cache_uri
from airflow_vllm_batch.run.cost import check_gpu_hour_cost
from airflow_vllm_batch.run.locations import check_locations
from airflow_vllm_batch.serving.stream import DEFAULT_REQUEST_TIMEOUT_S
from airflow_vllm_batch.storage import split_s3_uri

#: SigV4 presigned URLs are valid for at most seven days.
MAX_PRESIGN_SECONDS = 7 * 24 * 3600
#: Used when the task has no execution_timeout and no presign_expires_in was given.
DEFAULT_PRESIGN_SECONDS = 24 * 3600
#: Added to execution_timeout: the engine's final PUT happens at the very end.
PRESIGN_MARGIN_SECONDS = 15 * 60
#: The directory whose ``airflow-vllm-batch/`` subdirectory holds the engine's local output
#: and results kept after an S3 failure (:func:`airflow_vllm_batch.scratch.owned_dir`).
DEFAULT_RESULTS_DIR = tempfile.gettempdir()

_MODES = {"output_mode": ("local", "presigned"), "invalid_lines": ("fail", "skip")}


@dataclass(frozen=True)
class BatchSettings:
    """Everything one batch run is told, after rendering and checking (see the operator for each meaning)."""

    output_uri: str
    model: str
    input_uri: str | None = None
    requests: Sequence[Any] | None = None
    requests_url: str = "/v1/chat/completions"
    requests_custom_id: str = INDEX
    error_uri: str | None = None
    engine_args: tuple[str, ...] = ()
    engine_python: str | None = None
    engine_command: tuple[str, ...] | None = None
    engine_env: Mapping[str, str] = field(default_factory=dict)
    aws_conn_id: str | None = "aws_default"
    presign_expires_in: int | None = None
    max_failed_ratio: float = 0.0
    invalid_lines: str = "fail"
    rewrite_model: bool = False
    default_body: Mapping[str, Any] = field(default_factory=dict)
    max_lines: int | None = None
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    supported_urls: frozenset[str] | None = None
    kill_grace_s: float = DEFAULT_GRACE_S
    resume: bool = True
    output_mode: str = "local"
    results_dir: str = DEFAULT_RESULTS_DIR
    engine: str = "runner"
    vllm_conn_id: str | None = None
    max_in_flight: int | None = None
    checkpoint_interval_s: float = 60.0
    client_processes: int = 1
    gpus: int | None = None
    gpu_hour_cost: float | None = None
    output_type: type | None = None
    answer_cache_uri: str | None = None
    answer_cache_sampled: bool = False
    server_startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    execution_timeout: timedelta | None = None

    @classmethod
    def from_rendered(cls, **values: Any) -> BatchSettings:
        """Check the rendered values (and the static ones again) and return the settings."""
        check_static_settings(values)
        names = ("output_uri", "model") if values.get("requests") is not None else ("input_uri", "output_uri", "model")
        for name in names:
            value = values.get(name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigurationError(f"{name} must be a non-empty string, got {value!r} after rendering.")
        split_s3_uri(values["output_uri"], "output_uri")
        if values.get("error_uri") is not None:
            split_s3_uri(values["error_uri"], "error_uri")
        for name in ("engine_args", "engine_command"):
            value = values.get(name)
            if value is not None and (isinstance(value, str) or not all(isinstance(a, str) for a in value)):
                raise ConfigurationError(f"{name} must be a list of strings, e.g. ['--max-model-len', '4096'], got {value!r}.")
        for name in ("engine_env", "default_body"):
            value = values.get(name)
            if value is not None and not isinstance(value, Mapping):
                raise ConfigurationError(f"{name} must be a mapping, got {type(value).__name__} {value!r}.")
        if values.get("answer_cache_uri") is not None:
            bucket, prefix = split_cache_uri(values["answer_cache_uri"])
            values = {**values, "answer_cache_uri": f"s3://{bucket}/{prefix}"}
        # Before any engine starts and before any S3 write (requests= are written first).
        check_locations(values)
        known = {f.name for f in fields(cls)}
        coerced = {k: v for k, v in values.items() if k in known}
        coerced.update(
            results_dir=values.get("results_dir") or DEFAULT_RESULTS_DIR,
            max_failed_ratio=_ratio(values.get("max_failed_ratio", 0.0)),
            gpu_hour_cost=check_gpu_hour_cost(values.get("gpu_hour_cost")),
            engine_args=tuple(values.get("engine_args") or ()),
            engine_command=tuple(values["engine_command"]) if values.get("engine_command") else None,
            engine_env={k: str(v) for k, v in (values.get("engine_env") or {}).items()},
            default_body=dict(values.get("default_body") or {}),
            supported_urls=frozenset(values["supported_urls"]) if values.get("supported_urls") else None,
            engine="server" if values.get("vllm_conn_id") else values.get("engine", "runner"),
            output_type=resolve_output_type(values.get("output_type")),
            server_startup_timeout=_seconds("server_startup_timeout", values.get("server_startup_timeout"), DEFAULT_STARTUP_TIMEOUT_S),
            request_timeout=_seconds("request_timeout", values.get("request_timeout"), DEFAULT_REQUEST_TIMEOUT_S),
        )
        settings = cls(**coerced)
        # Masked where they enter: every later line (ours, or the engine's relayed) is safe.
        register_engine_secrets(settings.engine_args, settings.engine_env)
        return settings

    @cached_property
    def output_schema(self) -> OutputSchema | None:
        """``output_type``'s schema, when answers must fit one."""
        return OutputSchema(self.output_type) if self.output_type is not None else None

    @property
    def engine_environment(self) -> dict[str, str]:
        """The environment of an engine this task starts: the worker's, plus ``engine_env``."""
        return {**os.environ, **self.engine_env}

    @property
    def skips_invalid_lines(self) -> bool:
        return self.invalid_lines == "skip"

    def presign_seconds(self) -> int:
        """Seconds the presigned URLs must stay valid: the task's whole time budget."""
        if self.presign_expires_in is not None:
            seconds = int(self.presign_expires_in)
        elif isinstance(self.execution_timeout, timedelta):
            seconds = int(self.execution_timeout.total_seconds()) + PRESIGN_MARGIN_SECONDS
        else:
            seconds = DEFAULT_PRESIGN_SECONDS
        if not 0 < seconds <= MAX_PRESIGN_SECONDS:
            raise PresignError(
                f"Presigned URLs would need to be valid for {seconds}s, but SigV4 allows 1 to "
                f"{MAX_PRESIGN_SECONDS}s (7 days). Shorten execution_timeout, set presign_expires_in, "
                "or split the batch into shards."
            )
        return seconds


def check_static_settings(values: Mapping[str, Any]) -> None:
    """Check the arguments that are not templated (at DAG parse time, and again at run time)."""
    from airflow_vllm_batch.engines import engine_class

    if (values.get("input_uri") is None) == (values.get("requests") is None):
        raise ConfigurationError(
            "Give the batch as input_uri (a file) or as requests (a list, e.g. an upstream task's XCom): "
            f"exactly one of them, got {'both' if values.get('requests') is not None else 'neither'}."
        )
    check_requests_options(
        values.get("requests_url", "/v1/chat/completions"), values.get("requests_custom_id", INDEX), values.get("default_body")
    )
    for name, allowed in _MODES.items():
        if name in values and values[name] not in allowed:
            raise ConfigurationError(f"{name} must be one of {allowed}, got {values[name]!r}.")
    for name in ("max_lines", "max_line_bytes", "presign_expires_in"):
        value = values.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigurationError(f"{name} must be a positive whole number or None, got {value!r}.")
    grace = values.get("kill_grace_s", DEFAULT_GRACE_S)
    if not isinstance(grace, (int, float)) or grace < 0:
        raise ConfigurationError(f"kill_grace_s must be a number of seconds >= 0, got {grace!r}.")
    price = values.get("gpu_hour_cost")
    if not isinstance(price, str):
        # A string may be a template, rendered (and checked) when the task runs.
        check_gpu_hour_cost(price)
    gpus = values.get("gpus")
    if gpus is not None and (not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0):
        raise ConfigurationError(f"gpus must be a whole number >= 0 or None, got {gpus!r}.")
    in_flight = values.get("max_in_flight")
    if in_flight is not None and (not isinstance(in_flight, int) or isinstance(in_flight, bool) or in_flight < 1):
        raise ConfigurationError(f"max_in_flight must be a positive whole number or None, got {in_flight!r}.")
    processes = values.get("client_processes", 1)
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise ConfigurationError(
            f"client_processes must be a positive whole number (1 unless the server answers more than one client "
            f"core sends, ~3,400 requests/s), got {processes!r}."
        )
    _seconds("server_startup_timeout", values.get("server_startup_timeout"), DEFAULT_STARTUP_TIMEOUT_S)
    _seconds("request_timeout", values.get("request_timeout"), DEFAULT_REQUEST_TIMEOUT_S)
    interval = values.get("checkpoint_interval_s", 60.0)
    if not isinstance(interval, (int, float)) or interval <= 0:
        raise ConfigurationError(f"checkpoint_interval_s must be a number of seconds > 0, got {interval!r}.")
    _check_output_type(values.get("output_type"), values.get("default_body"))
    if not isinstance(values.get("answer_cache_sampled", False), bool):
        raise ConfigurationError(f"answer_cache_sampled must be True or False, got {values['answer_cache_sampled']!r}.")
    cache_uri = values.get("answer_cache_uri")
    if cache_uri is not None and not (isinstance(cache_uri, str) and "{{" in cache_uri):
        # A string with a template is checked once rendered.
        split_cache_uri(cache_uri)
    check_locations(values, rendered=False)
    engine = "server" if values.get("vllm_conn_id") else values.get("engine", "runner")
    engine_class(engine, vllm_conn_id=values.get("vllm_conn_id")).check_settings(values)


def _check_output_type(output_type: Any, default_body: Any) -> None:
    """A class is checked now; an import path only for its form (the scheduler may lack the worker's packages)."""
    if output_type is None:
        return
    if isinstance(output_type, str):
        check_output_type_path(output_type)
    else:
        resolve_output_type(output_type)
    if isinstance(default_body, Mapping) and "response_format" in default_body:
        raise ConfigurationError(
            "default_body sets response_format and output_type gives one (its JSON schema): drop response_format "
            "from default_body, or output_type."
        )


def _seconds(name: str, value: Any, default: float) -> float:
    """A duration given as a ``timedelta`` or a number of seconds (Airflow's style), > 0; None: ``default``."""
    if value is None:
        return default
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigurationError(
            f"{name} must be a datetime.timedelta or a number of seconds > 0, e.g. timedelta(minutes=30), got {value!r}."
        )
    return seconds


def _ratio(value: Any) -> float:
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        ratio = -1.0
    if not 0 <= ratio <= 1:
        raise ConfigurationError(f"max_failed_ratio must be a number from 0 to 1, got {value!r} after rendering.")
    return ratio
