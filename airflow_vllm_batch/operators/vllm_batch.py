"""The operator: Airflow's side of one vLLM batch run (the run itself is :mod:`airflow_vllm_batch.run`)."""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from airflow.providers.amazon.aws.operators.base_aws import AwsBaseOperator
from airflow.providers.amazon.aws.utils.mixins import aws_template_fields
from airflow.sdk import Asset
from airflow.sdk.log import mask_secret

from airflow_vllm_batch.batchfile import url_secrets
from airflow_vllm_batch.batchfile.requests import INDEX
from airflow_vllm_batch.engines import Engine, EngineOptions, VLLMRunner, make_engine
from airflow_vllm_batch.exceptions import ConfigurationError, TooManyFailedRequestsError, VLLMBatchError
from airflow_vllm_batch.lineage import lineage_for
from airflow_vllm_batch.links.output import VLLMBatchOutputLink
from airflow_vllm_batch.operators.task_try import task_try
from airflow_vllm_batch.run import (
    AnswerCacheOptions,
    BatchRun,
    BatchSettings,
    InputLimits,
    check_static_settings,
)
from airflow_vllm_batch.storage.layout import default_error_uri
from airflow_vllm_batch.summary import render_summary
from airflow_vllm_batch.version_compat import AirflowFailException

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_vllm_batch.manifest import Manifest


class VLLMBatchOperator(AwsBaseOperator[S3Hook]):
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

    **Engines** (:mod:`airflow_vllm_batch.engines`): ``engine=`` takes the options of one
    engine, and each engine's knobs are its own (:mod:`airflow_vllm_batch.engines.options`
    says why). :class:`~airflow_vllm_batch.engines.VLLMRunner` (the default) runs vLLM's
    batch runner on this worker, bound to the task. :class:`~airflow_vllm_batch.engines.VLLMServer`
    streams the batch through vLLM's OpenAI-compatible server started on this worker, and
    :class:`~airflow_vllm_batch.engines.WarmVLLMServer` through a warm one behind a ``vllm``
    connection, both with request-level checkpoints (a run killed before its first checkpoint
    resumes nothing). A request the server answers only with 429s or 5xx through every retry
    fails the try, to be sent again by Airflow's retry; on the task's last try (``retries=0``:
    the only one) it is published as a failed line instead.

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
    :param max_failed_ratio: the failed share above which the task fails after publishing.
        Default 0. (templated)
    :param invalid_lines: ``"fail"`` (default) or ``"skip"`` (invalid lines go to the error file).
    :param rewrite_model: rewrite every line's ``body.model`` to ``model``. Default False.
    :param default_body: fields filled into every body that lacks them. (templated)
    :param limits: how large the input may be: ``InputLimits(max_lines=..., max_line_bytes=...)``
        (:class:`~airflow_vllm_batch.run.InputLimits`). Default: any number of lines of at most 1,000,000 bytes.
    :param supported_urls: the batch URLs to accept. Default: asked of the engine.
    :param aws_conn_id: the Airflow AWS connection for S3 (as every amazon operator's, from
        ``AwsBaseOperator``; so are ``region_name``, ``verify`` and ``botocore_config``, which reach
        the ``S3Hook``). Default ``aws_default``. (templated, with ``region_name`` and ``verify``)
    :param resume: reuse a complete output or staged answers of the same run. Default True.
    :param results_dir: a directory on the worker; the runs own only its ``airflow-vllm-batch/``
        subdirectory (scratch, results kept while S3 is down), and age out only the entries they
        made there; nothing else in it is touched. That subdirectory is made private to the
        worker's user (mode 0700); one another user owns is refused. Default: the system
        temporary directory.
    :param engine: the engine and its options: ``VLLMRunner(...)`` (default ``VLLMRunner()``),
        ``VLLMServer(...)`` or ``WarmVLLMServer(conn_id=...)``, or another engine's options (a
        subclass of :class:`~airflow_vllm_batch.engines.EngineOptions`). The fields each lists in
        its ``template_fields`` are templated (``args``, ``python``, ``env``, ``conn_id``, ``gpu_hour_cost``...).
    :param output_type: a pydantic ``BaseModel`` subclass, or its import path (imported on the worker): chat and
        completions bodies without ``response_format`` get its JSON schema; an answer that does not fit fails (``invalid_output``).
    :param answer_cache: an answer cache, ``AnswerCacheOptions(uri="s3://bucket/prefix/", sampled=False)``
        (:class:`~airflow_vllm_batch.run.AnswerCacheOptions`): deterministic requests answered before are
        answered from it, only the others reach the engine. Default None: off. (its ``uri`` is templated)
    """

    aws_hook_class = S3Hook
    template_fields: Sequence[str] = aws_template_fields(
        "input_uri",
        "requests",
        "output_uri",
        "error_uri",
        "model",
        "engine",
        "default_body",
        "max_failed_ratio",
        "answer_cache",
    )
    template_fields_renderers: ClassVar[dict[str, str]] = {
        "engine": "json",
        "default_body": "json",
        "requests": "json",
    }
    operator_extra_links = (VLLMBatchOutputLink(),)
    ui_color = "#e8f0fe"
    #: The shape of the published lines (``BatchSettings.result_shape``): vLLM's, for the operator's own outputs.
    result_shape = "vllm"

    def __init__(
        self,
        *,
        output_uri: str,
        model: str,
        engine: EngineOptions | None = None,
        input_uri: str | None = None,
        requests: Sequence[Any] | None = None,
        requests_url: str = "/v1/chat/completions",
        requests_custom_id: str = INDEX,
        error_uri: str | None = None,
        max_failed_ratio: float = 0.0,
        invalid_lines: str = "fail",
        rewrite_model: bool = False,
        default_body: Mapping[str, Any] | None = None,
        limits: InputLimits | None = None,
        supported_urls: Sequence[str] | None = None,
        resume: bool = True,
        results_dir: str | None = None,
        output_type: type | str | None = None,
        answer_cache: AnswerCacheOptions | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.output_uri, self.model, self.input_uri, self.requests = output_uri, model, input_uri, requests
        # A copy: Airflow renders the options in place, and one options object may be shared by several tasks.
        self.engine = copy.copy(engine) if engine is not None else VLLMRunner()
        self.requests_url, self.requests_custom_id, self.error_uri = (
            requests_url,
            requests_custom_id,
            error_uri,
        )
        self.max_failed_ratio, self.invalid_lines, self.rewrite_model = (
            max_failed_ratio,
            invalid_lines,
            rewrite_model,
        )
        self.default_body, self.limits = default_body, limits or InputLimits()
        self.supported_urls, self.resume, self.results_dir = supported_urls, resume, results_dir
        self.output_type = output_type
        # A copy, as the engine's: rendered in place.
        self.answer_cache = copy.copy(answer_cache)
        if not isinstance(self.limits, InputLimits):
            raise ConfigurationError(
                f"limits must be InputLimits(max_lines=..., max_line_bytes=...), got {limits!r}."
            )
        if self.answer_cache is not None and not isinstance(self.answer_cache, AnswerCacheOptions):
            raise ConfigurationError(
                f'answer_cache must be AnswerCacheOptions(uri="s3://bucket/prefix/"), got {answer_cache!r}.'
            )
        #: The engine of the running try; kept so that ``on_kill`` can stop it.
        self._engine: Engine | None = None
        self._published_error_uri: str | None = None
        check_static_settings(self._setting_values())

    @property
    def resolved_error_uri(self) -> str:
        """``error_uri``, or the output URI with ``.jsonl`` replaced by ``.errors.jsonl``."""
        return self.error_uri or default_error_uri(self.output_uri)

    def render_template_fields(self, context: Context, jinja_env: Any = None) -> None:
        """Render as usual, then mask an http(s) input's URL and the engine's secrets before Airflow stores the rendered fields."""
        super().render_template_fields(context, jinja_env)
        if isinstance(self.engine, EngineOptions):
            self.engine.mask_secrets()
        for secret in url_secrets(self.input_uri):
            mask_secret(secret)

    def execute(self, context: Context) -> dict[str, Any]:
        # An empty link until the output is published: the task runner asks for it even when
        # the task fails, and a missing XCom would log an error on every failed task.
        VLLMBatchOutputLink.persist_empty(context=context)
        started = time.monotonic()
        try:
            settings = self.settings()
            self._engine = make_engine(settings, self.log)
            run = BatchRun(
                settings,
                s3_hook=self.hook,
                engine=self._engine,
                task=task_try(context, self.retries),
                log=self.log,
                **self.run_callbacks(),
            )
            outcome = run.execute()
            self.input_uri = run.input.uri if run.input is not None else self.input_uri
            manifest = outcome.manifest
            self.announce(manifest, context)
            task_s = time.monotonic() - started
            self.log.info(
                "%s",
                render_summary(manifest, outcome.failure_examples, task_s=task_s, resumed=outcome.resumed),
            )
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

    def run_callbacks(self) -> dict[str, Any]:
        """What a subclass tells the run besides its settings (a ``stop`` condition, ``on_checkpoint``); none here."""
        return {}

    def settings(self) -> BatchSettings:
        """The rendered arguments, checked once (:class:`~airflow_vllm_batch.run.BatchSettings`)."""
        return BatchSettings.from_rendered(**self._setting_values(), execution_timeout=self.execution_timeout)

    def announce(self, manifest: Manifest, context: Context) -> None:
        """Push ``output_uri`` to XCom, set the output link and attach the counts to the outlet asset events."""
        context["ti"].xcom_push(key="output_uri", value=manifest.output_uri)
        VLLMBatchOutputLink.persist(
            context=context, output_uri=manifest.output_uri, endpoint_url=self.hook.conn_config.endpoint_url
        )
        self._published_error_uri = manifest.error_uri
        data = manifest.to_dict()
        extra = {
            k: data.get(k)
            for k in ("output_uri", "error_uri", "manifest_uri", "model", "request_counts", "usage")
        }
        for outlet in self.outlets or ():
            if isinstance(outlet, Asset):
                context["outlet_events"][outlet].extra = extra

    def fail_on_too_many_failures(
        self, manifest: Manifest, max_failed_ratio: float, context: Context
    ) -> None:
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
        grouped = {
            "max_lines": self.limits.max_lines,
            "max_line_bytes": self.limits.max_line_bytes,
            "answer_cache_uri": self.answer_cache.uri if self.answer_cache is not None else None,
            "answer_cache_sampled": self.answer_cache.sampled if self.answer_cache is not None else False,
        }
        own = {
            name: getattr(self, name)
            for name in BatchSettings.__dataclass_fields__
            if name not in grouped and name != "execution_timeout"
        }
        return {**own, **grouped}
