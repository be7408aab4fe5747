"""The runner engine: vLLM's offline batch runner, one process per try, bound to the task."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import uuid
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from botocore.exceptions import BotoCoreError, ClientError

from airflow_vllm_batch.batchfile import CustomIdIndex, open_lines, redact_urls
from airflow_vllm_batch.batchfile.models import decode_custom_id
from airflow_vllm_batch.batchfile.preflight import RUNNER_URL_ADVICE
from airflow_vllm_batch.docs_links import doc_ref
from airflow_vllm_batch.engines.base import EngineInfo, EngineJob, EngineResults, EngineRun, StopPoll
from airflow_vllm_batch.engines.checkpoint_parts import answered_requests, resumable_parts
from airflow_vllm_batch.engines.local import LAUNCH_REPORT, LocalEngine
from airflow_vllm_batch.engines.runner_deaths import (
    DEFAULT_SUSPECTS,
    ENGINE_CRASH,
    Death,
    Split,
    crash_line,
    engine_died_in_log,
    is_engine_dead_line,
    split_output,
    to_isolate,
    unanswered,
)
from airflow_vllm_batch.engines.stall import stall_bound, stall_message
from airflow_vllm_batch.engines.vllm.command import build_engine_argv, conceal_arguments
from airflow_vllm_batch.exceptions import (
    OOM_HINT,
    BatchStopped,
    EngineError,
    EngineStalledError,
    InputChangedError,
    PublishError,
    StorageUnavailableError,
)
from airflow_vllm_batch.hooks.vllm import VLLMEngineHook
from airflow_vllm_batch.redaction import redact_engine_args
from airflow_vllm_batch.serving.journal import part_name

if TYPE_CHECKING:
    from airflow_vllm_batch.batchfile import ResultsReport

#: Engine starts in one try after deaths, before the try fails for Airflow's retry (which goes on from the parts).
MAX_STARTS_PER_TRY = 4


def _how(run: EngineRun) -> str:
    """How an engine process ended, for messages."""
    if run.returncode == 0:
        return "exited 0"
    how = (
        f"was killed by signal {-run.returncode}"
        if run.returncode < 0
        else f"exited with code {run.returncode}"
    )
    if run.returncode in (-9, 137):
        how += OOM_HINT
    return how


class RunnerEngine(LocalEngine):
    """``python -m vllm.entrypoints.launchers.run_batch`` on this worker (or the options' ``command``).

    Its results are one file, made durable in the run's staging before anything else
    happens (a retry on any worker publishes them without running the engine again), or
    kept on the worker while S3 cannot take them.
    """

    name = "runner"
    entrypoint = "run_batch"
    #: Set by :meth:`terminate`: the task is being stopped.
    _stopped = False
    #: The last output read by :meth:`split`.
    _split: Split = Split()

    def url_advice(self) -> dict[str, str]:
        return dict(RUNNER_URL_ADVICE)

    @property
    def presign_seconds(self) -> int:
        """Seconds the presigned URLs stay valid: ``presign_expires_in``, or the task's whole time budget."""
        return self.settings.presign_seconds(self.options.presign_expires_in)

    @cached_property
    def hook(self) -> VLLMEngineHook:
        """Runs the engine process; kept so that :meth:`terminate` can stop it."""
        return VLLMEngineHook(kill_grace_s=self.options.kill_grace_s)

    def produce(self, info: EngineInfo, job: EngineJob) -> EngineResults:
        """Make sure the run's answers are staged in S3; run the engine only for what is not.

        A run that no engine death touched stages its results as one file, as before. When the
        engine dies, what it answered is staged as a checkpoint part and the engine runs again
        (up to :data:`MAX_STARTS_PER_TRY` times in this try, then Airflow's retry goes on) for
        the rest only, by the rule of :mod:`~airflow_vllm_batch.engines.runner_deaths`
        (invariants *Durability* and *Bounded*).
        """
        staging = job.staging
        staged = EngineResults(
            run=EngineRun(returncode=0, duration_s=0.0, vllm_version=info.vllm_version),
            open_results=staging.open_results,
            staged_results=True,
            staged_uri=staging.uri(staging.results_key),
        )
        if not self.settings.resume:
            # A new run from scratch: no earlier try's parts, deaths or results count.
            staging.remove()
        parts = staging.list_parts()
        if self.settings.resume and not parts and staging.has_results():
            self.log.info(
                "An earlier try of this run staged its results at %s: publishing them without running the engine.",
                staged.staged_uri,
            )
            return staged
        kept = job.kept_results
        if self.settings.resume and not parts and kept.exists():
            self.log.info(
                "An earlier try on this worker kept its results at %s: publishing them without running the engine again.",
                kept,
            )
            self.stage(job, kept)
            staged.open_results = lambda: open_lines(str(kept))
            return staged
        deaths = [Death.from_json(record) for record in staging.read_deaths()]
        total = job.report.valid_lines
        duration = 0.0
        for start in range(MAX_STARTS_PER_TRY + 1):
            parts, answered = resumable_parts(staging, job.report.custom_ids, self.log)
            # Requests, not answers: two tries' parts may answer one request twice (fix 5; simulator seed 2169
            # at fdc20fc: 13 answers of 7 requests taken for all 10, every try published nothing).
            if parts and answered_requests(job.report.custom_ids, answered, total) >= total:
                return self.from_parts(info, job, duration)
            if start == MAX_STARTS_PER_TRY:
                break
            if parts or deaths:
                self.log.info(
                    "Resuming after %d engine death(s): %d of %d requests are answered in %d checkpoint part(s) at %s.",
                    sum(d.died for d in deaths),
                    len(answered),
                    total,
                    len(parts),
                    staging.uri(staging.parts_prefix),
                )
            else:
                run = self.first_run(info, job, staged)
                if run is None:
                    return staged
                duration += run.duration_s
                deaths.append(self.settle_death(job, run, answered, [], deaths))
                continue
            isolate = to_isolate(deaths, answered)
            run, died = self.run_rest(info, job, answered, isolate, deaths)
            duration += run.duration_s
            if not died and not isolate:
                # A living engine answered all it was given: the results check says whether it did.
                return self.from_parts(info, job, duration)
        raise EngineError(
            f"The vLLM engine died in this try and was started {MAX_STARTS_PER_TRY} time(s) in all; the answers it "
            f"finished are staged at {staging.uri(staging.parts_prefix)}. Look for the engine's crash in the log above; "
            f"the task's retry sends only the rest ({doc_ref('Troubleshooting', 'The engine kept dying')})."
        )

    def first_run(self, info: EngineInfo, job: EngineJob, staged: EngineResults) -> EngineRun | None:
        """The engine over the whole batch; stage its results as one file (None: done) unless it died.

        :return: the run when the engine died (its answers are in :attr:`_answers`, not staged yet).
        """
        staging = job.staging
        self.engine_arguments(info)  # malformed or reserved options fail before anything is uploaded
        engine_input = self.engine_input(job)
        if self.options.output_mode == "presigned":
            output = job.input.presign(
                "put_object", staging.bucket, staging.results_key, expires_in=self.presign_seconds
            )
            self.log.info("The engine uploads its results to %s", staged.staged_uri)
        else:
            output = str(job.work / "engine-results.jsonl")
        run = self.start_engine(info, engine_input, output, job)
        staged.run = run
        if run.stalled_s is not None:
            self.settle_stall(job, run, output, whole=True)
        died = self.split(job, run, output, whole=True)
        if died is None:
            if self.options.output_mode == "presigned":
                self.confirm_input_unchanged(job)
                return None
            local = Path(output)
            # Durable first: whatever fails after this, the engine's work is not lost.
            self.stage(job, local)
            self.confirm_input_unchanged(job)
            staged.open_results = lambda: open_lines(str(local))
            return None
        # The engine read the input itself: its answers must answer the content preflight checked.
        self.confirm_input_unchanged(job)
        return run

    def run_rest(
        self,
        info: EngineInfo,
        job: EngineJob,
        answered: CustomIdIndex,
        isolate: list[str],
        deaths: list[Death],
    ) -> tuple[EngineRun, bool]:
        """The engine over what no part answers (or over the last death's suspects, isolated); stage what it answers.

        :return: the run, and whether the engine died.
        """
        staging = job.staging
        subset = job.work / "engine-input.jsonl"
        wanted = set(isolate)
        with job.request_lines() as lines, open(subset, "wb") as out:
            for raw in lines:
                if not raw.strip():
                    continue
                custom_id = decode_custom_id(raw).custom_id
                if answered.line_of(custom_id) is None and (not wanted or custom_id in wanted):
                    out.write(raw if raw.endswith(b"\n") else raw + b"\n")
        extra: list[str] = []
        if isolate:
            # One request in flight: the first unanswered request of a death is then the one in flight.
            extra = (
                ["--max-inflight", "1"] if "max_inflight" in info.runner_options else ["--max-num-seqs", "1"]
            )
            self.log.warning(
                "The engine runs the %d request(s) it may have had in flight at its last death alone, one at a time "
                "(%s), to tell which one kills it.",
                len(isolate),
                " ".join(extra),
            )
        engine_input = str(subset)
        if self.options.output_mode == "presigned" and job.input.in_s3:
            staging.put_input(subset)
            engine_input = job.input.presign(
                "get_object", staging.bucket, staging.input_key, expires_in=self.presign_seconds
            )
        output = (
            job.input.presign(
                "put_object", staging.bucket, staging.results_key, expires_in=self.presign_seconds
            )
            if self.options.output_mode == "presigned"
            else str(job.work / "engine-results.jsonl")
        )
        run = self.start_engine(info, engine_input, output, job, extra=extra)
        if run.stalled_s is not None:
            self.settle_stall(job, run, output)
        died = self.split(job, run, output)
        if died is None:
            if isolate:
                self.record(job, Death([], isolated=True, died=False, exit=_how(run)), deaths)
            return run, False
        deaths.append(self.settle_death(job, run, answered, isolate, deaths, run_input=subset))
        return run, True

    def split(self, job: EngineJob, run: EngineRun, output: str, whole: bool = False) -> bool | None:
        """Read what the engine wrote: None when it answered all it was given and lived; else stage its answers.

        :param whole: the engine ran the whole batch with no death before: when it lived, its
            output is left for the caller to stage as one file.

        A non-zero exit before any output, without vLLM's dead-engine error in its log (a bad
        flag, the model not loading), is the try's failure as before (:class:`EngineError`).

        :return: None (no death), or True after the answers of a death went into a part.
        """
        staging = job.staging
        presigned = output.startswith("http")
        exists = staging.has_results() if presigned else Path(output).exists()
        if run.returncode != 0 and not (exists or engine_died_in_log(run.tail)):
            raise self.engine_failed(run)
        if run.returncode == 0 and not exists:
            where = staging.uri(staging.results_key) if presigned else "its output file"
            raise EngineError(
                f"The vLLM engine exited 0 but wrote no output to {where} (an upload failure shows as 'Failed to upload' "
                "in the log above). Last lines of its log:\n" + "\n".join(run.tail[-15:])
            )
        # A stalled engine was stopped mid-run: its output, if any, ends where a death's would.
        died = run.returncode != 0 or run.stalled_s is not None

        def output_lines() -> contextlib.AbstractContextManager[Iterator[bytes]]:
            if not exists:
                return contextlib.nullcontext(iter(()))
            return staging.open_results() if presigned else open_lines(output)

        if not died and whole:
            # The common case, a whole batch: one read looking for vLLM 0.32's dead-engine lines, no copy,
            # and no S3 call before the caller stages the output (S3 failing then keeps it on the worker).
            with output_lines() as lines:
                if not any(is_engine_dead_line(raw, died=False) for raw in lines):
                    return None  # answered by a living engine: staged as one file by the caller
        part = job.work / part_name(len(staging.list_parts()))
        with output_lines() as lines, open(part, "wb") as answers:
            self._split = split_output(lines, answers, died=died)
        if len(self._split.answered):
            staging.put_part(part, uuid.uuid4().hex[:8])
        if presigned and exists:
            staging.drop_staged_output()
        if not died and not self._split.dead_lines:
            return None
        return True

    def settle_stall(self, job: EngineJob, run: EngineRun, output: str, whole: bool = False) -> NoReturn:
        """Stage what a stalled engine answered, as a dying one's (:meth:`split`), and fail the try as retryable.

        The stall is recorded as no death (the death rule's suspects are for engines that die): a
        retry, Airflow's, sends only what no checkpoint part answers (invariants *Bounded*, *Durability*).

        :param whole: the engine read the whole input itself (its answers must answer what preflight checked).
        """
        assert run.stalled_s is not None
        presigned = output.startswith("http")
        self._split = Split()
        if job.staging.has_results() if presigned else Path(output).exists():
            self.split(job, run, output, whole=whole)
        if whole:
            self.confirm_input_unchanged(job)
        answered = len(self._split.answered)
        self.log.warning(
            "The vLLM engine was stopped after %g s without progress; %d answer(s) it wrote are staged in a "
            "checkpoint part.",
            run.stalled_s,
            answered,
        )
        raise EngineStalledError(stall_message(run.stalled_s, answered))

    def settle_death(
        self,
        job: EngineJob,
        run: EngineRun,
        answered: CustomIdIndex,
        isolate: list[str],
        deaths: list[Death],
        run_input: Path | None = None,
    ) -> Death:
        """Record a death and its suspects; answer as failed the one request in flight at two deaths in a row."""
        if self._stopped:
            # The task is being stopped (on_kill): its answers are staged, its death is not the engine's.
            raise self.engine_failed(run)
        staging = job.staging
        opened = open_lines(str(run_input)) if run_input is not None else job.request_lines()
        with opened as lines:
            ids = (decode_custom_id(raw).custom_id for raw in lines if raw.strip())
            left = unanswered(ids, answered, self._split.answered)
            if isolate:
                suspects = list(itertools.islice(left, 1))
            else:
                sizes = self.scheduler_sizes
                limit = (
                    sizes.max_num_seqs if sizes is not None and sizes.max_num_seqs else None
                ) or DEFAULT_SUSPECTS
                suspects = list(itertools.islice(left, limit))
        how = _how(run)
        self.log.warning(
            "The vLLM engine died (%s) with %d request(s) of this run answered (staged in a checkpoint part) and %d "
            "answered as its dead-engine error.",
            how,
            len(self._split.answered),
            self._split.dead_lines,
        )
        death = Death(suspects, isolated=bool(isolate), exit=how)
        if isolate and suspects:
            crashed = suspects[0]
            part = job.work / "engine-crash.jsonl"
            part.write_bytes(crash_line(crashed, sum(d.died for d in deaths) + 1))
            staging.put_part(
                part.rename(job.work / part_name(len(staging.list_parts()))), uuid.uuid4().hex[:8]
            )
            self.log.warning(
                "custom_id %r was in flight at two engine deaths in a row, the second time alone: it is answered as "
                "failed (error code %s); the rest of the batch goes on.",
                crashed,
                ENGINE_CRASH,
            )
        elif suspects:
            self.log.warning(
                "Its suspects, the %d request(s) it may have had in flight (from custom_id %r), run next alone, one at a time.",
                len(suspects),
                suspects[0],
            )
        self.record(job, death, deaths)
        return death

    def record(self, job: EngineJob, death: Death, deaths: list[Death]) -> None:
        """Stage one record of the rule (a death, or an isolated run that lived), fenced by the lease."""
        job.staging.put_death(len(deaths), uuid.uuid4().hex[:8], death.to_json())
        if not death.died:
            deaths.append(death)

    def from_parts(self, info: EngineInfo, job: EngineJob, duration: float) -> EngineResults:
        """The run's answers: every checkpoint part, in order (a request answered twice keeps a success, else its first answer)."""
        return EngineResults(
            run=EngineRun(returncode=0, duration_s=duration, vllm_version=info.vllm_version),
            open_results=job.staging.open_parts,
            duplicates="first",
            staged_uri=job.staging.uri(job.staging.parts_prefix),
        )

    def engine_input(self, job: EngineJob) -> str:
        """What the engine reads: a presigned GET (pinned), a local path, or an http(s) URL without credentials.

        An http(s) URL with credentials is never given (*No secrets*): preflight copied it (``location_withheld``).
        """
        if job.report.needs_rewrite:
            cleaned = job.work / "input.jsonl"
            if not job.input.in_s3:
                return str(cleaned)
            uri = job.staging.put_input(cleaned)
            self.log.info("The engine reads the cleaned copy %s", uri)
            return job.input.presign(
                "get_object", job.staging.bucket, job.staging.input_key, expires_in=self.presign_seconds
            )
        return job.input.presigned_get(expires_in=self.presign_seconds) if job.input.in_s3 else job.input.uri

    def start_engine(
        self,
        info: EngineInfo,
        input_location: str,
        output_location: str,
        job: EngineJob,
        extra: list[str] | None = None,
    ) -> EngineRun:
        """Run the batch runner until it exits; what its exit means is :meth:`split`'s to say.

        :param extra: flags after the others (an isolated run's in-flight bound).
        """
        after = list(extra or ())
        if (
            not self.command
            and "output_tmp_dir" in info.runner_options
            and output_location.startswith("http")
        ):
            # Without it vLLM holds a URL output in memory until its final PUT.
            after += ["--output-tmp-dir", str(job.work)]
        argv = build_engine_argv(
            input_location=input_location,
            output_location=output_location,
            model=self.settings.model,
            engine_args=[*self.engine_arguments(info), *after],
            engine_command=self.command,
            python=self.python,
            runner_module=info.runner_module,
        )
        env = self.environment
        self.log.info("Starting the vLLM engine: %s", redact_urls(" ".join(redact_engine_args(argv))))
        report = job.work / LAUNCH_REPORT
        if not self.command:
            # The scheduler sizes go after the user's flags and before ``after`` (an isolated run's bound wins).
            launch = self.launch(info, report, insert_at=len(argv) - 3 - len(after))
            argv, hidden = conceal_arguments(argv, launch)
            env.update(hidden)
        # What the engine is given was decided by this try's reads of staging; staged results or a part
        # written since were written under another holder of the lease. Read the lease after them, so a
        # try paused before its engine starts (a zombie) does not answer again what its successor
        # answered (Durability, Fencing).
        job.lease.ensure_held(verify=True)
        job.raise_if_stopped()
        local = None if output_location.startswith("http") else Path(output_location)
        with (
            self.leased_gpus(env, job.task) as pass_fds,
            self.stopped_by(job) as stop,
            stall_bound(self.options.stall_timeout_s, local, self.hook.terminate, self.log) as stall,
        ):
            run = self.hook.run(argv, env=env, pass_fds=pass_fds, watch=stall.watch)
        run.stalled_s = stall.fired
        if stop.reason is not None:
            # The runner writes its answers only when it ends: a stopped runner made none durable. The run
            # layer publishes what earlier tries and deaths staged (Durability), the rest as unanswered.
            self.log.info("The vLLM engine was stopped: the batch %s.", stop.reason)
            raise BatchStopped(stop.reason)
        run.vllm_version = run.vllm_version or info.vllm_version
        self.log.info("vLLM engine exited with code %s after %.1fs", run.returncode, run.duration_s)
        # A refused flag stopped the engine before it loaded the model: the check's own error, not retried.
        self.settle_launch(report)
        return run

    @contextlib.contextmanager
    def stopped_by(self, job: EngineJob) -> Iterator[StopPoll]:
        """While the engine runs, poll the run's stop condition in a thread; stop the engine when it says so."""
        stop = StopPoll(job.stop)
        if job.stop is None:
            yield stop
            return
        done = threading.Event()

        def watch() -> None:
            while not done.wait(stop.every_s):
                try:
                    reason = stop()
                except Exception as err:  # noqa: BLE001 - a failing poll is no reason to stop
                    self.log.warning("Could not read whether the batch must stop: %s", err)
                    continue
                if reason is not None:
                    self.hook.terminate()
                    return

        watcher = threading.Thread(target=watch, name="vllm-batch-stop", daemon=True)
        watcher.start()
        try:
            yield stop
        finally:
            done.set()
            watcher.join()

    def engine_failed(self, run: EngineRun) -> EngineError:
        """The try's failure for an engine that exited non-zero."""
        return EngineError(
            f"The vLLM engine {_how(run)}; nothing was published. Last lines of its log:\n"
            + "\n".join(run.tail[-15:])
        )

    def stage(self, job: EngineJob, path: Path) -> None:
        """Upload finished results to the run's staging; keep them on this worker if S3 fails."""
        try:
            job.staging.put_results(path)
        except (BotoCoreError, ClientError) as err:
            kept = job.kept_results
            if path != kept:
                kept.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, kept)
            raise PublishError(
                f"S3 failed while staging the engine's results ({err}). They are kept at {kept} on "
                f"{os.uname().nodename}: a retry on this worker publishes them without running the engine; "
                "a retry elsewhere runs the batch again."
            ) from err

    def confirm_input_unchanged(self, job: EngineJob) -> None:
        """Fail when the engine may have read another content than preflight checked.

        A cleaned copy was made from the pinned content, and a VersionId pins the engine's
        GET itself; otherwise the engine read the key as it was at its start, so the ETag is
        compared again (after the results were staged, which a retry of this same run, same
        ETag, may then publish).
        """
        if not job.input.in_s3 or job.input.pinned.version_id or job.report.needs_rewrite:
            return
        try:
            job.input.confirm_unchanged()
        except InputChangedError:
            # The staged results answer content this run no longer describes.
            job.staging.drop_results()
            raise
        except StorageUnavailableError as err:
            # The results are staged already: say so, and that the retry publishes them (its
            # identity pins the input's ETag again, so changed content is a new run).
            raise PublishError(
                f"S3 failed while publishing: {err} The engine's results are staged at "
                f"{job.staging.uri(job.staging.results_key)}: a retry publishes them without running the engine again."
            ) from err

    def classify(self, results: ResultsReport, job: EngineJob) -> None:
        """Staged results that still hold vLLM 0.32's dead-engine lines are not published.

        :meth:`produce` splits a dying runner's output before staging it; only a try killed
        between a presigned upload and that split leaves such a file: it is dropped (its
        checkpoint parts stay) and the try fails as transient, for a retry that runs the rest.
        """
        if not results.engine_failure:
            return
        job.staging.drop_staged_output()
        job.kept_results.unlink(missing_ok=True)
        raise EngineError(
            f"The vLLM engine died during the run although it exited 0: {results.engine_dead_lines} of "
            f"{results.total} requests got its engine-dead error ({'; '.join(results.sample_errors[:3])}) and "
            f"{results.completed} were answered; nothing was published. Look for its crash (often out of memory) "
            "earlier in this log; the task's retry runs the rest."
        )

    def terminate(self) -> None:
        # No engine starts again after a death once the task is being stopped.
        self._stopped = True
        if "hook" in self.__dict__:
            self.hook.terminate()
