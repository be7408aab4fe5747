"""The operator: Airflow's side of one vLLM batch run (the run itself is :mod:`airflow_vllm_batch.run`)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from airflow.sdk import Asset, BaseOperator
from airflow.sdk.log import mask_secret

from airflow_vllm_batch.batchfile import DEFAULT_MAX_LINE_BYTES
from airflow_vllm_batch.batchfile.requests import INDEX
from airflow_vllm_batch.engines import Engine, make_engine
from airflow_vllm_batch.exceptions import TooManyFailedRequestsError, VLLMBatchError
from airflow_vllm_batch.hooks.process import DEFAULT_GRACE_S
from airflow_vllm_batch.lineage import lineage_for
from airflow_vllm_batch.operators.task_try import task_try
from airflow_vllm_batch.redaction import register_engine_secrets
from airflow_vllm_batch.links.output import VLLMBatchOutputLink
from airflow_vllm_batch.run import BatchRun, BatchSettings, check_static_settings
from airflow_vllm_batch.storage import default_error_uri
from airflow_vllm_batch.summary import render_summary
from airflow_vllm_batch.version_compat import AirflowFailException

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_vllm_batch.manifest import Manifest


class VLLMBatchOperator(BaseOperator):
    """Run an OpenAI-format batch file through vLLM: its offline batch runner, or its OpenAI-compatible server.

    The task pins the input and computes the run's identity (a fingerprint of the input's
    ETag, the model, the engine and its arguments, the request defaults and modes). A
    complete output made under the same identity is returned as it is; answers an earlier
    try of the same run staged are reused. Otherwise the input is checked before any engine
    starts, the engine's answers are made durable in S3, every request is checked to be
    answered exactly once, and the results, the error file and, last, a manifest are
    published (see :mod:`airflow_vllm_batch.run.batch`). The manifest is the return value
    (XCom); ``output_uri`` is also pushed under its own key. One run writes an output at a
    time (a lease beside it). Mistakes fail without retries; transient failures are left
    to Airflow's retries.

    **Engines** (:mod:`airflow_vllm_batch.engines`): ``engine="runner"`` runs vLLM's batch
    runner on this worker, bound to the task. ``engine="server"`` streams the batch through
    vLLM's OpenAI-compatible server, started on this worker, or with ``vllm_conn_id`` a warm
    one, with request-level checkpoints every ``checkpoint_interval_s`` (a run killed before
    its first checkpoint resumes nothing). A request the server answers only with 429s or
    5xx through every retry fails the try, to be sent again by Airflow's retry; on the task's
    last try (``retries=0``: the only one) it is published as a failed line instead.

    :param input_uri: the batch file: ``s3://bucket/key``, a local path on the worker, or an
        http(s) URL (never resumed: it cannot be pinned). Give it or ``requests``. (templated)
    :param requests: the requests themselves, e.g. an upstream task's XCom: prompts, chat
        message lists or request bodies, written to ``<output stem>.requests/<content hash>.jsonl``.
        At most 10,000 requests and 8 MiB. (templated)
    :param requests_url: the endpoint of lines made from ``requests``. Default ``"/v1/chat/completions"``.
    :param requests_custom_id: ``"index"`` (default: ``request-0``...) or the key of each item holding its custom_id.
    :param output_uri: where the results go: ``s3://bucket/key``. (templated)
    :param model: the model name or directory (``--model``); every line's ``body.model`` must
        name it or a name the engine serves (``--served-model-name``, LoRA adapters). (templated)
    :param error_uri: where failed lines go. Default: ``<output stem>.errors.jsonl``. (templated)
    :param engine_args: more engine arguments, checked by that engine's own parser. (templated)
    :param engine_python: the Python of the environment that has vLLM. Default: this task's. (templated)
    :param engine_command: a command prefix replacing ``<engine_python> -m <runner>`` (runner only). (templated)
    :param engine_env: environment variables added for the engine; not in the run identity. (templated)
    :param aws_conn_id: the Airflow AWS connection for S3. Default ``aws_default``.
    :param presign_expires_in: seconds presigned URLs stay valid. Default: ``execution_timeout``
        plus 15 minutes, or 24 hours; at most 7 days.
    :param max_failed_ratio: the failed share above which the task fails after publishing.
        Default 0. (templated)
    :param invalid_lines: ``"fail"`` (default) or ``"skip"`` (invalid lines go to the error file).
    :param rewrite_model: rewrite every line's ``body.model`` to ``model``. Default False.
    :param default_body: fields filled into every body that lacks them. (templated)
    :param max_lines: the most request lines accepted. Default: no limit.
    :param max_line_bytes: the longest request line accepted. Default 1,000,000.
    :param supported_urls: the batch URLs to accept. Default: asked of the engine.
    :param kill_grace_s: seconds between SIGTERM and SIGKILL when stopping the engine. Default 4.
    :param resume: reuse a complete output or staged answers of the same run. Default True.
    :param output_mode: ``"local"`` (default) or ``"presigned"`` (the runner PUTs its output
        to a presigned staging URL: for engines without this worker's disk or AWS credentials).
    :param results_dir: a directory on the worker; the runs own only its ``airflow-vllm-batch/``
        subdirectory (scratch, results kept while S3 is down), and age out only the entries they
        made there; nothing else in it is touched. Default: the system temporary directory.
    :param engine: ``"runner"`` (default), ``"server"``, or an engine registered with
        :func:`airflow_vllm_batch.engines.register_engine`.
    :param vllm_conn_id: a ``vllm`` connection to a running server; implies ``engine="server"``.
    :param max_in_flight: requests sent to the server and not yet answered. Default: the
        connection's ``max_in_flight`` extra, else 512.
    :param checkpoint_interval_s: seconds between the server engine's checkpoints. Default 60.
    :param client_processes: processes the server engine's client spreads the requests over (one core sends ~3,400/s). Default 1.
    :param gpus: GPUs the engine this task starts leases on the worker. Default: what the
        parallel sizes in ``engine_args`` need (none on a CPU worker); 0: no lease.
    :param gpu_hour_cost: the price of one GPU-hour (e.g. ``2.5``), a number >= 0: the manifest's
        ``cost`` then holds the run's cost, also per model. Default None: GPU-seconds only. (templated)
    :param output_type: a pydantic ``BaseModel`` subclass, or its import path (imported on the worker): chat and
        completions bodies without ``response_format`` get its JSON schema; an answer that does not fit fails (``invalid_output``).
    :param answer_cache_uri: ``s3://bucket/prefix/`` of an answer cache: deterministic requests answered
        before are answered from it, only the others reach the engine. Default None: off. (templated)
    :param answer_cache_sampled: also cache requests that sample (no ``temperature`` 0, no ``seed``). Default False.
    :param server_startup_timeout: how long a server this task starts (``engine="server"``) may take to
        be ready, a ``datetime.timedelta`` or seconds; then the try fails (retryable) and the server is
        stopped. Default 15 minutes.
    :param request_timeout: how long one request to a server may take, its retries included, a
        ``timedelta`` or seconds; a request still unanswered then is set aside (sent again by the task's
        retry), and a server that answered no request for that long ends the try as unavailable. Default
        30 minutes. **Bounded**: a try never waits on a silent server longer than
        ``server_startup_timeout`` + ``request_timeout`` (plus ``kill_grace_s`` to stop it);
        ``execution_timeout`` remains the ceiling of the whole task.
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
        "gpu_hour_cost",
        "answer_cache_uri",
    )
    template_fields_renderers = {"engine_args": "json", "engine_env": "json", "default_body": "json", "requests": "json"}
    operator_extra_links = (VLLMBatchOutputLink(),)
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        output_uri: str,
        model: str,
        input_uri: str | None = None,
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
        client_processes: int = 1,
        gpus: int | None = None,
        gpu_hour_cost: float | None = None,
        output_type: type | str | None = None,
        answer_cache_uri: str | None = None,
        answer_cache_sampled: bool = False,
        server_startup_timeout: timedelta | float | None = None,
        request_timeout: timedelta | float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.output_uri, self.model, self.input_uri, self.requests = output_uri, model, input_uri, requests
        self.requests_url, self.requests_custom_id, self.error_uri = requests_url, requests_custom_id, error_uri
        self.engine_args, self.engine_python, self.engine_command = engine_args, engine_python, engine_command
        self.engine_env, self.aws_conn_id, self.presign_expires_in = engine_env, aws_conn_id, presign_expires_in
        self.max_failed_ratio, self.invalid_lines, self.rewrite_model = max_failed_ratio, invalid_lines, rewrite_model
        self.default_body, self.max_lines, self.max_line_bytes = default_body, max_lines, max_line_bytes
        self.supported_urls, self.kill_grace_s, self.resume = supported_urls, kill_grace_s, resume
        self.output_mode, self.results_dir = output_mode, results_dir
        self.engine = "server" if vllm_conn_id else engine
        self.vllm_conn_id, self.max_in_flight = vllm_conn_id, max_in_flight
        self.checkpoint_interval_s, self.gpus, self.gpu_hour_cost = checkpoint_interval_s, gpus, gpu_hour_cost
        self.client_processes, self.output_type = client_processes, output_type
        self.answer_cache_uri, self.answer_cache_sampled = answer_cache_uri, answer_cache_sampled
        self.server_startup_timeout, self.request_timeout = server_startup_timeout, request_timeout
        #: The engine of the running try; kept so that ``on_kill`` can stop it.
        self._engine: Engine | None = None
        self._published_error_uri: str | None = None
        check_static_settings(self._setting_values())

    @cached_property
    def s3_hook(self) -> S3Hook:
        """The S3 hook of ``aws_conn_id``."""
        return S3Hook(aws_conn_id=self.aws_conn_id)

    @property
    def resolved_error_uri(self) -> str:
        """``error_uri``, or the output URI with ``.jsonl`` replaced by ``.errors.jsonl``."""
        return self.error_uri or default_error_uri(self.output_uri)

    def render_template_fields(self, context: Context, jinja_env: Any = None) -> None:
        """Render as usual, then mask an http(s) input's URL and the engine's secrets before Airflow stores the rendered fields."""
        super().render_template_fields(context, jinja_env)
        if isinstance(self.engine_args, (list, tuple)) and isinstance(self.engine_env or {}, Mapping):
            register_engine_secrets([a for a in self.engine_args if isinstance(a, str)], self.engine_env)
        if isinstance(self.input_uri, str) and self.input_uri.startswith(("http://", "https://")) and "?" in self.input_uri:
            mask_secret(self.input_uri)
            mask_secret(self.input_uri.split("?", 1)[1])

    def execute(self, context: Context) -> dict[str, Any]:
        # An empty link until the output is published: the task runner asks for it even when
        # the task fails, and a missing XCom would log an error on every failed task.
        VLLMBatchOutputLink.persist_empty(context=context)
        started = time.monotonic()
        try:
            settings = self.settings()
            self._engine = make_engine(settings, self.log)
            run = BatchRun(settings, s3_hook=self.s3_hook, engine=self._engine, task=task_try(context, self.retries), log=self.log)
            outcome = run.execute()
            self.input_uri = run.input.uri if run.input is not None else self.input_uri
            manifest = outcome.manifest
            self.announce(manifest, context)
            task_s = time.monotonic() - started
            self.log.info("%s", render_summary(manifest, outcome.failure_examples, task_s=task_s, resumed=outcome.resumed))
            self.fail_on_too_many_failures(manifest, settings.max_failed_ratio, context)
        except VLLMBatchError as err:
            if not err.retryable:
                # The same mistake fails the same way on every try: no retry, no GPU time. Its
                # message is the whole story: Airflow logs the raised exception with its
                # traceback, and a chained one would print the message a second time. Where
                # it was raised goes to DEBUG.
                self.log.debug("%s raised here:", type(err).__name__, exc_info=err)
                raise AirflowFailException(str(err)) from None
            raise
        return manifest.to_dict()

    def settings(self) -> BatchSettings:
        """The rendered arguments, checked once (:class:`~airflow_vllm_batch.run.BatchSettings`)."""
        return BatchSettings.from_rendered(**self._setting_values(), execution_timeout=self.execution_timeout)

    def announce(self, manifest: Manifest, context: Context) -> None:
        """Push ``output_uri`` to XCom, set the output link and attach the counts to the outlet asset events."""
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

    def fail_on_too_many_failures(self, manifest: Manifest, max_failed_ratio: float, context: Context) -> None:
        """Fail the task when the failed share exceeds ``max_failed_ratio`` (the files stay published)."""
        counts = manifest.request_counts
        if counts.total and counts.failed / counts.total > max_failed_ratio:
            context["ti"].xcom_push(key="manifest", value=manifest.to_dict())
            raise TooManyFailedRequestsError(
                f"{counts.failed} of {counts.total} requests failed, more than max_failed_ratio="
                f"{max_failed_ratio}. The results and the error file are published: "
                f"{manifest.output_uri}, {manifest.error_uri}; the manifest is in XCom key 'manifest'."
            )

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """Report the input file and the published results (and error file) to OpenLineage."""
        return lineage_for(self.input_uri, self.output_uri, self._published_error_uri)

    def on_kill(self) -> None:
        """Stop the engine this try started (its whole process group); the run's staging is kept for the next try."""
        if self._engine is not None:
            self._engine.terminate()

    def _setting_values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in BatchSettings.__dataclass_fields__ if name != "execution_timeout"}
