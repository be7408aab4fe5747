"""The task of the batch DAG that runs the OpenAI API's batches, and the DAG itself.

A batch created with ``POST /batches`` is a run of the DAG named by ``[vllm_batch]
openai_batch_dag_id`` (default ``vllm_batch_openai``), its conf the :class:`~.batch_spec.BatchSpec`
the API signed. The task verifies it and derives every location from it and ``[vllm_batch]
openai_files_uri``; a run triggered by hand or with an edited conf fails before it reads or
writes anything. :func:`openai_batch_dag` builds that DAG; a one-line DAG file in the DAGs
folder calls it (the repo's ``dags/vllm_batch_openai.py``).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_vllm_batch.exceptions import ConfigurationError, InputNotFoundError, PreflightError, VLLMBatchError
from airflow_vllm_batch.openai_api.batch_spec import BatchSpec, ForgedBatchError, signing_key
from airflow_vllm_batch.openai_api.progress import newest_run_parts, part_lines, split_expired
from airflow_vllm_batch.openai_api.routes import TASK_ID, ModelRoute, load_routes
from airflow_vllm_batch.openai_api.settings import DEFAULT_BATCH_DAG_ID, load_settings
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.storage import RunStaging, open_uri_lines, upload_file
from airflow_vllm_batch.version_compat import AirflowFailException, AirflowTaskTimeout

if TYPE_CHECKING:
    from airflow.sdk import DAG, Context

__all__ = ["TASK_ID", "OpenAIBatchOperator", "failure_record", "openai_batch_dag"]


def failure_record(err: VLLMBatchError) -> dict[str, Any]:
    """What ``errors.data`` of a failed batch says: a preflight failure's problems line by line, else the error.

    :param err: why the task failed.
    """
    report = getattr(err, "report", None) if isinstance(err, PreflightError) else None
    if report is not None and (report.problems or report.file_problems):
        # A problem of the whole file is in both lists (problems keeps the first ones listed): told once.
        problems = [*report.file_problems, *(p for p in report.problems if p not in report.file_problems)]
        errors = [
            {
                "code": "invalid_request",
                "line": problem.line or None,
                "param": None,
                "message": problem.message + (f" (custom_id {problem.custom_id!r})" if problem.custom_id else ""),
            }
            for problem in problems
        ]
        return {"stage": "preflight", "errors": errors}
    code = "invalid_file" if isinstance(err, PreflightError) else type(err).__name__
    return {"stage": "preflight" if isinstance(err, PreflightError) else "run", "errors": [{"code": code, "line": None, "param": None, "message": str(err)}]}


#: What the batch task's locations are until :meth:`OpenAIBatchOperator._bind_batch` derives them:
#: not an ``s3://`` URI, so that nothing can read or write through it.
UNBOUND = "unbound: derived from the run's signed batch spec when the task starts"
_BOUND = ("input_uri", "output_uri", "error_uri")


class OpenAIBatchOperator(VLLMBatchOperator):
    """Run one batch of the OpenAI API; when it fails, leave why at ``failure_uri`` for ``GET /batches/{id}``.

    The batch is the run's signed :class:`~.batch_spec.BatchSpec`: the task verifies it with
    ``[vllm_batch] openai_signing_key`` and derives its input, output, error, failure, cancel
    and progress locations from it and ``[vllm_batch] openai_files_uri``; none is an argument
    or a template, and a run whose conf the API did not sign fails before any read or write.

    When its ``execution_timeout`` (the batch's completion window) passes, the batch expires as
    OpenAI's do: the engine is stopped, the answers its checkpoint parts hold are published to
    the batch's output file (completed) and error file (failed, and every unanswered request as
    ``batch_expired``), an expiry record with the counts goes to ``failure_uri``, and the task
    fails without a retry.
    """

    # The locations are derived from the signed spec, not rendered from anything a user gives.
    template_fields: Sequence[str] = tuple(f for f in VLLMBatchOperator.template_fields if f not in _BOUND)

    def __init__(self, **kwargs: Any) -> None:
        given = sorted(set(kwargs) & {*_BOUND, "failure_uri", "requests"})
        if given:
            raise ConfigurationError(
                f"OpenAIBatchOperator takes no {', '.join(given)}: each batch's locations are derived from its signed conf "
                "and [vllm_batch] openai_files_uri. Remove the argument."
            )
        super().__init__(input_uri=UNBOUND, output_uri=UNBOUND, error_uri=UNBOUND, **kwargs)
        self.failure_uri = self.cancel_uri = self.progress_uri = UNBOUND
        self.batch: BatchSpec | None = None

    def _bind_batch(self, context: Context) -> None:
        """Verify the run's signed batch spec and derive every location from it; nothing is read or written before.

        Sets ``batch`` and ``input_uri``, ``output_uri``, ``error_uri``, ``failure_uri``,
        ``cancel_uri``, ``progress_uri``, and accepts only lines whose url is the batch's endpoint.

        :raises AirflowFailException: the conf is not one the API signed for this run (not retried).
        """
        dag_run = context.get("dag_run")
        try:
            files_uri = load_settings().files_uri
            spec = BatchSpec.verified(getattr(dag_run, "conf", None), str(getattr(dag_run, "run_id", "")), signing_key())
            if spec.route and spec.route != self.task_id:
                raise ForgedBatchError(
                    f"This batch runs on the task {spec.route!r}, not on {self.task_id!r}: nothing was read or written. "
                    "Do not mark the route task's branches by hand; create the batch again with POST /batches."
                )
        except (ForgedBatchError, ConfigurationError) as err:
            raise AirflowFailException(str(err)) from None
        where = spec.locations(files_uri)
        self.batch = spec
        self.input_uri, self.output_uri, self.error_uri = where.input_uri, where.output_uri, where.error_uri
        self.failure_uri, self.cancel_uri, self.progress_uri = where.failure_uri, where.cancel_uri, where.progress_uri
        # As OpenAI: every line's url is the batch's endpoint; preflight fails the others, naming their lines.
        self.supported_urls = [spec.endpoint]

    def _check_pinned_input(self) -> None:
        """Fail when the batch's copy of its input is not the one made at create (its ETag is signed).

        :raises InputNotFoundError: it is gone or was replaced (not retried: the batch cannot run as created).
        """
        assert self.batch is not None
        bucket, _, key = self.input_uri.removeprefix("s3://").partition("/")
        try:
            etag = self.hook.get_conn().head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
        except Exception as err:
            code = str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))
            if code not in ("404", "NoSuchKey", "NotFound"):
                raise
            etag = None
        if etag != self.batch.input_version:
            raise InputNotFoundError(
                f"The batch's copy of its input file ({self.batch.input_file_id}) is {'gone' if etag is None else 'not the one made at create'}: "
                "nothing was run. Create the batch again."
            )

    def execute(self, context: Context) -> dict[str, Any]:
        self._bind_batch(context)
        try:
            self._check_pinned_input()
        except InputNotFoundError as err:
            self.record_failure(err)
            raise AirflowFailException(str(err)) from None
        try:
            return super().execute(context)
        except AirflowTaskTimeout as timeout:
            # The task runner calls on_kill only for a timeout it sees; it sees AirflowFailException instead.
            self.on_kill()
            try:
                counts = self.publish_expired()
            except Exception as err:  # still expired, without files: a retry would run another window
                self.log.warning("Could not publish the expired batch's answers: %s", err)
                raise AirflowFailException(f"The batch's completion window ({self.execution_timeout}) passed: it expired") from timeout
            raise AirflowFailException(
                f"The batch's completion window ({self.execution_timeout}) passed: it expired. The answers "
                f"finished so far are published ({counts['completed']} completed, {counts['failed']} failed or "
                "unanswered, in the output and error files)"
            ) from timeout
        except Exception as err:
            # A mistake arrives as AirflowFailException raised in the handling of the VLLMBatchError
            # (no retries), ``from None`` so that the task log tells it once: the error is its context.
            cause = err if isinstance(err, VLLMBatchError) else (err.__cause__ or err.__context__)
            if isinstance(cause, VLLMBatchError):
                self.record_failure(cause)
            raise

    def publish_expired(self) -> dict[str, int]:
        """Publish the answers the newest run checkpointed, and the rest as ``batch_expired``; return the counts.

        Exactly once: each custom_id is written once, its first answer or ``batch_expired``.
        No run writes the output after this: the output file is the batch's own, and the task
        fails without a retry. The run's staging is removed once the files are written.
        """
        hook = self.hook
        client = hook.get_conn()
        bucket, _, output_key = self.output_uri.removeprefix("s3://").partition("/")
        parts = [key for key, _ in newest_run_parts(client, bucket, output_key)]
        with tempfile.TemporaryDirectory(prefix="vllm-batch-expired-") as scratch:
            out_path, err_path = Path(scratch, "output.jsonl"), Path(scratch, "errors.jsonl")
            with open(out_path, "wb") as output, open(err_path, "wb") as errors, open_uri_lines(hook, self.input_uri) as input_lines:
                counts = split_expired(part_lines(client, bucket, parts), input_lines, output, errors)
            record: dict[str, Any] = {"stage": "expired", "request_counts": counts, "output": False, "error": False}
            for path, uri, name in ((out_path, self.output_uri, "output"), (err_path, self.resolved_error_uri, "error")):
                if path.stat().st_size:
                    target_bucket, _, key = uri.removeprefix("s3://").partition("/")
                    upload_file(client, path, target_bucket, key)
                    record[name] = True
        failure_bucket, _, failure_key = self.failure_uri.removeprefix("s3://").partition("/")
        hook.load_bytes(json.dumps(record).encode(), key=failure_key, bucket_name=failure_bucket, replace=True)
        for prefix in {key.rsplit("/parts/", 1)[0] + "/" for key in parts}:
            try:
                RunStaging(hook, bucket, prefix).remove()
            except Exception as err:  # published already: a leftover staging only costs storage
                self.log.warning("Could not remove the expired batch's staging %s: %s", prefix, err)
        self.log.info("The batch expired: published %s", counts)
        return counts

    def record_failure(self, err: VLLMBatchError) -> None:
        """Write the failure record; a failure to write it is logged, not raised over the task's own error."""
        bucket, _, key = self.failure_uri.removeprefix("s3://").partition("/")
        try:
            self.hook.load_bytes(json.dumps(failure_record(err)).encode(), key=key, bucket_name=bucket, replace=True)
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
    :param completion_window: the task's ``execution_timeout``: a batch still running then expires,
        publishing the answers finished so far. Default 24 hours (OpenAI's only window).
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
        if not routes:
            OpenAIBatchOperator(task_id=TASK_ID, model=model, execution_timeout=completion_window, **operator_kwargs)
            return dag
        from airflow.providers.standard.operators.python import BranchPythonOperator

        route = BranchPythonOperator(task_id="route", python_callable=_chosen_route)
        for served in routes.values():
            kwargs = {**operator_kwargs, "engine": served.engine()}
            if served.queue:
                kwargs["queue"] = served.queue
            route >> OpenAIBatchOperator(
                task_id=served.task_id, model=served.model, execution_timeout=completion_window, **kwargs
            )
    return dag


def _chosen_route(dag_run: Any, **_: Any) -> str:
    """The batch task ``POST /batches`` chose, from the run's verified spec; any other run fails here, before any engine."""
    try:
        spec = BatchSpec.verified(dag_run.conf, dag_run.run_id, signing_key())
    except (ForgedBatchError, ConfigurationError) as err:
        raise AirflowFailException(str(err)) from None
    if not spec.route:
        raise AirflowFailException("this batch names no route: [vllm_batch] openai_models was set after it was created; create it again")
    return spec.route
