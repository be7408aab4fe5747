"""The task of the batch DAG that runs the OpenAI API's batches, and the DAG itself.

A batch created with ``POST /batches`` is a run of the DAG named by ``[vllm_batch]
openai_batch_dag_id`` (default ``vllm_batch_openai``), its conf holding what the API chose
for it (times, endpoint, route, locations). :func:`openai_batch_dag` builds that DAG; a one-line DAG file
in the DAGs folder calls it (the repo's ``dags/vllm_batch_openai.py``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_vllm_batch.exceptions import ConfigurationError, EngineError, PreflightError, VLLMBatchError
from airflow_vllm_batch.openai_api.routes import TASK_ID, ModelRoute, load_routes
from airflow_vllm_batch.openai_api.settings import DEFAULT_BATCH_DAG_ID
from airflow_vllm_batch.openai_api.status import window_seconds
from airflow_vllm_batch.operators.task_try import task_try
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.storage import open_uri_lines
from airflow_vllm_batch.version_compat import AirflowFailException

if TYPE_CHECKING:
    from airflow.sdk import DAG, Context

    from airflow_vllm_batch.manifest import Manifest

__all__ = ["TASK_ID", "OpenAIBatchOperator", "failure_record", "openai_batch_dag"]


#: The engine's root-cause line in its log tail: ``SomeError: what happened``.
_ROOT_CAUSE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): \S.*$")
#: Left between the completion window and the task's ``execution_timeout``: the run stops itself at
#: ``expires_at`` and publishes under its lease; the timeout is only the backstop of a try that cannot.
EXPIRY_GRACE = timedelta(hours=1)


def public_message(message: str) -> str:
    """A failure's message as a batch's user may read it: no storage locations, no Airflow internals.

    Sentences naming XCom are dropped, S3 URIs become "the batch's files", and an engine's
    log tail is cut to its root-cause line (the last ``...Error: ...`` line).

    :param message: the error's message.
    """
    head, _, tail = message.partition("Last lines of its log:")
    cause = next((m.group(0) for line in reversed(tail.splitlines()) if (m := _ROOT_CAUSE.search(line))), None)
    sentences = [s for s in re.split(r"(?<=[.;])\s+", head.strip()) if "XCom" not in s]
    text = re.sub(r"s3://\S+?(?=[\s,;)]|\.(?:\s|$)|$)", "the batch's files", " ".join(sentences)).strip()
    return f"{text} Cause: {cause}" if cause else text


def failure_record(err: VLLMBatchError) -> dict[str, Any]:
    """What ``errors.data`` of a failed batch says: a preflight failure's problems line by line, else the error.

    :param err: why the task failed.
    """
    report = getattr(err, "report", None) if isinstance(err, PreflightError) else None
    if report is not None and (report.problems or report.file_problems):
        problems = [*report.file_problems, *report.problems]
        errors = [
            {
                "code": "invalid_request",
                "line": problem.line or None,
                "param": None,
                "message": public_message(problem.message) + (f" (custom_id {problem.custom_id!r})" if problem.custom_id else ""),
            }
            for problem in problems
        ]
        return {"stage": "preflight", "errors": errors}
    if isinstance(err, PreflightError):
        stage, code = "preflight", "invalid_file"
    else:
        stage, code = "run", "engine_error" if isinstance(err, EngineError) else "batch_failed"
    return {"stage": stage, "errors": [{"code": code, "line": None, "param": None, "message": public_message(str(err))}]}


@dataclass(frozen=True)
class _BoundBatch:
    """The batch a run answers (a stand-in for the signed batch spec: see ``_bind_batch``)."""

    batch_id: str
    created_at: int
    expires_at: int
    endpoint: str
    route: str | None = None


class OpenAIBatchOperator(VLLMBatchOperator):
    """Run one batch of the OpenAI API; publish it as OpenAI's batches end: completed, expired or cancelled.

    Per-request failures never fail the batch (no ``max_failed_ratio``): they are in its error
    file. The run stops itself, under the output's lease, when the batch's deadline
    (``expires_at``, from ``created_at``: the same on every try) passes or a cancel was asked
    (the object at ``cancel_uri``, written by ``POST /batches/{id}/cancel``): the engine stops
    sending, and the answers made durable so far are published through the run protocol with
    a manifest whose ``status`` is ``expired`` or ``cancelled``, every other request in the error
    file as ``batch_expired`` / ``batch_cancelled``. The task then **succeeds**, returning that
    manifest: the batch ended as its user asked (or as its window allowed), nothing is left to
    retry, and the API maps the manifest's ``status``. A failure of the batch itself (a file
    preflight refuses, an engine that cannot start, a model that does not serve the endpoint)
    fails the task and leaves why at ``failure_uri``, worded for the batch's user.

    The published lines take OpenAI's shape (``result_shape="openai"``): ids ``batch_req_…``,
    HTTP failures in ``response.body.error``; the operator's own outputs keep vLLM's.

    :param failure_uri: ``s3://`` URI of the failure record. (templated)
    """

    template_fields: Sequence[str] = (*VLLMBatchOperator.template_fields, "failure_uri")
    result_shape = "openai"

    def __init__(self, *, failure_uri: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failure_uri = failure_uri
        self.cancel_uri = self.progress_uri = ""
        self.batch: _BoundBatch | None = None

    def _bind_batch(self, context: Context) -> None:
        """Read the batch this run answers from its DAG run's conf: its times, endpoint, route and locations.

        A stand-in for the signed batch spec (issue 33's other half), which replaces it: the
        names it sets are the ones the rest of the operator reads.
        """
        dag_run = context["dag_run"]
        conf = dag_run.conf or {}
        created = int(conf["created_at"])
        self.batch = _BoundBatch(
            batch_id=dag_run.run_id,
            created_at=created,
            expires_at=created + window_seconds(str(conf.get("completion_window", "24h"))),
            endpoint=conf["endpoint"],
            route=conf.get("route"),
        )
        self.input_uri, self.output_uri, self.error_uri = conf["input_uri"], conf["output_uri"], conf["error_uri"]
        self.failure_uri = conf["failure_uri"]
        stem = self.failure_uri.removesuffix(".failure.json")
        self.cancel_uri, self.progress_uri = f"{stem}.cancel.json", f"{stem}.progress.json"

    def execute(self, context: Context) -> dict[str, Any]:
        self._bind_batch(context)
        assert self.batch is not None
        # As OpenAI: every line's url is the batch's endpoint; preflight fails the others, naming their lines.
        self.supported_urls = [self.batch.endpoint]
        try:
            manifest = super().execute(context)
        except Exception as err:
            # A mistake arrives as AirflowFailException raised in the handling of the VLLMBatchError
            # (no retries), ``from None`` so that the task log tells it once: the error is its context.
            cause = err if isinstance(err, VLLMBatchError) else (err.__cause__ or err.__context__)
            if isinstance(cause, VLLMBatchError) and (not cause.retryable or task_try(context, self.retries)["last_try"]):
                self.record_failure(failure_record(cause))
            raise
        self.refuse_unserved_endpoint(manifest)
        return manifest

    def run_callbacks(self) -> dict[str, Any]:
        return {"stop": self.stop_condition, "on_checkpoint": self.write_progress}

    def stop_condition(self) -> str | None:
        """``"cancelled"`` once a cancel was asked, ``"expired"`` once ``expires_at`` passed, else None."""
        assert self.batch is not None
        bucket, _, key = self.cancel_uri.removeprefix("s3://").partition("/")
        try:
            if self.hook.head_object(key, bucket_name=bucket) is not None:
                return "cancelled"
        except Exception as err:  # S3 failing for a moment is no reason to stop, nor to fail: the next poll asks again
            self.log.warning("Could not read whether batch %s was cancelled: %s", self.batch.batch_id, err)
        if time.time() >= self.batch.expires_at:
            return "expired"
        return None

    def write_progress(self, counts: Mapping[str, int]) -> None:
        """Write the batch's live counts (``progress_uri``) for ``GET /batches/{id}``: one small object per checkpoint.

        Advisory: the status reads it only while no manifest is published, and a failure to write it is
        only logged (the run's checkpoints, not this record, are what a retry resumes from).
        """
        bucket, _, key = self.progress_uri.removeprefix("s3://").partition("/")
        body = {"completed": int(counts["completed"]), "failed": int(counts["failed"]), "updated_at": int(time.time())}
        self.hook.load_bytes(json.dumps(body).encode(), key=key, bucket_name=bucket, replace=True)

    def fail_on_too_many_failures(self, manifest: Manifest, max_failed_ratio: float, context: Context) -> None:
        """Never: as OpenAI's, a batch's failed requests are in its error file, and the batch completes."""

    def refuse_unserved_endpoint(self, manifest: Mapping[str, Any]) -> None:
        """Fail the batch whose every request the server answered 404: its model does not serve the endpoint.

        That is the batch's failure, not its requests' (an embeddings batch sent to a chat model):
        its status says so, with the server's own words; the files stay published.
        """
        counts = manifest.get("request_counts") or {}
        total = int(counts.get("total") or 0)
        if not total or counts.get("completed") or (manifest.get("failed_by_reason") or {}) != {"not_found": total}:
            return
        assert self.batch is not None
        said = self.first_error_message(manifest.get("error_uri"))
        message = (
            f"Every one of the batch's {total} requests was answered HTTP 404 by the model's server at {self.batch.endpoint}"
            + (f" ({said})" if said else "")
            + f": the model does not serve {self.batch.endpoint}. Send these requests to a model that serves it."
        )
        self.record_failure({"stage": "run", "errors": [{"code": "endpoint_not_served", "line": None, "param": "endpoint", "message": message}]})
        raise AirflowFailException(message)

    def first_error_message(self, error_uri: str | None) -> str | None:
        """The message of the error file's first line, or None."""
        if not error_uri:
            return None
        try:
            with open_uri_lines(self.hook, error_uri) as lines:
                line = json.loads(next(iter(lines)))
        except Exception:  # the failure is told without the example
            return None
        body = ((line.get("response") or {}).get("body") or {}).get("error") or line.get("error") or {}
        return body.get("message") if isinstance(body, dict) else None

    def record_failure(self, record: Mapping[str, Any]) -> None:
        """Write the failure record; a failure to write it is logged, not raised over the task's own error."""
        bucket, _, key = self.failure_uri.removeprefix("s3://").partition("/")
        try:
            self.hook.load_bytes(json.dumps(record).encode(), key=key, bucket_name=bucket, replace=True)
        except Exception as write_err:  # the batch's own error is the one to raise
            self.log.warning("Could not write the batch's failure record to %s: %s", self.failure_uri, write_err)


def openai_batch_dag(
    *,
    model: str | None = None,
    dag_id: str = DEFAULT_BATCH_DAG_ID,
    completion_window: timedelta = timedelta(hours=24),
    routes: dict[str, ModelRoute] | None = None,
    **operator_kwargs: Any,
) -> DAG:
    """Build the DAG that runs the OpenAI API's batches; call it from a DAG file.

    With ``[vllm_batch] openai_models`` configured (or ``routes`` given), the DAG has one batch
    task per served model (its warm fleet's ``WarmVLLMServer``, or the runner on its ``queue``)
    and a ``route`` task that picks the one ``POST /batches`` chose; else one task, ``vllm_batch``,
    serving ``model``.

    :param model: the model every line's ``body.model`` names, when no routes are configured.
    :param dag_id: the DAG id: ``[vllm_batch] openai_batch_dag_id`` must name it. Default ``vllm_batch_openai``.
    :param completion_window: the longest window a batch may ask for: the task's ``execution_timeout`` is
        this plus :data:`EXPIRY_GRACE`, a backstop only (a batch expires at its own ``expires_at``,
        checked by the run itself, which then publishes what is answered). Default 24 hours (OpenAI's only window).
    :param routes: the served models (default: ``[vllm_batch] openai_models``, read when the DAG file is parsed).
    :param operator_kwargs: more ``VLLMBatchOperator`` arguments (``engine=VLLMRunner(args=[...])``, ...);
        a route's engine (its ``vllm_conn_id``, or ``engine_args`` for the runner) and ``queue`` replace them for its task.
    """
    from airflow.sdk import DAG

    routes = load_routes() if routes is None else routes
    if not routes and not model:
        raise ConfigurationError("openai_batch_dag needs model= or [vllm_batch] openai_models (the served models)")
    with DAG(
        dag_id=dag_id,
        schedule=None,
        catchup=False,
        is_paused_upon_creation=False,
        max_active_runs=operator_kwargs.pop("max_active_runs", 4),
        tags=["vllm-batch", "openai-api"],
        doc_md="Runs the batches of the OpenAI Batches API (`POST /vllm-batch/openai/v1/batches`): one run per batch.",
    ) as dag:
        uris = {
            "input_uri": "{{ dag_run.conf['input_uri'] }}",
            "output_uri": "{{ dag_run.conf['output_uri'] }}",
            "error_uri": "{{ dag_run.conf['error_uri'] }}",
            "failure_uri": "{{ dag_run.conf['failure_uri'] }}",
        }
        if not routes:
            OpenAIBatchOperator(task_id=TASK_ID, model=model, execution_timeout=completion_window + EXPIRY_GRACE, **uris, **operator_kwargs)
            return dag
        from airflow.providers.standard.operators.python import BranchPythonOperator

        route = BranchPythonOperator(task_id="route", python_callable=_chosen_route)
        for served in routes.values():
            kwargs = {**operator_kwargs, "engine": served.engine()}
            if served.queue:
                kwargs["queue"] = served.queue
            route >> OpenAIBatchOperator(
                task_id=served.task_id, model=served.model, execution_timeout=completion_window + EXPIRY_GRACE, **uris, **kwargs
            )
    return dag


def _chosen_route(dag_run: Any, **_: Any) -> str:
    """The batch task ``POST /batches`` chose (``conf["route"]``); a run without one fails here, before any engine."""
    chosen = dag_run.conf.get("route")
    if not chosen:
        raise AirflowFailException("this batch's conf names no route: [vllm_batch] openai_models was set after it was created; create it again")
    return chosen
