"""The server engines: vLLM's OpenAI-compatible server, started by the task or warm behind a ``vllm`` connection.

Both stream the requests no checkpoint answers yet, with bounded in-flight, and journal
each final answer as it arrives: every ``checkpoint_interval`` (or 64 MiB) the
new answers go to the run's staging as a *part*, named for the try that wrote it. A
retry on any worker sends only what no part answers. The lease is checked before every
part goes up, so a try that lost its output to another stops at its next checkpoint.
With ``client_processes`` N > 1 the requests are spread over N spawned client processes
(:mod:`airflow_vllm_batch.serving.processes`); their parts are still uploaded by the task's
process, one after another, each after the lease check.

A final answer is a 200 or a 4xx other than 408 and 429 (see :mod:`airflow_vllm_batch.serving.stream`).
A request still without one when the stream ends (a 429 or a 500 through every retry)
fails the try with the retryable :class:`~airflow_vllm_batch.exceptions.RequestsUnansweredError`,
nothing published, so that Airflow's retry sends it again; on the task's last try it is
journaled with its last answer as a failed line, and the batch is published.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError

from airflow_vllm_batch.batchfile import redact_urls
from airflow_vllm_batch.batchfile.cache_keys import reported_models
from airflow_vllm_batch.batchfile.models import GENERATE_URLS
from airflow_vllm_batch.docs_links import doc_ref
from airflow_vllm_batch.engines.base import Engine, EngineInfo, EngineJob, EngineResults, EngineRun, StopPoll
from airflow_vllm_batch.engines.checkpoint_parts import answered_requests, resumable_parts
from airflow_vllm_batch.engines.local import LAUNCH_REPORT, LocalEngine
from airflow_vllm_batch.engines.sizing import (
    SchedulerSizes,
    api_server_count,
    connection_in_flight,
    started_server_in_flight,
)
from airflow_vllm_batch.engines.vllm.checks import check_reserved_options
from airflow_vllm_batch.engines.vllm.command import FALLBACK_SUPPORTED_URLS
from airflow_vllm_batch.engines.vllm.model_names import ServedModels, served_models_of_server
from airflow_vllm_batch.engines.vllm.server_process import SERVER_MODULE, VLLMServerEngine
from airflow_vllm_batch.exceptions import (
    BatchStopped,
    ConfigurationError,
    RequestsUnansweredError,
    StorageUnavailableError,
)
from airflow_vllm_batch.serving import SERVED_URLS, Journal, StreamStats
from airflow_vllm_batch.serving.journal import DEFAULT_MAX_PART_BYTES
from airflow_vllm_batch.serving.neighbour import NeighbourPlan
from airflow_vllm_batch.serving.processes import terminate_workers

if TYPE_CHECKING:
    from airflow_vllm_batch.engines.options import YieldToInteractive
    from airflow_vllm_batch.storage.staging import RunStaging

#: The server's batch routes when they cannot be read from its vLLM (a warm server behind a
#: connection; a vLLM without ``api_router.py`` modules): the runner's, and ``/v1/completions``,
#: which vLLM's OpenAI-compatible server has served since its first release.
FALLBACK_SERVER_URLS: frozenset[str] = FALLBACK_SUPPORTED_URLS | {"/v1/completions"}

#: Seconds between progress lines of the server engine in the task log.
PROGRESS_EVERY_S = 15.0


class _Streaming(Engine):
    """What both server engines do: stream what no checkpoint answers, journal answers into parts."""

    @classmethod
    def check_settings(cls, options: Any, values: Mapping[str, Any]) -> None:
        urls = values.get("supported_urls")
        if urls and (unsendable := sorted(set(urls) - SERVED_URLS)):
            raise ConfigurationError(
                f"supported_urls: {options.label} cannot send {', '.join(unsendable)} (an audio line's file_url "
                "must be fetched and uploaded, which only the batch runner does): use engine=VLLMRunner() for these "
                f"lines, or list only some of {', '.join(sorted(SERVED_URLS))}."
            )

    def url_advice(self) -> dict[str, str]:
        # Only vLLM's batch runner fetches an audio line's file_url and uploads it.
        return dict.fromkeys(
            GENERATE_URLS - SERVED_URLS,
            "audio lines run on the batch runner (engine=VLLMRunner()); put them in a file of their own",
        )

    @cached_property
    def server(self) -> VLLMServerEngine:
        """The server (a warm one, or one this task starts); kept so that :meth:`terminate` can stop it."""
        return VLLMServerEngine(
            self.settings.model, request_timeout_s=self.options.request_timeout_s, **self.server_arguments()
        )

    def server_arguments(self) -> dict[str, Any]:
        """How :class:`VLLMServerEngine` reaches or starts the server."""
        raise NotImplementedError

    def restrict(self, info: EngineInfo) -> EngineInfo:
        """The batch URLs of this engine: the server's routes (as the probe read them) that the stream can send."""
        return dataclasses.replace(
            info, supported_urls=(info.server_urls or FALLBACK_SERVER_URLS) & SERVED_URLS
        )

    def produce(self, info: EngineInfo, job: EngineJob) -> EngineResults:
        """Stream the requests no checkpoint answers yet through the server; checkpoint the answers as parts."""
        staging = job.staging
        results = EngineResults(
            run=EngineRun(returncode=0, duration_s=0.0, vllm_version=info.vllm_version),
            open_results=staging.open_parts,
            duplicates="first",
            staged_uri=staging.uri(staging.parts_prefix),
        )
        if not self.settings.resume:
            staging.drop_results()
        parts, answered = resumable_parts(staging, job.report.custom_ids, self.log)
        total = job.report.valid_lines
        # Requests, not answers: two tries' parts may answer one request twice (Exactly once, Durability).
        done = answered_requests(job.report.custom_ids, answered, total)
        if parts:
            self.log.info(
                "Resuming from %d checkpoint part(s) at %s: %d of %d requests are answered already.",
                len(parts),
                results.staged_uri,
                done,
                total,
            )
        if done >= total:
            return results
        job.raise_if_stopped()
        self.before_stream(info, job)
        token = uuid.uuid4().hex[:8]
        counts = _CheckpointCounts(job, staging, parts) if job.on_checkpoint is not None else None

        def upload(path: Path, index: int) -> None:
            staging.put_part(path, token)
            if counts is not None:
                counts.add(path)

        journal = Journal(
            job.work / "journal",
            on_part=upload,
            checkpoint_interval_s=self.options.checkpoint_interval_s,
            max_part_bytes=DEFAULT_MAX_PART_BYTES,
            first_index=len(parts),
        )
        progress = _Progress(self.log, total=total, resumed=done)
        # Between requests: a stopped run sends nothing more; the answers in flight are journaled and
        # checkpointed as usual before the stream ends (Durability), then BatchStopped reaches the run layer.
        stop = StopPoll(job.stop)
        skip = (lambda custom_id: answered.line_of(custom_id) is not None) if answered else None
        # The skip is what this try read of the parts; a part written since was written under another
        # holder of the lease. Read the lease after the parts, so a try paused between its reads and its
        # first request (a zombie) does not send again what its successor answered (Durability, Fencing).
        job.lease.ensure_held(verify=True)
        started = time.monotonic()
        if self.options.client_processes > 1:
            self.log.info(
                "The client spreads the requests over %d processes, each with its own connection pool and share of "
                "the in-flight bound; this task uploads their checkpoints.",
                self.options.client_processes,
            )
        try:
            with job.request_lines() as lines, self.gpus_for(job) as fds:
                self.server.pass_fds = fds
                stats = self.server.run(
                    stop.lines(enumerate(lines, start=1)),
                    journal=journal,
                    max_in_flight=self.options.max_in_flight,
                    skip=skip,
                    on_progress=progress,
                    progress_every_s=PROGRESS_EVERY_S,
                    processes=self.options.client_processes,
                    stop=stop,
                )
            progress.summary(stats)
            if stop.reason is not None:
                # What was answered is checkpointed; what was set aside is no final answer, left unanswered.
                raise BatchStopped(stop.reason)
            if stats.unanswered:
                self.settle_unanswered(stats, journal, job, results.staged_uri)
        except (BotoCoreError, ClientError) as err:
            raise StorageUnavailableError(
                f"S3 failed while checkpointing the server's answers to {results.staged_uri} ({err}). "
                f"The {journal.lines_durable + done} answers in parts uploaded before stay there; the task's "
                "retry resumes from them."
            ) from err
        results.run = EngineRun(
            returncode=0, duration_s=time.monotonic() - started, vllm_version=info.vllm_version
        )
        return results

    def settle_unanswered(
        self, stats: StreamStats, journal: Journal, job: EngineJob, staged_uri: str
    ) -> None:
        """Fail the try for a retry that sends the requests left without a final answer; on the last try, journal them as failed.

        :raises RequestsUnansweredError: this is not the task's last try (nothing is published).
        """
        reasons = ", ".join(
            f"{reason}: {count}" for reason, count in sorted(stats.unanswered_reasons.items())
        )
        left = f"{stats.unanswered} request(s) got no final answer through every retry ({reasons}; e.g. custom_id {stats.unanswered_example!r})"
        if not job.task.last_try:
            raise RequestsUnansweredError(
                f"{left}; the other answers are checkpointed at {staged_uri} and nothing was published. The task's "
                "retry sends only these requests; on its last try they are published as failed lines "
                f"({doc_ref('Troubleshooting', 'Requests left without a final answer')})."
            )
        self.log.warning(
            "%s. This is the task's last try: they are published as failed lines in the error file.", left
        )
        journal.write_set_aside()
        journal.close()

    def before_stream(self, info: EngineInfo, job: EngineJob) -> None:
        """Checks worth their cost only when requests are about to be sent."""

    def gpus_for(self, job: EngineJob) -> Any:
        """The GPUs this try's server holds (none: a warm server's are not this worker's)."""
        return contextlib.nullcontext(())

    def terminate(self) -> None:
        # The client processes first: a server stopped under them would fail them one by one.
        terminate_workers()
        if "server" in self.__dict__:
            self.server.terminate()


class ServerEngine(_Streaming, LocalEngine):
    """A vLLM server this task starts on its worker for the batch, and stops when the task ends or is killed."""

    name = "server"
    entrypoint = "api_server"

    @classmethod
    def check_settings(cls, options: Any, values: Mapping[str, Any]) -> None:
        super().check_settings(options, values)
        args = options.args
        if isinstance(args, (list, tuple)):
            # At parse time: a flag the task sets itself (--port, ...) would leave it waiting on the wrong server.
            check_reserved_options([a for a in args if isinstance(a, str) and "{{" not in a], cls.entrypoint)

    def server_arguments(self) -> dict[str, Any]:
        return {
            "engine_args": list(self.options.args),
            "env": self.environment,
            "python": self.options.python,
            "grace_s": self.options.kill_grace_s,
            "startup_timeout_s": self.options.startup_timeout_s,
        }

    def inspect(self) -> EngineInfo:
        return self.restrict(LocalEngine.inspect(self))

    def identity(self) -> dict[str, Any]:
        return {**LocalEngine.identity(self), "engine": "server"}

    def before_stream(self, info: EngineInfo, job: EngineJob) -> None:
        self.server.engine_args = self.engine_arguments(info)
        report = job.work / LAUNCH_REPORT
        # The server's launcher checks the arguments and sizes its scheduler; the in-flight bound
        # follows the sizes it chose, read once the server started (or failed to).
        self.server.launch = self.launch(info, report)
        self.server.on_started = lambda: self.size_in_flight(report)
        if (api_server_count(self.server.engine_args) or 1) > 1:
            self.log.warning(
                "--api-server-count has no effect here: vLLM 0.32's python -m %s runs one API process (only "
                "'vllm serve' starts several). Use a warm server behind a vllm connection for that.",
                SERVER_MODULE,
            )

    def size_in_flight(self, report: Path) -> None:
        """Read what the server's launcher decided (a refused flag raises its error); bound the requests in flight by its sizes."""
        self.settle_launch(report)
        sizes = self.scheduler_sizes or SchedulerSizes(
            flags=[], max_num_seqs=None, max_num_batched_tokens=None, note=""
        )
        self.server.max_in_flight, why = started_server_in_flight(
            self.options.max_in_flight, sizes, self.server.engine_args
        )
        self.log.info("In flight: at most %d requests (%s)", self.server.max_in_flight, why)

    def gpus_for(self, job: EngineJob) -> Any:
        return self.leased_gpus(self.server.env, job.task)  # type: ignore[arg-type]  # a started server's env: the dict server_arguments() gave it


class ConnectionEngine(_Streaming):
    """A warm vLLM server (or a load-balanced deployment) behind a ``vllm`` connection: nothing is started.

    Its arguments are not the task's to know: the run identity holds the model and the
    vLLM version its ``/version`` reports, not ``engine_args``; nor its URL, so moving the
    connection to another replica of the same deployment keeps resuming.
    """

    name = "server"
    cost_basis = "vllm_connection"

    def server_arguments(self) -> dict[str, Any]:
        return {"vllm_conn_id": self.options.conn_id}

    @cached_property
    def model_cards(self) -> list[dict[str, Any]]:
        """The warm server's ``/v1/models`` cards, read once per try."""
        return self.server.warm_hook.model_cards()

    @cached_property
    def served(self) -> ServedModels:
        """The warm server's own ``/v1/models`` listing: the names it answers to."""
        return served_models_of_server(self.model_cards, self.settings.model)

    def reported_identity(self) -> dict[str, Any]:
        """The warm server's word on what shapes its answers: each model card's weights path, base and length.

        Its vLLM version (``/version``) is in the key already. A server restarted behind the
        same connection with other weights, another ``--max-model-len`` or other LoRA adapters
        reports other cards, so the answer cache misses; what it does not report (new weights
        written at the same path, ``--dtype``, ``--quantization``, ``--generation-config``) it
        cannot see (see the README's answer-cache section).
        """
        return {"models": reported_models(self.model_cards)}

    def inspect(self) -> EngineInfo:
        # The warm server's environment is not this worker's: ask the server itself.
        version = self.server.check()
        self.log.info(
            "Engine: the vLLM server of connection %r (vLLM %s) serves %s",
            self.options.conn_id,
            version or "of unknown version",
            self.settings.model,
        )
        return self.restrict(EngineInfo(vllm_version=version, supported_urls=FALLBACK_SUPPORTED_URLS))

    def identity(self) -> dict[str, Any]:
        return {"engine_command": None, "engine_args": None, "engine": "vllm_connection"}

    def before_stream(self, info: EngineInfo, job: EngineJob) -> None:
        self.server.max_in_flight, why = connection_in_flight(
            self.options.max_in_flight, self.server.warm_hook.max_in_flight
        )
        self.log.info("In flight: at most %d requests (%s)", self.server.max_in_flight, why)
        if (yielding := self.options.yielding) is not None:
            self.server.neighbour = self.neighbour_plan(yielding)

    def neighbour_plan(self, yielding: YieldToInteractive) -> NeighbourPlan:
        """How the batch yields to the server's other users: its priority (when the server takes one), its floor, what it reads."""
        hook = self.server.warm_hook
        said = hook.scheduling_policy()
        if said is not None:
            priority_ok, source = said == "priority", f"its /server_info says --scheduling-policy {said}"
            if yielding.priority_scheduling and not priority_ok:
                self.log.warning(
                    "YieldToInteractive(priority_scheduling=True), but the server says it runs --scheduling-policy %s: "
                    "its requests carry no priority. Start the server with --scheduling-policy priority.",
                    said,
                )
        elif yielding.priority_scheduling is not None:
            priority_ok, source = (
                yielding.priority_scheduling,
                f"YieldToInteractive(priority_scheduling={yielding.priority_scheduling})",
            )
        elif hook.stated_scheduling_policy is not None:
            priority_ok = hook.stated_scheduling_policy == "priority"
            source = f"the connection's scheduling_policy extra is {hook.stated_scheduling_policy!r}"
        else:
            priority_ok, source = (
                False,
                (
                    "the server does not say its scheduling policy (vLLM tells it only in its dev mode); if it runs "
                    '--scheduling-policy priority, set the connection\'s scheduling_policy extra to "priority" or '
                    "YieldToInteractive(priority_scheduling=True)"
                ),
            )
        urls = tuple(yielding.metrics_urls)
        plan = NeighbourPlan(
            priority=yielding.priority if priority_ok else None,
            min_in_flight=yielding.min_in_flight,
            metrics_urls=urls,
        )
        carried = f"carry priority {yielding.priority}" if priority_ok else "carry no priority"
        self.log.info("Yielding to interactive users: the batch's requests %s (%s).", carried, source)
        watched = (
            f"the /metrics of {len(urls)} servers"
            if urls
            else f"{redact_urls(hook.base_url)}/metrics (behind a load balancer, whichever replica answers each read: list "
            "every replica's in YieldToInteractive(metrics_urls=...))"
        )
        self.log.info(
            "Yielding to interactive users: in flight between %d and %d requests, following every %gs the load read at %s "
            "and the 429/503 answers; each progress line says the bound and why it last moved.",
            min(plan.min_in_flight, self.server.max_in_flight or plan.min_in_flight),
            self.server.max_in_flight,
            plan.check_every_s,
            watched,
        )
        return plan


class _CheckpointCounts:
    """The run's answers so far, completed and failed, counted as each checkpoint part goes up (:attr:`EngineJob.on_checkpoint`).

    The parts earlier tries left are counted once, when the stream starts; each new part is
    counted from its local file, so no part is read back from S3.
    """

    def __init__(self, job: EngineJob, staging: RunStaging, parts: list[str]) -> None:
        self.job = job
        self.seen: dict[str, bool] = {}
        if parts:
            with staging.open_parts(parts) as lines:
                for raw in lines:
                    self._count(raw)

    def _count(self, raw: bytes) -> None:
        from airflow_vllm_batch.batchfile.openai_lines import answer_outcome

        found = answer_outcome(raw)
        # Of a custom_id answered twice, a success is the one published, else the first (check_results).
        if found is not None and not self.seen.get(found[0], False):
            self.seen[found[0]] = found[1]

    def add(self, path: Path) -> None:
        """Count one sealed part and report the totals; a failing report never fails the run."""
        with open(path, "rb") as part:
            for raw in part:
                self._count(raw)
        completed = sum(self.seen.values())
        try:
            assert self.job.on_checkpoint is not None
            self.job.on_checkpoint({"completed": completed, "failed": len(self.seen) - completed})
        except Exception as err:  # noqa: BLE001 - the live counts are worth less than the run
            import logging

            logging.getLogger(__name__).warning("Could not report the run's progress: %s", err)


class _Progress:
    """The server engine's progress lines in the task log, and its final summary.

    :param log: the task's logger.
    :param total: the requests of the batch (preflight's valid lines).
    :param resumed: those answered by earlier tries' checkpoints.
    """

    def __init__(self, log: Any, total: int, resumed: int) -> None:
        self.log = log
        self.total = total
        self.resumed = resumed
        self._lowered = 0
        self._raised = 0

    def __call__(self, stats: StreamStats) -> None:
        done = self.resumed + stats.done
        rate = stats.requests_per_s
        eta = (self.total - done) / rate if rate > 0 else None
        self.log.info(
            "Progress: %d/%d requests (%.1f%%), %.1f requests/s, %.0f output tokens/s, %d failed, %d in flight%s, "
            "%d checkpointed, ETA %s",
            done,
            self.total,
            100.0 * done / self.total if self.total else 100.0,
            rate,
            stats.output_tokens_per_s,
            stats.failed,
            stats.in_flight,
            self.bound_note(stats),
            self.resumed + stats.durable,
            _duration(eta) if eta is not None else "unknown",
        )

    def bound_note(self, stats: StreamStats) -> str:
        """A yielding stream's bound: where it is, how often it moved since the last line, and why it last moved."""
        if stats.bound is None:
            return ""
        lowered, raised = stats.bound_lowered - self._lowered, stats.bound_raised - self._raised
        self._lowered, self._raised = stats.bound_lowered, stats.bound_raised
        last = f"; last {stats.bound_last_move}" if stats.bound_last_move else ""
        return f" (bound {stats.bound}: lowered {lowered}x, raised {raised}x since the last line{last})"

    def summary(self, stats: StreamStats) -> None:
        self.log.info(
            "Server engine done: %d requests sent and answered in %s (%.1f requests/s, %.0f output tokens/s), "
            "%d failed, %d retried, %d left without a final answer, %d answered by earlier tries' checkpoints; "
            "%d prompt and %d output tokens.",
            stats.done,
            _duration(stats.elapsed_s),
            stats.requests_per_s,
            stats.output_tokens_per_s,
            stats.failed,
            stats.retried,
            stats.unanswered,
            self.resumed,
            stats.prompt_tokens,
            stats.completion_tokens,
        )


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"
