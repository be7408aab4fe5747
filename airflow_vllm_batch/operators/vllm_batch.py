"""The operator: one vLLM offline batch run from an input file to an S3 output."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from airflow.sdk import Asset, BaseOperator
from airflow.sdk.exceptions import AirflowFailException
from airflow.sdk.log import mask_secret
from botocore.exceptions import BotoCoreError, ClientError

from airflow_vllm_batch.batchfile import (
    PreflightOptions,
    PreflightReport,
    ResultsReport,
    check_results,
    open_lines,
    preflight,
)
from airflow_vllm_batch.engine_output import DEFAULT_RESULTS_DIR, LocalEngineOutput, StagedEngineOutput
from airflow_vllm_batch.exceptions import (
    EngineError,
    PreflightError,
    PresignError,
    PublishError,
    TooManyFailedRequestsError,
    VLLMBatchError,
)
from airflow_vllm_batch.hooks.vllm_engine import (
    FALLBACK_SUPPORTED_URLS,
    EngineInfo,
    EngineRun,
    VLLMEngineHook,
    build_engine_argv,
    conceal_arguments,
    probe_engine,
    redact_urls,
)
from airflow_vllm_batch.lineage import lineage_for
from airflow_vllm_batch.links.output import VLLMBatchOutputLink
from airflow_vllm_batch.output_files import default_error_uri, manifest_uri, s3_lines

if TYPE_CHECKING:
    from airflow.sdk import Context

#: SigV4 presigned URLs are valid for at most seven days.
MAX_PRESIGN_SECONDS = 7 * 24 * 3600
#: Used when the task has no execution_timeout and no presign_expires_in was given.
DEFAULT_PRESIGN_SECONDS = 24 * 3600
#: Added to execution_timeout: the engine's final PUT happens at the very end.
PRESIGN_MARGIN_SECONDS = 15 * 60


class VLLMBatchOperator(BaseOperator):
    """Run an OpenAI-format batch file through vLLM's offline batch runner.

    The task checks the input before any engine starts (preflight), makes presigned
    S3 URLs so the engine needs no AWS credentials, runs
    ``python -m vllm.entrypoints.openai.run_batch`` as a child process on this
    worker, checks that every request was answered exactly once, publishes the
    results (and an error file) and returns a manifest::

        {"output_uri", "error_uri", "input_uri", "model",
         "request_counts": {"total", "completed", "failed"},
         "usage": {"prompt_tokens", "completion_tokens", "total_tokens"},
         "duration_s", "vllm_version"}

    ``output_uri`` is also pushed under the XCom key ``output_uri``. The engine writes
    to a staging key unique to the try (``<output key>.staging/...``); the final
    objects appear only after the results check passed, so a failed try never leaves
    a half-written output.

    :param input_uri: the batch file: ``s3://bucket/key``, a local path on the worker,
        or an http(s) URL. (templated)
    :param output_uri: where the results go: ``s3://bucket/key``. (templated)
    :param model: the model name or directory, passed to ``--model``; every line's
        ``body.model`` must name it (or see ``rewrite_model``). (templated)
    :param error_uri: where failed lines go. Default: the output key with
        ``.jsonl`` replaced by ``.errors.jsonl``. (templated)
    :param engine_args: more batch-runner arguments, e.g.
        ``["--max-model-len", "4096", "--tensor-parallel-size", "2"]``. (templated)
    :param engine_python: the Python of the environment that has vLLM. Default: the
        Python running this task. (templated)
    :param engine_command: a command prefix that replaces
        ``<engine_python> -m vllm.entrypoints.openai.run_batch``, for engines in
        another image or wrapper. (templated)
    :param engine_env: environment variables added for the engine, e.g.
        ``{"CUDA_VISIBLE_DEVICES": "0"}``. (templated)
    :param aws_conn_id: the Airflow AWS connection for S3. Default ``aws_default``.
    :param presign_expires_in: seconds the presigned URLs stay valid. Default: the
        task's ``execution_timeout`` plus 15 minutes, or 24 hours without one; at most
        7 days (SigV4's limit).
    :param max_failed_ratio: the share of failed requests above which the task fails
        after publishing the files. Default 0: any failed request fails the task.
        (templated: a rendered string is read as a number)
    :param invalid_lines: ``"fail"`` (default) fails the task on any invalid input
        line before the engine starts; ``"skip"`` sends invalid lines to the error
        file with their reason and runs the valid ones.
    :param rewrite_model: rewrite every line's ``body.model`` to ``model`` instead of
        failing on a mismatch. Default False.
    :param default_body: fields filled into every request body that lacks them, e.g.
        ``{"max_completion_tokens": 256}``. (templated)
    :param max_lines: the most request lines accepted. Default: no limit.
    :param supported_urls: the batch URLs to accept. Default: asked of the engine
        environment (or vLLM 0.32's list when ``engine_command`` is set).
    :param kill_grace_s: seconds between SIGTERM and SIGKILL when stopping the engine.
    :param resume: when ``<output stem>.manifest.json`` already records a complete run of
        the same input (same ETag) and model, return it without running the engine, so
        retries, clears and backfill re-runs cost no GPU time. Default True.
    :param output_mode: ``"local"`` (default): the engine writes a file on this worker,
        which the operator checks and uploads with S3Hook; if S3 is unreachable then,
        the file is kept in ``results_dir`` and a retry on this worker publishes it
        without running the engine again. ``"presigned"``: the engine PUTs its output
        to a presigned staging URL — for engines that run where this worker's disk is
        not and that hold no AWS credentials (vLLM loses the results if that PUT fails).
    :param results_dir: where local results wait to be published. Default: the system
        temporary directory's ``airflow-vllm-batch``.
    """

    template_fields: Sequence[str] = (
        "input_uri",
        "output_uri",
        "error_uri",
        "model",
        "engine_args",
        "engine_python",
        "engine_command",
        "engine_env",
        "default_body",
        "max_failed_ratio",
    )
    template_fields_renderers = {"engine_args": "json", "engine_env": "json", "default_body": "json"}
    operator_extra_links = (VLLMBatchOutputLink(),)
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        input_uri: str,
        output_uri: str,
        model: str,
        error_uri: str | None = None,
        engine_args: Sequence[str] = (),
        engine_python: str | None = None,
        engine_command: Sequence[str] | None = None,
        engine_env: Mapping[str, str] | None = None,
        aws_conn_id: str | None = "aws_default",
        presign_expires_in: int | None = None,
        max_failed_ratio: float = 0.0,
        invalid_lines: str = "fail",
        rewrite_model: bool = False,
        default_body: Mapping[str, Any] | None = None,
        max_lines: int | None = None,
        supported_urls: Sequence[str] | None = None,
        kill_grace_s: float = 30.0,
        resume: bool = True,
        output_mode: str = "local",
        results_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.input_uri = input_uri
        self.output_uri = output_uri
        self.error_uri = error_uri
        self.model = model
        self.engine_args = engine_args
        self.engine_python = engine_python
        self.engine_command = engine_command
        self.engine_env = engine_env
        self.aws_conn_id = aws_conn_id
        self.presign_expires_in = presign_expires_in
        self.max_failed_ratio = max_failed_ratio
        self.invalid_lines = invalid_lines
        self.rewrite_model = rewrite_model
        self.default_body = default_body
        self.max_lines = max_lines
        self.supported_urls = supported_urls
        self.kill_grace_s = kill_grace_s
        self.resume = resume
        self.output_mode = output_mode
        self.results_dir = results_dir

    @cached_property
    def s3_hook(self) -> S3Hook:
        """The S3 hook of ``aws_conn_id``."""
        return S3Hook(aws_conn_id=self.aws_conn_id)

    @cached_property
    def engine_hook(self) -> VLLMEngineHook:
        """Runs the engine process; kept so that ``on_kill`` can stop it."""
        return VLLMEngineHook(kill_grace_s=self.kill_grace_s)

    # -- the story -------------------------------------------------------------------

    def execute(self, context: Context) -> dict[str, Any]:
        started = time.monotonic()
        self._check_arguments()
        try:
            input_etag = self.input_fingerprint()
        except (BotoCoreError, ClientError) as err:
            raise VLLMBatchError(
                f"Cannot read {self.input_uri} ({err}). Nothing was run; check that S3 is reachable with "
                f"connection {self.aws_conn_id!r} and that the object exists, then retry."
            ) from err
        manifest = self.completed_manifest(input_etag) if self.resume else None
        if manifest is None:
            manifest = self.run_batch(context, input_etag, started)
        self.announce(manifest, context)
        self.fail_on_too_many_failures(manifest, context)
        return manifest

    def run_batch(self, context: Context, input_etag: str | None, started: float) -> dict[str, Any]:
        """Preflight, presign, run the engine, check and publish; return the manifest."""
        engine = self.inspect_engine()
        staging = self.staging_prefix(context)
        output = self.engine_output(input_etag, staging)
        with tempfile.TemporaryDirectory(prefix="vllm-batch-") as tmp:
            work = Path(tmp)
            report = self.preflight(engine, work)
            if output.recovered():
                self.log.info(
                    "Results of an earlier try were never published; publishing them from %s "
                    "without running the engine again.",
                    output.describe(),
                )
                run = EngineRun(returncode=0, duration_s=0.0)
            else:
                engine_input = self.stage_input(report, work, staging)
                input_location = self.presign_input(engine_input)
                run = self.run_engine(input_location, self.engine_output_location(output))
                self.confirm_output(output, run)
            run.vllm_version = run.vllm_version or engine.vllm_version
            try:
                results = self.check_output(report, work, output, staging)
                manifest = self.publish(report, results, work, output, staging, run, started, input_etag)
            except (BotoCoreError, ClientError) as err:
                raise PublishError(f"S3 failed after the engine finished ({err}). {self._kept(output)}") from err
        output.discard()
        return manifest

    @staticmethod
    def _kept(output) -> str:
        if isinstance(output, LocalEngineOutput):
            return (
                f"The results are kept at {output.describe()}: a retry on this worker publishes them "
                "without running the engine again."
            )
        return "The engine's results are lost with its staging object; a retry runs the batch again."

    def input_fingerprint(self) -> str | None:
        """Return what identifies this exact input: the S3 ETag, or size and mtime of a local file.

        None for an http(s) input, which then always runs.
        """
        if self.input_uri.startswith("s3://"):
            bucket, key = S3Hook.parse_s3_url(self.input_uri)
            return self.s3_hook.head_object(key, bucket_name=bucket)["ETag"].strip('"')
        if self.input_uri.startswith(("http://", "https://")):
            return None
        stat = os.stat(self.input_uri)
        return f"local-{stat.st_size}-{stat.st_mtime_ns}"

    def completed_manifest(self, input_etag: str | None) -> dict[str, Any] | None:
        """Return the manifest of an earlier complete run of this same input and model, if any.

        The manifest is written last at publish, so its presence means the output and
        error file beside it are complete: a retry, a cleared task or a backfill re-run
        returns it instead of spending GPU time again.
        """
        if input_etag is None:
            return None
        bucket, key = S3Hook.parse_s3_url(self.resolved_manifest_uri)
        if not self.s3_hook.check_for_key(key, bucket_name=bucket):
            return None
        manifest = json.loads(self.s3_hook.read_key(key, bucket_name=bucket))
        same = (manifest.get("input_uri"), manifest.get("input_etag"), manifest.get("model")) == (
            self.input_uri,
            input_etag,
            self.model,
        )
        out_bucket, out_key = S3Hook.parse_s3_url(self.output_uri)
        if not same or not self.s3_hook.check_for_key(out_key, bucket_name=out_bucket):
            self.log.info("An earlier manifest exists at %s but for another input or model: running.", self.resolved_manifest_uri)
            return None
        self.log.info(
            "Output already complete for this input and model (%s): not running the engine again. "
            "Set resume=False to force a new run.",
            self.resolved_manifest_uri,
        )
        return manifest

    def announce(self, manifest: dict[str, Any], context: Context) -> None:
        """Push ``output_uri`` to XCom and attach the counts to the outlet asset events."""
        context["ti"].xcom_push(key="output_uri", value=manifest["output_uri"])
        VLLMBatchOutputLink.persist(context=context, output_uri=manifest["output_uri"])
        self._published_error_uri = manifest["error_uri"]
        extra = {k: manifest[k] for k in ("output_uri", "error_uri", "manifest_uri", "model", "request_counts", "usage")}
        for outlet in self.outlets or ():
            if isinstance(outlet, Asset):
                context["outlet_events"][outlet].extra = extra

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """Report the input file and the published results (and error file) to OpenLineage."""
        # getattr: OpenLineage also calls this for a task that failed before announce().
        return lineage_for(self.input_uri, self.output_uri, getattr(self, "_published_error_uri", None))

    def on_kill(self) -> None:
        """Stop the whole engine process group; staging objects are removed by the next try."""
        self.engine_hook.terminate()

    # -- steps -----------------------------------------------------------------------

    def _check_arguments(self) -> None:
        # Rendered templates are strings; a Param-driven ratio arrives as "0.1".
        self.max_failed_ratio = float(self.max_failed_ratio)
        if not self.output_uri.startswith("s3://"):
            raise VLLMBatchError(f"output_uri must be an s3:// URI, got {self.output_uri!r}.")
        if self.output_mode not in ("local", "presigned"):
            raise VLLMBatchError(f"output_mode must be 'local' or 'presigned', got {self.output_mode!r}.")
        if self.invalid_lines not in ("fail", "skip"):
            raise VLLMBatchError(f"invalid_lines must be 'fail' or 'skip', got {self.invalid_lines!r}.")
        if not 0 <= self.max_failed_ratio <= 1:
            raise VLLMBatchError(f"max_failed_ratio must be between 0 and 1, got {self.max_failed_ratio!r}.")

    def inspect_engine(self) -> EngineInfo:
        """Ask the engine environment for its vLLM version and the batch URLs it serves."""
        if self.engine_command:
            info = EngineInfo(vllm_version=None, supported_urls=FALLBACK_SUPPORTED_URLS)
        else:
            info = probe_engine(self.engine_python or sys.executable)
            self.log.info("Engine: vLLM %s; batch URLs: %s", info.vllm_version, sorted(info.supported_urls))
        if self.supported_urls:
            info = EngineInfo(info.vllm_version, frozenset(self.supported_urls))
        return info

    def staging_prefix(self, context: Context) -> str:
        """Return a key prefix unique to this try, after removing what earlier tries left."""
        bucket, key = S3Hook.parse_s3_url(self.output_uri)
        root = f"{key}.staging/"
        leftovers = self.s3_hook.list_keys(bucket_name=bucket, prefix=root) or []
        if leftovers:
            self.log.info("Removing %d staging object(s) left by an earlier try under %s", len(leftovers), root)
            self.s3_hook.delete_objects(bucket=bucket, keys=leftovers)
        try_number = getattr(context.get("ti"), "try_number", 0)
        return f"{root}try-{try_number}-{uuid.uuid4().hex[:8]}"

    def preflight(self, engine: EngineInfo, work: Path) -> PreflightReport:
        """Check the whole input before any engine starts; write a cleaned copy when needed."""
        options = PreflightOptions(
            supported_urls=engine.supported_urls,
            model=self.model,
            rewrite_model=self.rewrite_model,
            default_body=dict(self.default_body or {}),
            invalid_lines=self.invalid_lines,
            max_lines=self.max_lines,
        )
        rewriting = self.invalid_lines == "skip" or self.rewrite_model or bool(self.default_body)
        with (
            self._open_input() as lines,
            _maybe_open(work / "input.jsonl", rewriting) as cleaned,
            _maybe_open(work / "preflight-errors.jsonl", rewriting) as errors,
        ):
            report = preflight(lines, options, cleaned_out=cleaned, errors_out=errors, reread=self._open_input)
        self.log.info("Preflight of %s:\n%s", self.input_uri, report.format())
        try:
            if self.invalid_lines == "fail" or not report.runnable:
                report.raise_for_problems(self.input_uri)
            if not report.valid_lines:
                raise PreflightError(f"{self.input_uri} has no request line: nothing to run.", report)
        except PreflightError as err:
            # The same file fails the same way on every try: no retry, no GPU time.
            raise AirflowFailException(str(err)) from err
        return report

    def stage_input(self, report: PreflightReport, work: Path, staging: str) -> str:
        """Return the input the engine reads: the original, or the cleaned copy staged next to the output."""
        if not report.needs_rewrite:
            return self.input_uri
        cleaned = work / "input.jsonl"
        if not self.input_uri.startswith("s3://"):
            return str(cleaned)
        bucket, _ = S3Hook.parse_s3_url(self.output_uri)
        key = f"{staging}/input.jsonl"
        self.s3_hook.load_file(str(cleaned), key=key, bucket_name=bucket, replace=True)
        self.log.info("Engine reads the cleaned copy s3://%s/%s", bucket, key)
        return f"s3://{bucket}/{key}"

    def engine_output(self, input_etag: str | None, staging: str):
        """Return where the engine writes: a local file kept across tries, or a staging key."""
        if self.output_mode == "presigned":
            bucket, _ = S3Hook.parse_s3_url(self.output_uri)
            return StagedEngineOutput(self.s3_hook, bucket, f"{staging}/results.jsonl")
        # Without a fingerprint (http input) a retry cannot trust old results: a fresh directory.
        identity = input_etag if input_etag is not None else uuid.uuid4().hex
        return LocalEngineOutput(self.results_dir or DEFAULT_RESULTS_DIR, self.output_uri, identity, self.model)

    def presign_input(self, engine_input: str) -> str:
        """Return what the engine reads: a presigned GET URL for S3, else the path or URL itself."""
        if not engine_input.startswith("s3://"):
            return engine_input
        bucket, key = S3Hook.parse_s3_url(engine_input)
        return self._presign("get_object", bucket, key, self.presign_seconds())

    def engine_output_location(self, output) -> str:
        """Return the engine's ``-o``: a local path, or a presigned PUT URL of the staging key."""
        if isinstance(output, StagedEngineOutput):
            url = self._presign("put_object", output.bucket, output.key, self.presign_seconds())
            self.log.info("The engine uploads its results to %s", output.describe())
            return url
        return output.engine_location

    def presign_seconds(self) -> int:
        """Seconds the presigned URLs must stay valid: the task's whole time budget."""
        if self.presign_expires_in is not None:
            seconds = int(self.presign_expires_in)
        elif isinstance(self.execution_timeout, timedelta):
            seconds = int(self.execution_timeout.total_seconds()) + PRESIGN_MARGIN_SECONDS
        else:
            seconds = DEFAULT_PRESIGN_SECONDS
        if not 0 < seconds <= MAX_PRESIGN_SECONDS:
            raise PresignError(
                f"Presigned URLs would need to be valid for {seconds}s, but SigV4 allows 1 to "
                f"{MAX_PRESIGN_SECONDS}s (7 days). Shorten execution_timeout, set presign_expires_in, "
                "or split the batch into shards."
            )
        return seconds

    def run_engine(self, input_location: str, output_location: str) -> EngineRun:
        """Run the batch runner to completion; raise when it failed."""
        argv = build_engine_argv(
            input_location=input_location,
            output_location=output_location,
            model=self.model,
            engine_args=list(self.engine_args or ()),
            engine_command=self.engine_command,
            python=self.engine_python or sys.executable,
        )
        env = {**os.environ, **{k: str(v) for k, v in (self.engine_env or {}).items()}}
        self.log.info("Starting the vLLM engine: %s", redact_urls(" ".join(argv)))
        if not self.engine_command:
            argv, hidden = conceal_arguments(argv)
            env.update(hidden)
        run = self.engine_hook.run(argv, env=env)
        self.log.info("vLLM engine exited with code %s after %.1fs", run.returncode, run.duration_s)
        if run.returncode != 0:
            how = f"was killed by signal {-run.returncode}" if run.returncode < 0 else f"exited with code {run.returncode}"
            if run.returncode in (-9, 137):
                how += " (SIGKILL: out of memory? see the kernel log)"
            raise EngineError(
                f"The vLLM engine {how}; nothing was published. Last lines of its log:\n"
                + "\n".join(run.tail[-15:])
            )
        return run

    def confirm_output(self, output, run: EngineRun) -> None:
        """Raise when the engine exited 0 but left no output (vLLM's upload gave up)."""
        if not output.engine_finished():
            raise EngineError(
                f"The vLLM engine exited 0 but wrote no output to {output.describe()} (its upload failed: "
                "see 'Failed to upload' in the log above). Last lines of its log:\n" + "\n".join(run.tail[-15:])
            )

    def check_output(self, report: PreflightReport, work: Path, output, staging: str) -> ResultsReport:
        """Check that the engine's output answers every request exactly once."""
        engine_input = work / "input.jsonl" if report.needs_rewrite else None
        with (
            output.open_lines() as result_lines,
            (open_lines(str(engine_input)) if engine_input else self._open_input()) as input_lines,
            open(work / "engine-errors.jsonl", "wb") as errors,
        ):
            results = check_results(
                result_lines,
                input_lines,
                errors_out=errors,
                reread_input=(lambda: open_lines(str(engine_input))) if engine_input else self._open_input,
                reread_results=output.open_lines,
            )
        self.log.info("Results check:\n%s", results.format())
        if results.engine_failure:
            output.discard()
            self._delete_prefix(S3Hook.parse_s3_url(self.output_uri)[0], staging)
            raise EngineError(
                "The vLLM engine died during the run although it exited 0: every request came back "
                f"as an error ({'; '.join(results.sample_errors[:3])}). Nothing was published; look "
                "for the engine's crash (often out of memory) earlier in this log."
            )
        results.raise_for_mismatch()
        return results

    def publish(
        self,
        report: PreflightReport,
        results: ResultsReport,
        work: Path,
        output,
        staging: str,
        run: EngineRun,
        started: float,
        input_etag: str | None,
    ) -> dict[str, Any]:
        """Put the results at ``output_uri``, write the error file and the manifest (last)."""
        out_bucket, out_key = S3Hook.parse_s3_url(self.output_uri)
        err_bucket, err_key = S3Hook.parse_s3_url(self.resolved_error_uri)
        output.publish(self.s3_hook, out_bucket, out_key)
        skipped = report.invalid_lines if self.invalid_lines == "skip" else 0
        failed = results.request_counts["failed"] + skipped
        error_uri = None
        if failed:
            merged = _concat(work / "all-errors.jsonl", work / "preflight-errors.jsonl", work / "engine-errors.jsonl")
            self.s3_hook.load_file(str(merged), key=err_key, bucket_name=err_bucket, replace=True)
            error_uri = self.resolved_error_uri
        elif self.s3_hook.check_for_key(err_key, bucket_name=err_bucket):
            # A re-run with no failures must not leave an earlier run's error file behind.
            self.s3_hook.delete_objects(bucket=err_bucket, keys=[err_key])
        counts = results.request_counts
        manifest = {
            "output_uri": self.output_uri,
            "error_uri": error_uri,
            "input_uri": self.input_uri,
            "input_etag": input_etag,
            "model": self.model,
            "request_counts": {
                "total": counts["total"] + skipped,
                "completed": counts["completed"],
                "failed": failed,
            },
            "usage": dict(results.usage),
            "duration_s": round(time.monotonic() - started, 3),
            "engine_duration_s": round(run.duration_s, 3),
            "vllm_version": run.vllm_version,
            "manifest_uri": self.resolved_manifest_uri,
        }
        # Written last: its presence says the output and error file beside it are complete.
        man_bucket, man_key = S3Hook.parse_s3_url(self.resolved_manifest_uri)
        self.s3_hook.load_string(json.dumps(manifest, indent=2), key=man_key, bucket_name=man_bucket, replace=True)
        self._delete_prefix(out_bucket, staging)
        self.log.info("Published %s (%d completed, %d failed)", self.output_uri, counts["completed"], failed)
        return manifest

    def fail_on_too_many_failures(self, manifest: dict[str, Any], context: Context) -> None:
        """Fail the task when the failed share exceeds ``max_failed_ratio`` (files stay published)."""
        counts = manifest["request_counts"]
        if counts["total"] and counts["failed"] / counts["total"] > self.max_failed_ratio:
            context["ti"].xcom_push(key="manifest", value=manifest)
            raise TooManyFailedRequestsError(
                f"{counts['failed']} of {counts['total']} requests failed, more than max_failed_ratio="
                f"{self.max_failed_ratio}. The results and the error file are published: "
                f"{manifest['output_uri']}, {manifest['error_uri']}; the manifest is in XCom key 'manifest'."
            )

    # -- helpers ---------------------------------------------------------------------

    @property
    def resolved_error_uri(self) -> str:
        """``error_uri``, or the output URI with ``.jsonl`` replaced by ``.errors.jsonl``."""
        return self.error_uri or default_error_uri(self.output_uri)

    @property
    def resolved_manifest_uri(self) -> str:
        """Where the manifest is written beside the output: ``<output stem>.manifest.json``."""
        return manifest_uri(self.output_uri)

    @contextlib.contextmanager
    def _open_input(self) -> Iterator[Any]:
        if self.input_uri.startswith("s3://"):
            bucket, key = S3Hook.parse_s3_url(self.input_uri)
            with s3_lines(self.s3_hook, bucket, key) as lines:
                yield lines
        else:
            with open_lines(self.input_uri) as lines:
                yield lines

    def _presign(self, method: str, bucket: str, key: str, expires_in: int) -> str:
        url = self.s3_hook.generate_presigned_url(
            client_method=method, params={"Bucket": bucket, "Key": key}, expires_in=expires_in
        )
        if not url:
            raise PresignError(
                f"S3Hook could not presign {method} for s3://{bucket}/{key} (connection "
                f"{self.aws_conn_id!r}); see the error above. Check the connection's credentials and region."
            )
        mask_secret(url)
        return url

    def _delete_prefix(self, bucket: str, prefix: str) -> None:
        keys = self.s3_hook.list_keys(bucket_name=bucket, prefix=prefix) or []
        if keys:
            self.s3_hook.delete_objects(bucket=bucket, keys=keys)


@contextlib.contextmanager
def _maybe_open(path: Path, enabled: bool) -> Iterator[BinaryIO | None]:
    if not enabled:
        yield None
        return
    with open(path, "wb") as f:
        yield f


def _concat(target: Path, *parts: Path) -> Path:
    with open(target, "wb") as out:
        for part in parts:
            if part.exists():
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 20):
                        out.write(chunk)
    return target
