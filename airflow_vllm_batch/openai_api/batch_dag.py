"""The task of the batch DAG that runs the OpenAI API's batches, and the DAG itself.

A batch created with ``POST /batches`` is a run of the DAG named by ``[vllm_batch]
openai_batch_dag_id`` (default ``vllm_batch_openai``), its conf the :class:`~.batch_spec.BatchSpec`
the API signed. The task verifies it and derives every location from it and ``[vllm_batch]
openai_files_uri``; a run triggered by hand or with an edited conf fails before it reads or
writes anything. :func:`openai_batch_dag` builds that DAG; a one-line DAG file in the DAGs
folder calls it (the repo's ``dags/vllm_batch_openai.py``).
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_vllm_batch.exceptions import (
    ConfigurationError,
    EngineError,
    InputNotFoundError,
    PreflightError,
    VLLMBatchError,
)
from airflow_vllm_batch.openai_api.access import owner_key
from airflow_vllm_batch.openai_api.batch_spec import BatchSpec, ForgedBatchError, verification_keys
from airflow_vllm_batch.openai_api.media import media_domains, media_problems
from airflow_vllm_batch.openai_api.routes import TASK_ID, ModelRoute, load_routes
from airflow_vllm_batch.openai_api.settings import (
    DEFAULT_BATCH_DAG_ID,
    load_completion_windows,
    load_settings,
)
from airflow_vllm_batch.openai_api.status import endpoint_not_served, window_seconds
from airflow_vllm_batch.operators.task_try import task_try
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.storage.publishing import OutputStore
from airflow_vllm_batch.storage.s3 import head_etag, open_uri_lines
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
    cause = next(
        (m.group(0) for line in reversed(tail.splitlines()) if (m := _ROOT_CAUSE.search(line))), None
    )
    sentences = [s for s in re.split(r"(?<=[.;])\s+", head.strip()) if "XCom" not in s]
    text = re.sub(r"s3://\S+?(?=[\s,;)]|\.(?:\s|$)|$)", "the batch's files", " ".join(sentences)).strip()
    return f"{text} Cause: {cause}" if cause else text


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
                "message": public_message(problem.message)
                + (f" (custom_id {problem.custom_id!r})" if problem.custom_id else ""),
            }
            for problem in problems
        ]
        return {"stage": "preflight", "errors": errors}
    if isinstance(err, PreflightError):
        stage, code = "preflight", "invalid_file"
    else:
        stage, code = "run", "engine_error" if isinstance(err, EngineError) else "batch_failed"
    return {
        "stage": stage,
        "errors": [{"code": code, "line": None, "param": None, "message": public_message(str(err))}],
    }


#: What the batch task's locations are until :meth:`OpenAIBatchOperator._bind_batch` derives them:
#: not an ``s3://`` URI, so that nothing can read or write through it.
UNBOUND = "unbound: derived from the run's signed batch spec when the task starts"
_BOUND = ("input_uri", "output_uri", "error_uri")


class OpenAIBatchOperator(VLLMBatchOperator):
    """Run one batch of the OpenAI API; publish it as OpenAI's batches end: completed, expired or cancelled.

    The batch is the run's signed :class:`~.batch_spec.BatchSpec`: the task verifies it with
    ``[vllm_batch] openai_signing_key`` (or a key of ``openai_old_signing_keys``) and derives its input, output, error, failure, cancel
    and progress locations from it and ``[vllm_batch] openai_files_uri``; none is an argument
    or a template, and a run whose conf the API did not sign fails before any read or write.

    Per-request failures never fail the batch (no ``max_failed_ratio``): they are in its error
    file. The run stops itself, under the output's lease, when the batch's deadline
    (``expires_at``, from the signed ``created_at``: the same on every try) passes or a cancel
    was asked (the object at ``cancel_uri``, written by ``POST /batches/{id}/cancel``): the
    engine stops sending, and the answers made durable so far are published through the run
    protocol with a manifest whose ``status`` is ``expired`` or ``cancelled``, every other
    request in the error file as ``batch_expired`` / ``batch_cancelled``. The task then
    **succeeds**, returning that manifest: the batch ended as its user asked (or as its window
    allowed), nothing is left to retry, and the API maps the manifest's ``status``. A failure of
    the batch itself (a file preflight refuses, an engine that cannot start, a model that does
    not serve the endpoint) fails the task and leaves why at ``failure_uri``, worded for the
    batch's user.

    The published lines take OpenAI's shape (``result_shape="openai"``): ids ``batch_req_…``,
    HTTP failures in ``response.body.error``; the operator's own outputs keep vLLM's.
    """

    # The locations are derived from the signed spec, not rendered from anything a user gives.
    template_fields: Sequence[str] = tuple(f for f in VLLMBatchOperator.template_fields if f not in _BOUND)
    result_shape = "openai"

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
        #: The ``answer_cache`` URI the DAG was built with, under which each owner gets a prefix of their own.
        self._cache_root: str | None = None

    def _bind_batch(self, context: Context) -> None:
        """Verify the run's signed batch spec and derive every location from it; nothing is read or written before.

        Sets ``batch`` and ``input_uri``, ``output_uri``, ``error_uri``, ``failure_uri``,
        ``cancel_uri``, ``progress_uri``, and accepts only lines whose url is the batch's endpoint.

        :raises AirflowFailException: the conf is not one the API signed for this run of this DAG (not retried).
        """
        dag_run = context.get("dag_run")
        try:
            files_uri = load_settings().files_uri
            spec = BatchSpec.verified(
                getattr(dag_run, "conf", None),
                str(getattr(dag_run, "run_id", "")),
                verification_keys(),
                str(getattr(dag_run, "dag_id", "")),
            )
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
        self.failure_uri, self.cancel_uri, self.progress_uri = (
            where.failure_uri,
            where.cancel_uri,
            where.progress_uri,
        )
        # As OpenAI: every line's url is the batch's endpoint; preflight fails the others, naming their lines.
        self.supported_urls = [spec.endpoint]
        self._namespace_answer_cache(spec)

    def _namespace_answer_cache(self, spec: BatchSpec) -> None:
        """Give the batch's owner an answer cache of their own: ``<answer_cache uri>owners/<owner key>/``.

        A hit is the stored result line byte for byte (its ids, its ``created`` time, a sampled
        answer): shared between users, it would tell one user what another asked, and when. The
        namespace is derived from the signed owner, so every try of the batch (a retry included)
        looks up and fills the same one, and a user's identical request never reaches another's
        entries. The root is kept from the first bind, so binding again does not nest namespaces.
        """
        if self.answer_cache is None:
            return
        root = self._cache_root = self._cache_root or self.answer_cache.uri
        self.answer_cache = copy.copy(self.answer_cache)
        self.answer_cache.uri = owner_cache_uri(root, spec.owner)

    def _check_pinned_input(self) -> None:
        """Fail when the batch's copy of its input is not the one made at create (its ETag is signed).

        :raises InputNotFoundError: it is gone or was replaced (not retried: the batch cannot run as created).
        """
        assert self.batch is not None
        assert self.input_uri is not None  # bound with the batch
        bucket, _, key = self.input_uri.removeprefix("s3://").partition("/")
        etag = head_etag(self.hook.get_conn(), bucket, key)
        if etag != self.batch.input_version:
            raise InputNotFoundError(
                f"The batch's copy of its input file ({self.batch.input_file_id}) is {'gone' if etag is None else 'not the one made at create'}: "
                "nothing was run. Create the batch again."
            )

    def execute(self, context: Context) -> dict[str, Any]:
        self._bind_batch(context)
        ended = self.ended_manifest()
        if ended is not None:
            # Final is final: the batch's ending, whatever identity this try has; the same check as its first time.
            self.refuse_unserved_endpoint(ended)
            return ended
        # This try owns the batch's ending now: an earlier try's reason (a cleared run's) is no longer it.
        self.clear_failure_record()
        try:
            self._check_pinned_input()
        except InputNotFoundError as err:
            self.record_failure(failure_record(err))
            raise AirflowFailException(str(err)) from None
        self._refuse_media_urls()
        try:
            manifest = super().execute(context)
        except Exception as err:
            # A mistake arrives as AirflowFailException raised in the handling of the VLLMBatchError
            # (no retries), ``from None`` so that the task log tells it once: the error is its context.
            cause = err if isinstance(err, VLLMBatchError) else (err.__cause__ or err.__context__)
            if isinstance(cause, VLLMBatchError) and (
                not cause.retryable or task_try(context, self.retries).last_try
            ):
                self.record_failure(failure_record(cause))
            raise
        self.refuse_unserved_endpoint(manifest)
        return manifest

    def _refuse_media_urls(self) -> None:
        """Fail the batch, before any engine starts, when a line names a media URL the workers may not fetch.

        Reads the batch's pinned input copy once (:mod:`.media`); the failure record names the
        lines and hosts (read by the batch's owner only), the task log their numbers only.

        :raises AirflowFailException: a line names a refused media URL (not retried: the file is the batch's).
        """
        assert self.input_uri is not None  # bound with the batch
        allowed = media_domains()
        with open_uri_lines(self.hook, self.input_uri) as lines:
            count, errors = media_problems(lines, allowed)
        if not count:
            return
        self.record_failure({"stage": "preflight", "errors": errors})
        numbers = ", ".join(str(e["line"]) for e in errors[:10])
        raise AirflowFailException(
            f"{count} line(s) of the batch name a media URL the workers may not fetch (lines {numbers}"
            f"{', ...' if count > 10 else ''}): nothing was run. Send media inline as data: URLs, or allow their "
            "hosts in [vllm_batch] openai_media_domains on the workers."
        )

    def ended_manifest(self) -> dict[str, Any] | None:
        """The manifest of this batch's ending when it has ended (published), whatever run identity published it.

        Checked before anything else (the input's copy, the engine, the lease), and again by the run under
        the lease (``write_once``): once ended, a batch's files and status never change.
        """
        assert self.batch is not None
        store = OutputStore(self.hook, str(self.output_uri), self.error_uri)
        manifest, why = store.ended(self.batch.input_version)
        if manifest is None:
            return None
        self.log.info("The batch has ended: %s (%s). Nothing is run or written.", why, store.manifest_uri)
        return manifest.to_dict()

    def run_callbacks(self) -> dict[str, Any]:
        return {"stop": self.stop_condition, "on_checkpoint": self.write_progress, "write_once": True}

    def stop_condition(self) -> str | None:
        """``"cancelled"`` once a cancel was asked, ``"expired"`` once ``expires_at`` passed, else None."""
        assert self.batch is not None
        bucket, _, key = self.cancel_uri.removeprefix("s3://").partition("/")
        try:
            if self.hook.head_object(key, bucket_name=bucket) is not None:
                return "cancelled"
        # S3 failing for a moment is no reason to stop, nor to fail: the next poll asks again.
        except Exception as err:  # noqa: BLE001 - see above
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
        body = {
            "completed": int(counts["completed"]),
            "failed": int(counts["failed"]),
            "updated_at": int(time.time()),
        }
        self.hook.load_bytes(json.dumps(body).encode(), key=key, bucket_name=bucket, replace=True)

    def fail_on_too_many_failures(
        self, manifest: Manifest, max_failed_ratio: float, context: Context
    ) -> None:
        """Never: as OpenAI's, a batch's failed requests are in its error file, and the batch completes."""

    def refuse_unserved_endpoint(self, manifest: Mapping[str, Any]) -> None:
        """Fail the batch whose every request the server answered 404: its model does not serve the endpoint.

        That is the batch's failure, not its requests' (an embeddings batch sent to a chat model):
        its status says so, with the server's own words; the files stay published.
        """
        if not endpoint_not_served(manifest):
            return
        total = int((manifest.get("request_counts") or {}).get("total") or 0)
        assert self.batch is not None
        said = self.first_error_message(manifest.get("error_uri"))
        message = (
            f"Every one of the batch's {total} requests was answered HTTP 404 by the model's server at {self.batch.endpoint}"
            + (f" ({said})" if said else "")
            + f": the model does not serve {self.batch.endpoint}. Send these requests to a model that serves it."
        )
        self.record_failure(
            {
                "stage": "run",
                "errors": [
                    {"code": "endpoint_not_served", "line": None, "param": "endpoint", "message": message}
                ],
            }
        )
        raise AirflowFailException(message)

    def first_error_message(self, error_uri: str | None) -> str | None:
        """The message of the error file's first line, or None."""
        if not error_uri:
            return None
        try:
            with open_uri_lines(self.hook, error_uri) as lines:
                line = json.loads(next(iter(lines)))
        except Exception:  # noqa: BLE001 - the failure is told without the example
            return None
        body = ((line.get("response") or {}).get("body") or {}).get("error") or line.get("error") or {}
        return body.get("message") if isinstance(body, dict) else None

    def clear_failure_record(self) -> None:
        """Remove an earlier try's failure record (a run cleared after it failed); a failure to is logged."""
        bucket, _, key = self.failure_uri.removeprefix("s3://").partition("/")
        try:
            self.hook.get_conn().delete_object(Bucket=bucket, Key=key)
        except Exception as err:  # noqa: BLE001 - the try goes on; a status may show the old reason meanwhile
            self.log.warning("Could not remove the earlier failure record %s: %s", self.failure_uri, err)

    def record_failure(self, record: Mapping[str, Any]) -> None:
        """Write the failure record; a failure to write it is logged, not raised over the task's own error."""
        bucket, _, key = self.failure_uri.removeprefix("s3://").partition("/")
        try:
            self.hook.load_bytes(json.dumps(record).encode(), key=key, bucket_name=bucket, replace=True)
        except Exception as write_err:  # noqa: BLE001 - the batch's own error is the one to raise
            self.log.warning(
                "Could not write the batch's failure record to %s: %s", self.failure_uri, write_err
            )


def owner_cache_uri(root: str, owner: str) -> str:
    """The answer cache of one API user's batches: their own prefix under the DAG's ``answer_cache`` URI.

    :param root: the ``answer_cache`` URI the DAG was built with (``s3://bucket/prefix/``).
    :param owner: the batch's signed owner (a user id).
    """
    return f"{root.rstrip('/')}/owners/{owner_key(owner)}/"


def openai_batch_dag(
    *,
    model: str | None = None,
    dag_id: str = DEFAULT_BATCH_DAG_ID,
    completion_window: timedelta | None = None,
    routes: dict[str, ModelRoute] | None = None,
    retries: int = 2,
    retry_delay: timedelta = timedelta(minutes=5),
    max_active_runs: int = 4,
    execution_timeout: timedelta | None = None,
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
        checked by the run itself, which then publishes what is answered). Default: the longest of
        ``[vllm_batch] openai_completion_windows`` (``24h``, OpenAI's only window, when unset), read when the
        DAG file is parsed; a shorter one is refused there, since a batch of a longer window would be
        killed by the timeout before its ``expires_at`` instead of expiring with its answers.
    :param routes: the served models (default: ``[vllm_batch] openai_models``, read when the DAG file is parsed).
    :param retries: the batch task's retries (default 2): a retry resumes from the answers earlier tries made
        durable (a lost worker, S3 failing for a while, an engine that died); a batch's own failure (a bad file,
        a model that does not serve the endpoint) is never retried.
    :param retry_delay: the wait before a retry (default 5 minutes, Airflow's).
    :param max_active_runs: how many batches run at once (default 4); the others wait ``queued``, and
        show ``validating``.
    :param execution_timeout: the batch task's, instead of the longest window plus :data:`EXPIRY_GRACE`;
        refused when shorter than the longest window offered.
    :param operator_kwargs: more ``VLLMBatchOperator`` arguments (``engine=VLLMRunner(args=[...])``, ...);
        a route's engine (its ``vllm_conn_id``, or ``engine_args`` for the runner) and ``queue`` replace them for its task.
    """
    from airflow.sdk import DAG

    routes = load_routes() if routes is None else routes
    if not routes and not model:
        raise ConfigurationError(
            "openai_batch_dag needs model= or [vllm_batch] openai_models (the served models)"
        )
    timeout = _execution_timeout(completion_window, execution_timeout)
    with DAG(
        dag_id=dag_id,
        schedule=None,
        catchup=False,
        is_paused_upon_creation=False,
        default_args={"retries": retries, "retry_delay": retry_delay},
        max_active_runs=max_active_runs,
        tags=["vllm-batch", "openai-api"],
        doc_md="Runs the batches of the OpenAI Batches API (`POST /vllm-batch/openai/v1/batches`): one run per batch.",
    ) as dag:
        if not routes:
            OpenAIBatchOperator(
                task_id=TASK_ID,
                model=model,
                execution_timeout=timeout,
                **operator_kwargs,
            )
            return dag
        from airflow.providers.standard.operators.python import BranchPythonOperator

        route = BranchPythonOperator(task_id="route", python_callable=_chosen_route)
        for served in routes.values():
            kwargs = {**operator_kwargs, "engine": served.engine()}
            if served.queue:
                kwargs["queue"] = served.queue
            route >> OpenAIBatchOperator(
                task_id=served.task_id,
                model=served.model,
                execution_timeout=timeout,
                **kwargs,
            )
    return dag


def _execution_timeout(completion_window: timedelta | None, given: timedelta | None) -> timedelta:
    """The batch task's ``execution_timeout``: the longest window offered plus :data:`EXPIRY_GRACE`, unless ``given``.

    :raises ConfigurationError: ``completion_window`` or ``given`` is shorter than a window ``POST /batches`` offers.
    """
    offered = load_completion_windows()
    longest_name = max(offered, key=window_seconds)
    longest = timedelta(seconds=window_seconds(longest_name))
    window = longest if completion_window is None else completion_window
    for name, value in (("completion_window", window), ("execution_timeout", given)):
        if value is not None and value < longest:
            raise ConfigurationError(
                f"openai_batch_dag({name}={value}) is shorter than the {longest_name} window of [vllm_batch] "
                f"openai_completion_windows: its batches would be killed before their expires_at. Leave {name} out "
                "(the longest window plus an hour) or offer shorter windows."
            )
    return given if given is not None else window + EXPIRY_GRACE


def _chosen_route(dag_run: Any, **_: Any) -> str:
    """The batch task ``POST /batches`` chose, from the run's verified spec; any other run fails here, before any engine."""
    try:
        spec = BatchSpec.verified(dag_run.conf, dag_run.run_id, verification_keys(), dag_run.dag_id)
    except (ForgedBatchError, ConfigurationError) as err:
        raise AirflowFailException(str(err)) from None
    if not spec.route:
        raise AirflowFailException(
            "this batch names no route: [vllm_batch] openai_models was set after it was created; create it again"
        )
    return spec.route
