"""Exceptions raised by airflow-vllm-batch.

Every failure raises a subclass of :class:`VLLMBatchError`, whose message says what
went wrong, where (file, line, custom_id) and what to do about it. The module has no
Airflow imports so that the batch-file code and the CLI can use it too.
"""

from __future__ import annotations


class VLLMBatchError(Exception):
    """Base class of every error raised by this provider."""


class PreflightError(VLLMBatchError):
    """The input batch file failed validation; no engine was started.

    :param message: the human-readable summary (first problems, then a count).
    :param report: the full preflight report, for callers that want the details.
    """

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report


class ResultsCheckError(VLLMBatchError):
    """The engine's output does not answer the input: lines missing, extra or repeated."""


class EngineError(VLLMBatchError):
    """The vLLM engine failed: a non-zero exit, a kill, or vLLM's silent failure mode."""


class TooManyFailedRequestsError(VLLMBatchError):
    """More requests failed than ``max_failed_ratio`` allows (the files are still written)."""


class PresignError(VLLMBatchError):
    """A presigned URL could not be made (bad connection, bad bucket or key, expiry too long)."""


class PublishError(VLLMBatchError):
    """The results could not be put in S3 (unreachable, denied); the message says what was kept."""


class ShardingError(VLLMBatchError):
    """A batch file could not be split into shards, or shard results not merged back."""
