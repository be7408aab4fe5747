"""The settings of one batch run, checked once: a frozen dataclass the run layer and the engines read.

:func:`check_static_settings` runs at DAG parse time on what is not templated (a wrong
mode fails the DAG's import, not a task at 2 am); :meth:`BatchSettings.from_rendered`
runs when the task starts, on the rendered values, and coerces them (a Param-driven
``max_failed_ratio`` arrives as the string ``"0.1"``). Every mistake is a
:class:`~airflow_vllm_batch.exceptions.ConfigurationError` naming the parameter and the
fix; it is never retried.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from functools import cached_property
from typing import Any, ClassVar, Literal

from airflow_vllm_batch.batchfile import DEFAULT_MAX_LINE_BYTES, url_secrets
from airflow_vllm_batch.batchfile.requests import INDEX, check_requests_options
from airflow_vllm_batch.batchfile.structured import (
    ModelClass,
    OutputSchema,
    check_output_type_path,
    resolve_output_type,
)
from airflow_vllm_batch.engines.options import EngineOptions, VLLMRunner
from airflow_vllm_batch.exceptions import ConfigurationError, PresignError
from airflow_vllm_batch.run.answer_cache import split_cache_uri
from airflow_vllm_batch.run.locations import check_locations
from airflow_vllm_batch.storage.s3 import split_s3_uri

#: SigV4 presigned URLs are valid for at most seven days.
MAX_PRESIGN_SECONDS = 7 * 24 * 3600
#: Used when the task has no execution_timeout and no presign_expires_in was given.
DEFAULT_PRESIGN_SECONDS = 24 * 3600
#: Added to execution_timeout: the engine's final PUT happens at the very end.
PRESIGN_MARGIN_SECONDS = 15 * 60
#: The directory whose ``airflow-vllm-batch/`` subdirectory holds the engine's local output
#: and results kept after an S3 failure (:func:`airflow_vllm_batch.scratch.owned_dir`).
DEFAULT_RESULTS_DIR = tempfile.gettempdir()

_MODES = {"invalid_lines": ("fail", "skip"), "result_shape": ("vllm", "openai")}


@dataclass(kw_only=True)
class AnswerCacheOptions:
    """Where an answer cache lives and what it holds (the operator's ``answer_cache=``).

    Deterministic requests answered before are answered from it; only the others reach the
    engine (see the README's answer-cache section).

    :param uri: ``s3://bucket/prefix/`` of the cache. (templated)
    :param sampled: also cache requests that sample (no ``temperature`` 0, no ``seed``). Default False.
    """

    template_fields: ClassVar[Sequence[str]] = ("uri",)

    uri: str
    sampled: bool = False

    def serialize(self) -> dict[str, Any]:
        """What the rendered-fields view shows."""
        return {"uri": self.uri, "sampled": self.sampled}


@dataclass(frozen=True, kw_only=True)
class InputLimits:
    """How large an input may be, checked by preflight (the operator's ``limits=``).

    :param max_lines: the most request lines accepted. Default: no limit.
    :param max_line_bytes: the longest request line accepted. Default 1,000,000.
    """

    max_lines: int | None = None
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES


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
    aws_conn_id: str | None = "aws_default"
    max_failed_ratio: float = 0.0
    invalid_lines: Literal["fail", "skip"] = "fail"
    rewrite_model: bool = False
    default_body: Mapping[str, Any] = field(default_factory=dict)
    max_lines: int | None = None
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    supported_urls: frozenset[str] | None = None
    resume: bool = True
    results_dir: str = DEFAULT_RESULTS_DIR
    #: The engine's options (:mod:`airflow_vllm_batch.engines.options`), rendered and checked.
    engine: EngineOptions = field(default_factory=VLLMRunner)
    output_type: ModelClass | None = None
    answer_cache_uri: str | None = None
    answer_cache_sampled: bool = False
    execution_timeout: timedelta | None = None
    #: The shape of the published lines: ``"vllm"`` (the operator's) or ``"openai"`` (the OpenAI API's
    #: batches: ``batch_req_`` ids, HTTP failures in ``response.body.error``; :mod:`airflow_vllm_batch.batchfile.openai_lines`).
    result_shape: str = "vllm"

    @classmethod
    def from_rendered(cls, **values: Any) -> BatchSettings:
        """Check the rendered values (and the static ones again) and return the settings."""
        check_static_settings(values)
        names = (
            ("output_uri", "model")
            if values.get("requests") is not None
            else ("input_uri", "output_uri", "model")
        )
        for name in names:
            value = values.get(name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigurationError(f"{name} must be a non-empty string, got {value!r} after rendering.")
        split_s3_uri(values["output_uri"], "output_uri")
        if values.get("error_uri") is not None:
            split_s3_uri(values["error_uri"], "error_uri")
        default_body = values.get("default_body")
        if default_body is not None and not isinstance(default_body, Mapping):
            raise ConfigurationError(
                f"default_body must be a mapping, got {type(default_body).__name__} {default_body!r}."
            )
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
            default_body=dict(values.get("default_body") or {}),
            supported_urls=frozenset(values["supported_urls"]) if values.get("supported_urls") else None,
            engine=_engine_options(values.get("engine")).rendered(),
            output_type=resolve_output_type(values.get("output_type")),
        )
        settings = cls(**coerced)
        # Masked where they enter: every later line (ours, or the engine's relayed) is safe.
        settings.engine.mask_secrets()
        if secrets := url_secrets(settings.input_uri):  # an http(s) input's user info or signature
            from airflow.sdk.log import mask_secret

            for secret in secrets:
                mask_secret(secret)
        return settings

    @cached_property
    def output_schema(self) -> OutputSchema | None:
        """``output_type``'s schema, when answers must fit one."""
        return OutputSchema(self.output_type) if self.output_type is not None else None

    @property
    def skips_invalid_lines(self) -> bool:
        return self.invalid_lines == "skip"

    def presign_seconds(self, expires_in: timedelta | int | None = None) -> int:
        """Seconds the presigned URLs an engine is given must stay valid: ``expires_in``, or the task's whole time budget.

        :param expires_in: the engine's ``presign_expires_in``, a ``timedelta`` or seconds; None: the task's budget.
        """
        if isinstance(expires_in, timedelta):
            seconds = int(expires_in.total_seconds())
        elif expires_in is not None:
            seconds = int(expires_in)
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
    if (values.get("input_uri") is None) == (values.get("requests") is None):
        raise ConfigurationError(
            "Give the batch as input_uri (a file) or as requests (a list, e.g. an upstream task's XCom): "
            f"exactly one of them, got {'both' if values.get('requests') is not None else 'neither'}."
        )
    check_requests_options(
        values.get("requests_url", "/v1/chat/completions"),
        values.get("requests_custom_id", INDEX),
        values.get("default_body"),
    )
    for name, allowed in _MODES.items():
        if name in values and values[name] not in allowed:
            raise ConfigurationError(f"{name} must be one of {allowed}, got {values[name]!r}.")
    for name in ("max_lines", "max_line_bytes"):
        value = values.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigurationError(f"{name} must be a positive whole number or None, got {value!r}.")
    _check_output_type(values.get("output_type"), values.get("default_body"))
    if not isinstance(values.get("answer_cache_sampled", False), bool):
        raise ConfigurationError(
            f"answer_cache_sampled must be True or False, got {values['answer_cache_sampled']!r}."
        )
    cache_uri = values.get("answer_cache_uri")
    if cache_uri is not None and not (isinstance(cache_uri, str) and "{{" in cache_uri):
        # A string with a template is checked once rendered.
        split_cache_uri(cache_uri)
    check_locations(values, rendered=False)
    _engine_options(values.get("engine")).check(values)


def _engine_options(engine: Any) -> EngineOptions:
    """The ``engine=`` options; None is the default engine, vLLM's batch runner."""
    if engine is None:
        return VLLMRunner()
    if not isinstance(engine, EngineOptions):
        raise ConfigurationError(
            f"engine must be an engine's options, e.g. VLLMRunner(args=[...]), VLLMServer(...) or "
            f"WarmVLLMServer(conn_id=...) from airflow_vllm_batch.engines, got {engine!r}."
        )
    return engine


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


def _ratio(value: Any) -> float:
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        ratio = -1.0
    if not 0 <= ratio <= 1:
        raise ConfigurationError(
            f"max_failed_ratio must be a number from 0 to 1, got {value!r} after rendering."
        )
    return ratio
