"""One batch run from settings to manifest: input, identity, preflight, engine, check, publish.

:class:`BatchRun` is the run protocol; the operator only feeds it settings and a task
instance and turns its outcome into XCom, a link and asset events. The steps:

1. the input: ``requests=`` written to S3 (by content hash), then pinned (ETag/VersionId);
2. the engine is asked what it serves; the run identity is the fingerprint of what shapes
   the results; a complete output under the same identity is returned as it is;
3. the output's lease is taken (one writer per output) and checked again before every write;
   with it taken, a complete output is looked for again (a zombie predecessor may have
   published it since the first look);
4. preflight checks every line before any engine starts; with ``answer_cache_uri``, the
   requests the answer cache holds are answered from it (:mod:`.answer_cache`), and only
   the others go on (no engine starts when none is left);
5. the engine makes the answers durable in the run's staging (running only for what no
   earlier try left there);
6. the results check: every request answered exactly once; what the results say about
   the engine itself (a dead engine is the try's failure, retried, never published);
7. publish: results, error file, then the manifest, last; the staging is removed;
8. the engine's new answers go into the answer cache (a failure there is only a warning).

One module because :class:`BatchRun` is the run protocol itself: its steps are methods that
share the run's state (the pinned input, the identity, the lease, the staging) and must keep
the order above; split across modules, that order (and what docs/protocol.md and the mutation
catalogue point at) would no longer be read in one place. The steps' machinery lives elsewhere
already (:mod:`.settings`, :mod:`.answer_cache`, the storage and engines layers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from botocore.exceptions import BotoCoreError, ClientError

from airflow_vllm_batch.batchfile import (
    PreflightOptions,
    PreflightReport,
    ResultsReport,
    check_results,
    open_lines,
    preflight,
)
from airflow_vllm_batch.batchfile.cache_keys import model_identity
from airflow_vllm_batch.batchfile.openai_lines import request_ids, split_stopped, to_openai_line
from airflow_vllm_batch.batchfile.per_model import count_per_model
from airflow_vllm_batch.engines import EngineJob, EngineResults
from airflow_vllm_batch.engines.base import EngineRun
from airflow_vllm_batch.engines.checkpoint_parts import invalid_parts
from airflow_vllm_batch.exceptions import BatchStopped, PreflightError, PublishError, StorageUnavailableError
from airflow_vllm_batch.identity import RunIdentity
from airflow_vllm_batch.lease import LeaseHolder, TaskTry
from airflow_vllm_batch.manifest import Manifest, RequestCounts, Usage
from airflow_vllm_batch.run.answer_cache import CACHED_RESULTS, AnswerCache
from airflow_vllm_batch.run.cost import run_cost, split_cost
from airflow_vllm_batch.run.inputs import BatchInput, write_requests
from airflow_vllm_batch.scratch import concat, kept_results, maybe_open, scratch
from airflow_vllm_batch.storage.publishing import OutputStore
from airflow_vllm_batch.storage.s3 import s3_lines
from airflow_vllm_batch.summary import FailureExample, FailureTally, tally_failures

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from airflow_vllm_batch.engines import Engine
    from airflow_vllm_batch.engines.base import EngineInfo
    from airflow_vllm_batch.lease import OutputLease
    from airflow_vllm_batch.log_groups import TaskLog
    from airflow_vllm_batch.run.settings import BatchSettings
    from airflow_vllm_batch.storage.staging import RunStaging


@dataclass
class BatchOutcome:
    """What a run returns: the manifest, whether it was already published, one failed request per reason."""

    manifest: Manifest
    resumed: bool
    failure_examples: dict[str, FailureExample] | None = None


class BatchRun:
    """One batch run of one task try.

    :param settings: the checked settings.
    :param s3_hook: the S3 hook of ``aws_conn_id``.
    :param engine: the engine that answers the requests.
    :param task: who this try is, and whether it is the task's last.
    :param log: the task's logger.
    :param stop: the run's stop condition, polled under the lease before preflight and by the engine
        between requests: ``"expired"`` or ``"cancelled"`` stops the run, which then publishes what
        is answered so far (:meth:`publish_stopped`); None goes on. Default: never stops.
    :param on_checkpoint: called with the answers so far (``{"completed", "failed"}``) after each checkpoint.
    :param write_once: the output is published once and never again: a published manifest of the pinned
        input is returned whatever run identity wrote it (:meth:`OutputStore.ended`), before the lease and
        again under it (an OpenAI API batch: an ended batch never changes). Default False: a complete
        output of this identity only.
    """

    def __init__(
        self,
        settings: BatchSettings,
        *,
        s3_hook: S3Hook,
        engine: Engine,
        task: TaskTry,
        log: TaskLog,
        stop: Callable[[], str | None] | None = None,
        on_checkpoint: Callable[[Mapping[str, int]], None] | None = None,
        write_once: bool = False,
    ) -> None:
        self.settings = settings
        self.write_once = write_once
        self.stop = stop
        self.on_checkpoint = on_checkpoint
        self.s3_hook = s3_hook
        self.engine = engine
        self.task = task
        self.log = log
        #: The run's input once pinned (the manifest's and the lineage's input).
        self.input: BatchInput | None = None

    @cached_property
    def store(self) -> OutputStore:
        """The output's objects in S3: staging, publishing, manifest and lease."""
        return OutputStore(self.s3_hook, self.settings.output_uri, self.settings.error_uri)

    @property
    def request_model_name(self) -> str:
        """The name written into requests that name none: ``model`` when the engine answers to it, else its first served name."""
        served = self.engine.served
        return self.settings.model if self.settings.model in served.names else served.default_name

    def execute(self) -> BatchOutcome:
        """Identify the run; return its published output, or run, check and publish it."""
        started = time.monotonic()
        self.engine.gpu_plan()  # settings that cannot fit the worker fail before any I/O
        try:
            uri = self.settings.input_uri
            if self.settings.requests is not None:
                uri = write_requests(self.s3_hook, self.settings, self.request_model_name)
            assert uri is not None  # input_uri or requests: exactly one is given (checked at parse time)
            self.input = BatchInput.pin(self.s3_hook, self.settings, uri)
            info = self.engine.inspect()
            if self.settings.supported_urls:
                info = dataclasses.replace(info, supported_urls=self.settings.supported_urls)
            identity = self.identity(info)
            manifest = self.published(identity)
        except BotoCoreError as err:
            raise self.s3_unreachable(err) from err
        if manifest is not None:
            return BatchOutcome(manifest, resumed=True)
        self.store.check_writable()
        with self.store.lease(self.lease_holder(identity)) as lease:
            # Durability: the check above ran before the lease was ours. A try that held it then (a
            # zombie whose successor this is) may have published since, and removed the staging:
            # running now would redo its answers and overwrite its output with this try's.
            try:
                manifest = self.published(identity, again=True)
            except BotoCoreError as err:
                raise self.s3_unreachable(err) from err
            if manifest is not None:
                return BatchOutcome(manifest, resumed=True)
            return self.run_batch(info, identity, lease, started)

    def s3_unreachable(self, err: BotoCoreError) -> StorageUnavailableError:
        """The retryable error of S3 out of reach before anything ran."""
        return StorageUnavailableError(
            f"Cannot reach S3 with connection {self.settings.aws_conn_id!r} ({err}). Nothing was run; check that "
            "S3 is reachable from this worker. The task is retried."
        )

    def identity(self, info: EngineInfo) -> RunIdentity:
        """Everything that shapes the results (see :mod:`airflow_vllm_batch.identity`)."""
        assert self.input is not None
        s = self.settings
        return RunIdentity(
            {
                "input": self.input.pinned.components(),
                "model": s.model,
                "vllm_version": info.vllm_version,
                "default_body": dict(s.default_body),
                "rewrite_model": bool(s.rewrite_model),
                "invalid_lines": s.invalid_lines,
                "max_lines": s.max_lines,
                "max_line_bytes": s.max_line_bytes,
                "supported_urls": sorted(s.supported_urls) if s.supported_urls else None,
                "error_uri": self.store.error_uri,
                **self.engine.identity(),
                # Only when set: the identities of runs without a schema stay as they were.
                **({"output_type": s.output_schema.identity()} if s.output_schema is not None else {}),
                # Only when set: the identities of runs without the cache stay as they were.
                **(
                    {"answer_cache": {"uri": s.answer_cache_uri, "sampled": s.answer_cache_sampled}}
                    if s.answer_cache_uri
                    else {}
                ),
                # Only when set: the operator's identities stay as they were.
                **({"result_shape": s.result_shape} if s.result_shape != "vllm" else {}),
            }
        )

    def published(self, identity: RunIdentity, again: bool = False) -> Manifest | None:
        """The manifest of a complete output made under this identity, if there is one.

        :param again: whether this is the check once the lease is taken (it says nothing when
            there still is no complete output: the first check said so).
        """
        if self.write_once:
            assert self.input is not None  # pinned by execute()
            manifest, why = self.store.ended(self.input.pinned.etag)
        elif not self.settings.resume:
            return None
        else:
            manifest, why = self.store.completed(identity)
        if manifest is None:
            if not again:
                self.log.info("Running: %s (run %s).", why, identity.short)
            return None
        self.log.info(
            "Not running the engine again: %s (run %s, %s).%s",
            why,
            identity.short,
            self.store.manifest_uri,
            "" if self.write_once else " Set resume=False to force a new run.",
        )
        return manifest

    def adopt_durable_answers(self, identity: RunIdentity, staging: RunStaging) -> None:
        """Durability across an identity change, for a write-once output: earlier identities' durable answers become this run's.

        The input of a write-once output never changes (an OpenAI API batch pins the API's copy by
        its signed ETag), so an answer another identity made durable (a try before a vLLM upgrade)
        still answers its request: it is copied into this run's staging (under the lease), the
        engine resumes from it, and a stopped run publishes it.
        """
        for other in self.store.other_stagings(identity):
            adopted = staging.adopt(other)
            if adopted:
                self.log.info(
                    "Keeping the answers another run of this batch made durable (run %s, another identity: %d object(s)).",
                    other.prefix.rstrip("/").rsplit("/", 1)[-1],
                    adopted,
                )

    def lease_holder(self, identity: RunIdentity) -> LeaseHolder:
        """Who this try is, for the output's lease."""
        return LeaseHolder.of_try(self.task, identity.fingerprint)

    def stop_reason(self) -> str | None:
        """Why the run must stop now (``"expired"``, ``"cancelled"``: the ``stop`` condition), or None."""
        return self.stop() if self.stop is not None else None

    def run_batch(
        self, info: EngineInfo, identity: RunIdentity, lease: OutputLease, started: float
    ) -> BatchOutcome:
        """Preflight, have the engine make its answers durable, check and publish; or publish a stopped run's answers."""
        assert self.input is not None  # pinned by execute()
        staging = self.store.staging(identity)
        if self.write_once:
            self.adopt_durable_answers(identity, staging)
        kept = kept_results(self.settings.results_dir, identity.short)
        with scratch(self.settings.results_dir, identity.short) as work:
            # Under the lease, before preflight: a batch stopped before its task ran publishes without an engine.
            stopped = self.stop_reason()
            if stopped is None:
                try:
                    report = self.preflight(info, work)
                    job = EngineJob(
                        input=self.input,
                        report=report,
                        work=work,
                        staging=staging,
                        identity=identity,
                        lease=lease,
                        task=self.task,
                        kept_results=kept,
                        stop=self.stop,
                        on_checkpoint=self.on_checkpoint,
                    )
                    cache = self.answer_cache(info)
                    split = cache.split(job) if cache is not None else None
                    if split is not None:
                        job = split.job  # the misses only, when some hit
                    job.raise_if_stopped()
                    engine_results = self.produce(info, job)
                except BatchStopped as stop:
                    stopped = stop.reason
            if stopped is not None:
                return self.publish_stopped(
                    stopped,
                    identity=identity,
                    lease=lease,
                    staging=staging,
                    work=work,
                    kept=kept,
                    started=started,
                )
            try:
                # Inside the try: the results are staged by now, so S3 failing here is a publish
                # failure that a retry recovers without the engine (not a bare connection error).
                lease.ensure_held(verify=True)
                results = self.check(job, engine_results)
                engine_tokens = results.total_tokens
                if cache is not None and split is not None:
                    cache.collect(work / "results.jsonl")
                    split.add_to(results, work / "results.jsonl")
                errors_path = self.error_file(report, work, results)
                failures = self.tally_failures(errors_path)
                manifest = self.build_manifest(
                    identity,
                    report=report,
                    results=results,
                    engine_results=engine_results,
                    started=started,
                    failures=failures,
                )
                manifest.from_cache = split.hits if split is not None else None
                manifest.per_model = self.per_model(report, results, work)
                self.price(
                    manifest, engine_results=engine_results, started=started, engine_tokens=engine_tokens
                )
                # With no failed line (and no cached answer added) a staged results file is the output byte for
                # byte: copy it server side (not when the lines are reshaped).
                copy_staged = (
                    not results.request_counts["failed"]
                    and engine_results.staged_results
                    and not manifest.from_cache
                    and self.settings.result_shape == "vllm"
                )
                self.publish_files(
                    manifest, staging, None if copy_staged else work / "results.jsonl", errors_path
                )
                kept.unlink(missing_ok=True)
            except (BotoCoreError, ClientError) as err:
                raise PublishError(
                    f"S3 failed while publishing ({err}). The engine's results are staged at {engine_results.staged_uri}: "
                    "a retry publishes them without running the engine again."
                ) from err
            if cache is not None:
                cache.store()
        self.log.info(
            "Published %s (%d completed, %d failed)",
            self.settings.output_uri,
            manifest.request_counts.completed,
            manifest.request_counts.failed,
        )
        return BatchOutcome(manifest, resumed=False, failure_examples=failures.examples)

    def publish_files(
        self, manifest: Manifest, staging: RunStaging, results_path: Path | None, errors_path: Path | None
    ) -> None:
        """Publish through :meth:`OutputStore.publish`, the lines first put in ``result_shape`` (OpenAI's, for the API).

        The shape is changed here, on the checked local files right before they go up: the
        results check saw vLLM's lines (exactly once is a matter of custom_ids, which the shape
        keeps), and the manifest's ETags name the very bytes a reader downloads.
        """
        if self.settings.result_shape == "openai":
            results_path = _reshaped(results_path) if results_path is not None else None
            errors_path = _reshaped(errors_path) if errors_path is not None else None
        self.store.publish(manifest, staging=staging, results_path=results_path, errors_path=errors_path)

    def durable_answers(
        self, staging: RunStaging, kept: Path
    ) -> list[contextlib.AbstractContextManager[Iterator[bytes]]]:
        """Every source of this run's durable answers: staged results, checkpoint parts, cached hits, results kept on this worker."""
        sources: list[contextlib.AbstractContextManager[Iterator[bytes]]] = []
        if staging.has_results():
            sources.append(staging.open_results())
        sources.append(staging.open_parts())
        hits_key = f"{staging.prefix}{CACHED_RESULTS}"
        if self.s3_hook.head_object(hits_key, bucket_name=staging.bucket) is not None:
            sources.append(s3_lines(self.s3_hook, staging.bucket, hits_key))
        if kept.exists():
            sources.append(open_lines(str(kept)))
        return sources

    def publish_stopped(
        self,
        reason: str,
        *,
        identity: RunIdentity,
        lease: OutputLease,
        staging: RunStaging,
        work: Path,
        kept: Path,
        started: float,
    ) -> BatchOutcome:
        """Publish what a stopped run answered, the rest as ``batch_<reason>`` lines, with a manifest whose status is ``reason``.

        Through :meth:`OutputStore.publish` under the lease, as any output (tombstone, conditional
        writes, the manifest last, the staging removed fenced): Exactly once (each of the input's
        custom_ids once, its first durable answer or its ``batch_<reason>`` line), Fencing, and
        Durability (every durable answer of the run is read: staged results, checkpoint parts, the
        answer cache's staged hits, results kept on this worker).
        """
        assert self.input is not None
        self.log.info(
            "The batch is %s: publishing the answers made durable so far, the rest as unanswered.", reason
        )
        results_path, errors_path = work / "stopped-results.jsonl", work / "stopped-errors.jsonl"
        try:
            lease.ensure_held(verify=True)
            with contextlib.ExitStack() as stack:
                answers = itertools.chain.from_iterable(
                    stack.enter_context(source) for source in self.durable_answers(staging, kept)
                )
                requests = request_ids(stack.enter_context(self.input.open()))
                with open(results_path, "wb") as results, open(errors_path, "wb") as errors:
                    counts = split_stopped(answers, requests, results, errors, reason)
            usage = _usage_of(results_path)
            manifest = Manifest(
                output_uri=self.settings.output_uri,
                error_uri=self.store.error_uri if counts["failed"] else None,
                input_uri=self.input.display_uri,
                input_etag=self.input.pinned.etag,
                model=self.settings.model,
                request_counts=RequestCounts(**counts),
                usage=Usage(**usage),
                duration_s=round(time.monotonic() - started, 3),
                vllm_version=None,
                fingerprint=identity.fingerprint,
                identity=dict(identity.components),
                manifest_uri=self.store.manifest_uri,
                status=reason,
            )
            self.publish_files(manifest, staging, results_path, errors_path if counts["failed"] else None)
            kept.unlink(missing_ok=True)
        except (BotoCoreError, ClientError) as err:
            raise PublishError(
                f"S3 failed while publishing the {reason} batch's answers ({err}). They stay staged: a retry publishes them."
            ) from err
        self.log.info(
            "Published the %s batch %s (%d completed, %d failed or unanswered)",
            reason,
            self.settings.output_uri,
            counts["completed"],
            counts["failed"],
        )
        return BatchOutcome(manifest, resumed=False)

    def answer_cache(self, info: EngineInfo) -> AnswerCache | None:
        """The answer cache of ``answer_cache_uri``, keyed to this engine's model identity; None when off."""
        s = self.settings
        if not s.answer_cache_uri:
            return None
        engine = self.engine.identity()
        digest = model_identity(
            model=s.model,
            vllm_version=info.vllm_version,
            engine_args=engine.get("engine_args"),  # None for a warm server: not the task's to know
            engine_command=engine.get("engine_command"),
            served_names=self.engine.served.names,
            reported=self.engine.reported_identity(),  # a warm server's cards: restarted with other weights, a miss
        )
        return AnswerCache(
            self.s3_hook,
            s.answer_cache_uri,
            model_digest=digest,
            sampled=s.answer_cache_sampled,
            resume=s.resume,
            log=self.log,
        )

    def produce(self, info: EngineInfo, job: EngineJob) -> EngineResults:
        """The engine's answers to the job's requests; no engine at all when the answer cache answered every one."""
        if job.report.valid_lines == 0 and job.report.answered_from_cache:
            self.log.info("Every request was answered from the answer cache: no engine runs.")
            return EngineResults(
                run=EngineRun(returncode=0, duration_s=0.0, vllm_version=info.vllm_version),
                open_results=lambda: contextlib.nullcontext(iter(())),
            )
        return self.engine.produce(info, job)

    def preflight(self, info: EngineInfo, work: Path) -> PreflightReport:
        """Check the whole input before any engine starts; write a cleaned copy when needed."""
        assert self.input is not None
        s, served, batch_input = self.settings, self.engine.served, self.input
        options = PreflightOptions(
            supported_urls=info.supported_urls,
            model=self.request_model_name,
            model_names=frozenset(served.names) if served.names != (s.model,) else frozenset(),
            rewrite_model=s.rewrite_model,
            default_body=dict(s.default_body),
            invalid_lines=s.invalid_lines,
            max_lines=s.max_lines,
            max_line_bytes=s.max_line_bytes,
            model_kind=info.model_kind,
            response_format=s.output_schema.response_format() if s.output_schema is not None else None,
            url_advice=self.engine.url_advice(),
        )
        withheld = batch_input.withheld
        if withheld:
            self.log.info(
                "The input URL carries credentials: the engine reads this task's checked copy of it, never the URL."
            )
        with batch_input.open() as lines:
            # The engine cannot read gzip: a compressed input gets an uncompressed cleaned copy.
            rewriting = (
                s.skips_invalid_lines
                or s.rewrite_model
                or bool(s.default_body)
                or s.output_type is not None
                or getattr(lines, "compression", None) is not None
                or withheld
            )
            with (
                maybe_open(work / "input.jsonl", rewriting) as cleaned,
                maybe_open(work / "preflight-errors.jsonl", rewriting) as errors,
            ):
                report = preflight(
                    lines,
                    options,
                    cleaned_out=cleaned,
                    errors_out=errors,
                    reread=batch_input.open,
                    withhold_location=withheld,
                )
        report.source = batch_input.display_uri
        if not s.skips_invalid_lines or not report.runnable:
            # A file that cannot run is told once, by the error (the same lines as the report).
            report.raise_for_problems(batch_input.display_uri)
        self.log.info("%s", report.format())
        if not report.valid_lines:
            raise PreflightError(f"{batch_input.display_uri} has no request line: nothing to run.", report)
        self.engine.check_requests(info, report)
        return report

    def check(self, job: EngineJob, engine_results: EngineResults) -> ResultsReport:
        """Check that the results answer every request exactly once; drop them from staging if not.

        The requests' custom_ids come from preflight's index, so the input is not read again
        (only to name missing requests, on a mismatch). Successful lines go to
        ``results.jsonl``, failed ones to ``engine-errors.jsonl`` in the scratch directory.
        Results assembled from checkpoint parts (``duplicates="first"``) keep one answer of a
        custom_id answered twice (two tries that both answered it): a success rather than a
        failure, else the first. On a mismatch only
        what is invalid is dropped (:meth:`drop_invalid`).
        """
        with (
            engine_results.open_results() as result_lines,
            open(job.work / "results.jsonl", "w+b") as successes,
            open(job.work / "engine-errors.jsonl", "w+b") as errors,
        ):
            results = check_results(
                result_lines,
                input_index=job.report.custom_ids,
                results_out=successes,
                errors_out=errors,
                reread_input=job.request_lines,
                reread_results=engine_results.open_results,
                source="the engine's results",
                duplicates=engine_results.duplicates,
                output_schema=self.settings.output_schema,
            )
        self.log.info("%s", results.format())
        if results.dropped_duplicates:
            self.log.warning(
                "%d repeated answer(s) of requests answered twice (in the checkpoints of two tries) were left out; "
                "one answer of each is published, a success rather than a failure, else the first.",
                results.dropped_duplicates,
            )
        self.engine.classify(results, job)
        if not results.ok:
            self.drop_invalid(job, engine_results, results)
        results.raise_for_mismatch()
        return results

    def drop_invalid(self, job: EngineJob, engine_results: EngineResults, results: ResultsReport) -> None:
        """Drop from staging what failed the results check, and nothing else (Durability).

        A staged results file is one engine run's whole answer: when it does not answer the
        input it goes, so that no later try publishes it, and so does this worker's kept copy
        of it (else every retry here would stage the same file again and never run the
        engine). Checkpoint parts
        (``duplicates="first"``) are kept unless they hold an unreadable line or an answer to a
        custom_id not in the input: a request merely missing leaves every part in place, and
        the next try resumes from them and sends only what they do not answer.
        """
        if engine_results.duplicates != "first":
            job.staging.drop_results()
            job.kept_results.unlink(missing_ok=True)
            return
        if results.unparseable_count or results.extra_count:
            bad = invalid_parts(job.staging, job.report.custom_ids)
            if bad:
                self.log.warning(
                    "Dropping %d checkpoint part(s) that hold answers this run cannot publish: %s",
                    len(bad),
                    ", ".join(bad),
                )
                job.staging.drop_parts(bad)

    def error_file(self, report: PreflightReport, work: Path, results: ResultsReport) -> Path | None:
        """The failed lines (preflight's, then the engine's) as one file, or None when none failed."""
        if not (results.request_counts["failed"] or self.skipped(report)):
            return None
        return concat(
            work / "all-errors.jsonl", work / "preflight-errors.jsonl", work / "engine-errors.jsonl"
        )

    def tally_failures(self, errors_path: Path | None) -> FailureTally:
        """Count the failed requests by reason; keep one example of each for the summary table."""
        if errors_path is None:
            return FailureTally(counts={}, examples={})
        with open_lines(str(errors_path)) as lines:
            return tally_failures(lines)

    def build_manifest(
        self,
        identity: RunIdentity,
        *,
        report: PreflightReport,
        results: ResultsReport,
        engine_results: EngineResults,
        started: float,
        failures: FailureTally,
    ) -> Manifest:
        """The manifest of this run's publication."""
        assert self.input is not None
        counts = results.request_counts
        skipped = self.skipped(report)
        failed = counts["failed"] + skipped
        run = engine_results.run
        return Manifest(
            output_uri=self.settings.output_uri,
            error_uri=self.store.error_uri if failed else None,
            input_uri=self.input.display_uri,
            input_etag=self.input.pinned.etag,
            model=self.settings.model,
            request_counts=RequestCounts(
                total=counts["total"] + skipped, completed=counts["completed"], failed=failed
            ),
            usage=Usage(**results.usage),
            duration_s=round(time.monotonic() - started, 3),
            engine_duration_s=round(run.duration_s, 3),
            vllm_version=run.vllm_version,
            fingerprint=identity.fingerprint,
            identity=dict(identity.components),
            manifest_uri=self.store.manifest_uri,
            failed_by_reason=failures.counts or None,
            invalid_output=results.invalid_output or None,
        )

    def price(
        self, manifest: Manifest, *, engine_results: EngineResults, started: float, engine_tokens: int
    ) -> None:
        """Fill in the manifest's ``cost``, and each model's share of it when the run was priced.

        :param engine_tokens: the tokens the engine itself answered in this run (not the cached answers').
        """
        manifest.cost = run_cost(
            device=self.engine.cost_basis,
            gpus=self.engine.gpu_plan().count,
            engine_s=engine_results.run.duration_s,
            task_s=time.monotonic() - started,
            total_tokens=engine_tokens,
            gpu_hour_cost=self.engine.gpu_hour_cost,
        )
        if manifest.cost.cost is not None and manifest.per_model:
            manifest.per_model = split_cost(manifest.per_model, manifest.cost.cost)

    def per_model(
        self, report: PreflightReport, results: ResultsReport, work: Path
    ) -> dict[str, dict[str, int | float]]:
        """Requests and tokens per model name (one pass over the results when the engine serves several names)."""
        served = self.engine.served
        if len(served.names) == 1 and len(report.requests_per_model) <= 1:
            # One name: the totals are its counts, no second pass.
            counts = results.request_counts
            entry = {
                "requests": counts["total"],
                "completed": counts["completed"],
                "failed": counts["failed"],
            }
            return {served.default_name: {**entry, **results.usage}}
        with open_lines(str(work / "results.jsonl")) as successes:
            counted = count_per_model(
                successes,
                report.requests_per_model,
                default_name=served.default_name,
                aliases=dict.fromkeys(served.base_names, served.default_name),
            )
        # Counts now; split_cost adds each model's (float) cost to them later.
        return {name: dict(figures) for name, figures in counted.items()}

    def skipped(self, report: PreflightReport) -> int:
        return report.invalid_lines if self.settings.skips_invalid_lines else 0


def _reshaped(path: Path) -> Path:
    """A copy of a results or error file with every line in OpenAI's shape (:func:`to_openai_line`)."""
    target = path.with_name(path.stem + ".openai.jsonl")
    with open(path, "rb") as lines, open(target, "wb") as out:
        for raw in lines:
            if raw.strip():
                out.write(to_openai_line(raw))
    return target


def _usage_of(results_path: Path) -> dict[str, int]:
    """The tokens the completed answers of a results file report."""
    import msgspec

    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    with open(results_path, "rb") as lines:
        for raw in lines:
            body = (msgspec.json.decode(raw).get("response") or {}).get("body") or {}
            for key in usage:
                usage[key] += int((body.get("usage") or {}).get(key) or 0)
    return usage
