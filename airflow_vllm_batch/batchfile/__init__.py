"""The OpenAI batch file format as vLLM reads and writes it: models, streaming readers, checks.

Plain Python (msgspec, no Airflow), so the operator, the ``airflow-vllm-batch``
CLI and the tests share one implementation::

    from airflow_vllm_batch.batchfile import PreflightOptions, preflight, check_results, open_lines

    with open_lines("input.jsonl") as lines:
        report = preflight(lines, PreflightOptions(model="my-model"))
    report.raise_for_problems("input.jsonl")

    with open_lines("results.jsonl") as results, open_lines("input.jsonl") as inputs:
        summary = check_results(results, inputs)
    summary.raise_for_mismatch()
"""

from __future__ import annotations

from airflow_vllm_batch.batchfile.index import CustomIdIndex
from airflow_vllm_batch.batchfile.models import (
    DEFAULT_SUPPORTED_URLS,
    RequestLine,
    ResultLine,
    error_message,
)
from airflow_vllm_batch.batchfile.preflight import (
    DEFAULT_MAX_LINE_BYTES,
    PreflightOptions,
    PreflightReport,
    diagnose_line,
    error_line,
    preflight,
)
from airflow_vllm_batch.batchfile.problems import Problem
from airflow_vllm_batch.batchfile.results import (
    ENGINE_DEAD_MARKER,
    ResultsReport,
    check_results,
)
from airflow_vllm_batch.batchfile.sources import (
    Lines,
    describe_source,
    is_compressed,
    iter_lines,
    open_lines,
    redact_url,
    source_size,
)

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_SUPPORTED_URLS",
    "ENGINE_DEAD_MARKER",
    "CustomIdIndex",
    "Lines",
    "PreflightOptions",
    "PreflightReport",
    "Problem",
    "RequestLine",
    "ResultLine",
    "ResultsReport",
    "check_results",
    "describe_source",
    "diagnose_line",
    "error_line",
    "error_message",
    "is_compressed",
    "iter_lines",
    "open_lines",
    "preflight",
    "redact_url",
    "source_size",
]
