"""What the API shows of a batch: its verified spec, the API's record and what its task left in S3.

Reads only signed or derived facts (the verified spec, the locations it derives, the API's own
record written at create, the run's and its task's states and records), never an unsigned conf
field. Whether a batch has ended is decided by the storage layer's own rule
(:meth:`~airflow_vllm_batch.storage.publishing.OutputStore.ended`), the one the batch task
applies before it runs anything: the API and the task cannot disagree on it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from airflow_vllm_batch.openai_api.routes import TASK_ID
from airflow_vllm_batch.openai_api.status import BatchDagRun, batch_object, batch_status
from airflow_vllm_batch.storage.publishing import OutputStore

if TYPE_CHECKING:
    from datetime import datetime

    from airflow_vllm_batch.openai_api.batch_runs import BatchRun
    from airflow_vllm_batch.openai_api.batch_spec import BatchSpec
    from airflow_vllm_batch.openai_api.files import FileStore

log = logging.getLogger(__name__)


class StoreHook:
    """What :class:`~airflow_vllm_batch.storage.publishing.OutputStore` reads of an S3 hook, over the API's client.

    :param client: the API's boto3 S3 client (its :class:`.files.FileStore`'s).
    :param aws_conn_id: the connection it was made from (named in the storage layer's messages).
    """

    def __init__(self, client: Any, aws_conn_id: str) -> None:
        self.client, self.aws_conn_id = client, aws_conn_id

    def get_conn(self) -> Any:
        return self.client


def shown_conf(spec: BatchSpec, record: dict[str, Any]) -> dict[str, Any]:
    """What :func:`.status.batch_object` reads of a batch: the verified spec's fields, and the API's record of it.

    The file ids are derived from the batch id; the line count, the model and the window's name
    come from the record the API wrote at create (a re-triggered conf can change none of them).
    """
    return {
        **asdict(spec),
        "output_file_id": spec.output_file_id,
        "error_file_id": spec.error_file_id,
        "metadata": record.get("metadata") or {},
        "completion_window": record.get("completion_window"),
        "total": record.get("total"),
        "model": record.get("model"),
    }


def batch_from_run(store: FileStore, batch: BatchRun, aws_conn_id: str, live: bool = False) -> dict[str, Any]:
    """The Batch object of a batch run, with what its task left in S3.

    :param store: the API's store.
    :param batch: the run, its verified spec and its task instances.
    :param aws_conn_id: the connection of ``store``'s client.
    :param live: read a running batch's live counts (its progress record, one small object).
    """
    run, spec = batch.run, batch.spec
    where = spec.locations(store.uri(store.prefix))
    record = store.get_json(store.batch_record_key(run.run_id)) or {}
    # The run's conf holds no location and no metadata: the derived locations and the API's record add them.
    conf = {**shown_conf(spec, record), "output_uri": where.output_uri}
    state = _state_name(run.state)
    # The batch task (with openai_models, the route's): the route task and the routes not taken do not count.
    tis = [
        ti
        for ti in batch.task_instances
        if ti.task_id.startswith(TASK_ID) and _state_name(ti.state) != "skipped"
    ]
    task_states = [_state_name(ti.state) for ti in tis]
    starts = [ti.start_date for ti in tis if ti.start_date is not None]
    ends = [ti.end_date for ti in tis if ti.end_date is not None]
    failure = None
    manifest, published_at = ending(store, spec, where.output_uri, where.error_uri, aws_conn_id)
    if state == "failed" or "failed" in task_states:
        failure = store.get_json(store.failure_key(run.run_id))
    cancel = store.get_json(store.cancel_key(run.run_id)) if manifest is None and state != "success" else None
    view = BatchDagRun(
        conf=conf,
        run_state=state,
        task_states=task_states,
        task_start=min(starts) if starts else None,
        task_end=max(ends) if ends else None,
        run_end=run.end_date,
        manifest=manifest,
        published_at=published_at,
        failure=failure,
        cancelling_at=(cancel or {}).get("cancelling_at"),
    )
    now = time.time()
    if live and batch_status(view, now) in ("in_progress", "cancelling"):
        view.progress = live_progress(store, run.run_id)
    return batch_object(run.run_id, view, now)


def published_manifest(
    store: FileStore, spec: BatchSpec, output_uri: str, error_uri: str, aws_conn_id: str
) -> dict[str, Any] | None:
    """The manifest of the batch's ending once it has ended, whatever run identity published it; else None.

    The storage layer's rule for a write-once output (:meth:`OutputStore.ended`): a manifest
    pinning the batch's input copy (its signed ETag) whose files still have its ETags. A
    tombstone (a try publishing, or stopped while it did) and a manifest whose files were
    replaced since are no ending. A file its owner deleted (``DELETE /files``) does not undo
    it: the batch ended, and its status stays.

    :raises ManifestVersionError: the manifest is of a newer schema than this package reads.
    """
    return ending(store, spec, output_uri, error_uri, aws_conn_id)[0]


def ending(
    store: FileStore, spec: BatchSpec, output_uri: str, error_uri: str, aws_conn_id: str
) -> tuple[dict[str, Any] | None, datetime | None]:
    """:func:`published_manifest`, and when it was published: its object's ``LastModified`` in S3.

    The one time of an ended batch that no later read or try moves: the manifest is written
    once (nothing publishes over an ended batch), whereas the run's and its task's end dates
    come a moment after it and change with a clear.
    """
    outputs = OutputStore(StoreHook(store.client, aws_conn_id), output_uri, error_uri)  # type: ignore[arg-type]
    manifest, _ = outputs.ended(spec.input_version)
    if manifest is None:
        return None, None
    return manifest.to_dict(), outputs.manifest_modified


def live_progress(store: FileStore, batch_id: str) -> dict[str, int] | None:
    """What a running batch answered so far: the progress record its task writes at each checkpoint; None when unknown.

    Never fails the status call: a record that cannot be read reports 0 so far.
    """
    try:
        record = store.get_json(store.progress_key(batch_id))
    except Exception as err:  # noqa: BLE001 - the status is worth more than the count
        log.warning("Could not read the progress of batch %s: %s", batch_id, err)
        return None
    if not isinstance(record, dict):
        return None
    return {"completed": int(record.get("completed") or 0), "failed": int(record.get("failed") or 0)}


def _state_name(state: Any) -> str | None:
    """A state enum's value (``"success"``), or None."""
    return None if state is None else str(getattr(state, "value", state))
