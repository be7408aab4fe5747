"""The server engine's client side: stream a batch through a vLLM server, journal the answers.

Free of Airflow imports, like :mod:`airflow_vllm_batch.batchfile`, so a CLI, a test and
the operator use the same code. The server's lifecycle and the ``vllm`` connection are in
:mod:`airflow_vllm_batch.engines.vllm.server_process`.
"""

from __future__ import annotations

from airflow_vllm_batch.exceptions import (
    BadRequestLineError,
    ModelNotServedError,
    ServerAuthError,
    ServerUnavailableError,
)
from airflow_vllm_batch.serving.journal import Journal, SealedPart, part_name
from airflow_vllm_batch.serving.stream import (
    DEFAULT_MAX_IN_FLIGHT,
    SERVED_URLS,
    StreamStats,
    result_line,
    run_stream,
)

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "SERVED_URLS",
    "BadRequestLineError",
    "Journal",
    "ModelNotServedError",
    "SealedPart",
    "ServerAuthError",
    "ServerUnavailableError",
    "StreamStats",
    "part_name",
    "result_line",
    "run_stream",
]
