"""Errors of the server engine: the server gone, the API key refused, the model not served.

They live here, free of Airflow imports, until they move into
:mod:`airflow_vllm_batch.exceptions` with the rest.
"""

from __future__ import annotations

from airflow_vllm_batch.exceptions import VLLMBatchError


class ServerUnavailableError(VLLMBatchError):
    """The vLLM server could not be reached after the retries; transient, so the task's retry resumes."""


class ServerAuthError(VLLMBatchError):
    """The vLLM server refused the API key (HTTP 401 or 403); retrying will not help."""

    retryable = False


class ModelNotServedError(VLLMBatchError):
    """The vLLM server does not serve the model the batch asks for; retrying will not help."""

    retryable = False


class BadRequestLineError(VLLMBatchError):
    """A line of the input is not a request line; preflight should have stopped it."""

    retryable = False
