"""Exceptions raised by airflow-vllm-batch.

Every failure raises a subclass of :class:`VLLMBatchError`, whose message says what
went wrong, where (parameter, file, line, custom_id) and what to do about it.

Each class says whether trying again can help (:attr:`VLLMBatchError.retryable`). A
mistake in the arguments, the input or the engine settings fails the same way on every
try, so the operator turns those into Airflow's ``AirflowFailException`` (no retry, no
GPU time); transient failures (S3 or the engine going away, another run holding the
output) are raised as they are and Airflow's own ``retries`` take over. The module has
no Airflow imports so that the batch-file code and the CLI can use it too.
"""

from __future__ import annotations

#: What a message adds about a process killed by SIGKILL: most often the kernel's OOM killer.
OOM_HINT = " (SIGKILL: out of memory? see the kernel log)"


class VLLMBatchError(Exception):
    """Base class of every error raised by this provider.

    :cvar retryable: whether another try of the task can succeed.
    """

    retryable: bool = True


# -- mistakes: the same on every try ------------------------------------------------------


class ConfigurationError(VLLMBatchError):
    """An operator argument or rendered value is not usable; the message names the parameter."""

    retryable = False


class PreflightError(VLLMBatchError):
    """The input batch file failed validation; no engine was started.

    :param message: the human-readable summary (first problems, then a count).
    :param report: the full preflight report, for callers that want the details.
    """

    retryable = False

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report


class InputNotFoundError(VLLMBatchError):
    """The input file does not exist or cannot be read with the given connection."""

    retryable = False


class LocationError(VLLMBatchError):
    """An output, error or staging location is malformed, missing or not writable."""

    retryable = False


class EngineConfigurationError(VLLMBatchError):
    """The engine settings cannot work: bad engine arguments, a missing model, no vLLM."""

    retryable = False


class EngineArgumentsError(EngineConfigurationError):
    """An engine's ``args`` (``VLLMRunner(args=...)``) were refused by the engine's own argument parser (or are malformed)."""


class ModelNotFoundError(EngineConfigurationError):
    """``model`` names a local path that does not exist, or a hub model not cached while offline."""


class IncompleteModelError(EngineConfigurationError):
    """``model`` is a local directory that does not look like a model (config, weights or tokenizer missing)."""


class EngineArgsCheckError(EngineConfigurationError):
    """The engine environment could not check an engine's ``args``: no vLLM there, a crash or a timeout.

    :param message: what happened and what to do.
    :param retryable: True when trying again may help (a timeout on a busy machine).
    """

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class PresignError(VLLMBatchError):
    """A presigned URL could not be made (bad connection, bad bucket or key, expiry too long)."""

    retryable = False


class TooManyFailedRequestsError(VLLMBatchError):
    """More requests failed than ``max_failed_ratio`` allows (the files are still written).

    A retry would return the same published results, so it is not retried.
    """

    retryable = False


# -- transient: another try can succeed ---------------------------------------------------


class ResultsCheckError(VLLMBatchError):
    """The engine's output does not answer the input: lines missing, extra or repeated."""


class EngineError(VLLMBatchError):
    """The vLLM engine failed: a non-zero exit, a kill, or vLLM's silent failure mode."""


class EngineStalledError(EngineError):
    """The vLLM engine made no progress for its stall bound: it was stopped, and another try may get through."""


class PublishError(VLLMBatchError):
    """The results could not be put in S3 (unreachable, denied); the message says what was kept."""


class StorageUnavailableError(VLLMBatchError):
    """S3 could not be reached before anything ran (connection refused, timeout)."""


class ScratchFullError(VLLMBatchError):
    """The worker's disk under ``results_dir`` is full (or over its quota); the task's retry resumes from what S3 holds."""


class InputChangedError(VLLMBatchError):
    """The input was overwritten while the task ran; the next try runs the new content."""


class OutputBusyError(VLLMBatchError):
    """Another run holds the output (its lease is live); the message names that run."""


class ServerUnavailableError(VLLMBatchError):
    """The vLLM server could not be reached after the retries; the task's retry resumes from the checkpoints."""


class RequestsUnansweredError(VLLMBatchError):
    """Some requests got no final answer in this try (a 429 or a 500 through every retry).

    The final answers are checkpointed and nothing is published; the task's retry sends
    only the requests left. The task's last try publishes them as failed lines instead.
    """


class ServerAuthError(VLLMBatchError):
    """The vLLM server refused the API key (HTTP 401 or 403); retrying will not help."""

    retryable = False


class ModelNotServedError(VLLMBatchError):
    """The vLLM server does not serve the model the batch asks for; retrying will not help."""

    retryable = False


class BadRequestLineError(VLLMBatchError):
    """A line of the input is not a request line; preflight should have stopped it."""

    retryable = False


class ShardingError(VLLMBatchError):
    """A batch file could not be split into shards, or shard results not merged back."""

    retryable = False


class ManifestVersionError(VLLMBatchError):
    """A manifest's ``schema_version`` is newer than this airflow-vllm-batch reads (or is not a version)."""

    retryable = False


class AdapterNotFoundError(EngineConfigurationError):
    """A LoRA adapter of ``--lora-modules`` is missing, or its directory has no ``adapter_config.json``."""


class BatchStopped(VLLMBatchError):
    """The run was told to stop (its batch's deadline passed, or its batch was cancelled) while it held the lease.

    Not a failure: the run layer catches it and publishes what is answered so far, with a
    manifest whose ``status`` is :attr:`reason` (:meth:`airflow_vllm_batch.run.BatchRun.publish_stopped`).

    :param reason: ``"expired"`` or ``"cancelled"``.
    """

    retryable = False

    def __init__(self, reason: str) -> None:
        super().__init__(f"The batch was stopped: {reason}")
        self.reason = reason
