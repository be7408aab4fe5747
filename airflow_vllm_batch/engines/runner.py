"""The runner engine: vLLM's offline batch runner, one process per try, bound to the task."""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from botocore.exceptions import BotoCoreError, ClientError

from airflow_vllm_batch.batchfile import open_lines, redact_urls
from airflow_vllm_batch.redaction import redact_engine_args
from airflow_vllm_batch.engines.base import EngineJob, EngineResults
from airflow_vllm_batch.engines.local import LocalEngine
from airflow_vllm_batch.exceptions import EngineError, InputChangedError, PublishError, StorageUnavailableError
from airflow_vllm_batch.hooks.vllm_engine import EngineInfo, EngineRun, VLLMEngineHook, build_engine_argv, conceal_arguments

if TYPE_CHECKING:
    from airflow_vllm_batch.batchfile import ResultsReport


class RunnerEngine(LocalEngine):
    """``python -m vllm.entrypoints.launchers.run_batch`` on this worker (or ``engine_command``).

    Its results are one file, made durable in the run's staging before anything else
    happens (a retry on any worker publishes them without running the engine again), or
    kept on the worker while S3 cannot take them.
    """

    name = "runner"
    entrypoint = "run_batch"

    @cached_property
    def hook(self) -> VLLMEngineHook:
        """Runs the engine process; kept so that :meth:`terminate` can stop it."""
        return VLLMEngineHook(kill_grace_s=self.settings.kill_grace_s)

    def produce(self, info: EngineInfo, job: EngineJob) -> EngineResults:
        """Make sure the run's finished results are staged in S3; run the engine only when they are not."""
        staging = job.staging
        staged = EngineResults(
            run=EngineRun(returncode=0, duration_s=0.0, vllm_version=info.vllm_version),
            open_results=staging.open_results,
            staged_results=True,
            staged_uri=staging.uri(staging.results_key),
        )
        if self.settings.resume and staging.has_results():
            self.log.info(
                "An earlier try of this run staged its results at %s: publishing them without running the engine.",
                staged.staged_uri,
            )
            return staged
        kept = job.kept_results
        if self.settings.resume and kept.exists():
            self.log.info(
                "An earlier try on this worker kept its results at %s: publishing them without running the engine again.",
                kept,
            )
            self.stage(job, kept)
            staged.open_results = lambda: open_lines(str(kept))
            return staged
        self.engine_arguments(info)
        engine_input = self.engine_input(job)
        if self.settings.output_mode == "presigned":
            output = job.input.presign("put_object", staging.bucket, staging.results_key)
            self.log.info("The engine uploads its results to %s", staged.staged_uri)
            staged.run = self.run_engine(info, engine_input, output, job)
            if not staging.has_results():
                raise EngineError(
                    f"The vLLM engine exited 0 but wrote no output to {staged.staged_uri} (its upload failed: see "
                    "'Failed to upload' in the log above). Last lines of its log:\n" + "\n".join(staged.run.tail[-15:])
                )
            self.confirm_input_unchanged(job)
            return staged
        local = job.work / "engine-results.jsonl"
        staged.run = self.run_engine(info, engine_input, str(local), job)
        if not local.exists():
            raise EngineError(
                "The vLLM engine exited 0 but wrote no output file. Last lines of its log:\n" + "\n".join(staged.run.tail[-15:])
            )
        # Durable first: whatever fails after this, the engine's work is not lost.
        self.stage(job, local)
        self.confirm_input_unchanged(job)
        staged.open_results = lambda: open_lines(str(local))
        return staged

    def engine_input(self, job: EngineJob) -> str:
        """What the engine reads: a presigned GET (pinned), a local path, or the http(s) URL."""
        if job.report.needs_rewrite:
            cleaned = job.work / "input.jsonl"
            if not job.input.in_s3:
                return str(cleaned)
            job.lease.ensure_held(verify=True)
            uri = job.staging.put_input(cleaned)
            self.log.info("The engine reads the cleaned copy %s", uri)
            return job.input.presign("get_object", job.staging.bucket, job.staging.input_key)
        return job.input.presigned_get() if job.input.in_s3 else job.input.uri

    def run_engine(self, info: EngineInfo, input_location: str, output_location: str, job: EngineJob) -> EngineRun:
        """Run the batch runner to completion; raise when it failed."""
        engine_args = self.engine_arguments(info)
        if not self.settings.engine_command and "output_tmp_dir" in info.runner_options and output_location.startswith("http"):
            # Without it vLLM holds a URL output in memory until its final PUT.
            engine_args += ["--output-tmp-dir", str(job.work)]
        argv = build_engine_argv(
            input_location=input_location,
            output_location=output_location,
            model=self.settings.model,
            engine_args=engine_args,
            engine_command=self.settings.engine_command,
            python=self.python,
            runner_module=info.runner_module,
        )
        env = self.settings.engine_environment
        self.log.info("Starting the vLLM engine: %s", redact_urls(" ".join(redact_engine_args(argv))))
        if not self.settings.engine_command:
            argv, hidden = conceal_arguments(argv)
            env.update(hidden)
        with self.leased_gpus(env, job.holder) as pass_fds:
            run = self.hook.run(argv, env=env, pass_fds=pass_fds)
        run.vllm_version = run.vllm_version or info.vllm_version
        self.log.info("vLLM engine exited with code %s after %.1fs", run.returncode, run.duration_s)
        if run.returncode != 0:
            how = f"was killed by signal {-run.returncode}" if run.returncode < 0 else f"exited with code {run.returncode}"
            if run.returncode in (-9, 137):
                how += " (SIGKILL: out of memory? see the kernel log)"
            raise EngineError(f"The vLLM engine {how}; nothing was published. Last lines of its log:\n" + "\n".join(run.tail[-15:]))
        return run

    def stage(self, job: EngineJob, path: Path) -> None:
        """Upload finished results to the run's staging; keep them on this worker if S3 fails."""
        try:
            job.lease.ensure_held(verify=True)
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
        """A runner whose engine core died exits 0 and answers every request it had left with a 500.

        vLLM 0.32 turns ``EngineDeadError`` into per-line errors: publishing them would turn
        an out-of-memory at 60 % into 40 % failed requests (and a non-retryable
        ``TooManyFailedRequestsError``, which a clear would then return as it is). The
        staged results are dropped and the try fails as transient: its retry runs again.
        """
        if not results.engine_failure:
            return
        job.staging.drop_results()
        job.kept_results.unlink(missing_ok=True)
        raise EngineError(
            f"The vLLM engine died during the run although it exited 0: {results.engine_dead_lines} of "
            f"{results.total} requests came back as its engine-dead error ({'; '.join(results.sample_errors[:3])}), "
            f"{results.completed} were answered. Nothing was published; the task's retry runs the batch again. "
            "Look for the engine's crash (often out of memory) earlier in this log."
        )

    def terminate(self) -> None:
        if "hook" in self.__dict__:
            self.hook.terminate()
