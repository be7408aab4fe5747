"""Per-user limits of the OpenAI API: stored uploads, and batches (and their requests) that have not ended.

Each limit is an option of ``[vllm_batch]`` (0: no limit) and is checked when a user asks
for more: ``POST /files`` against the files and bytes they keep, ``POST /batches``
against their batches that have not ended and the requests those hold. A refusal is HTTP
429 in OpenAI's error shape, as its rate-limit errors are (the limited dimension as
``type``, a ``code`` ending ``_limit_exceeded`` as the Batch API's ``token_limit_exceeded``),
with ``x-should-retry: false`` so that the SDK raises ``RateLimitError`` at once instead of
retrying what only an ended batch or a deleted file can change.

The checks count what exists when the call starts; two calls of one user at the same
instant may both pass (a soft limit, exceeded by at most the calls in flight).

Fair order follows from the batch cap, which is on by default: ``openai_max_user_active_batches``
is ``auto``, half the batch DAG's ``max_active_runs`` (at least 1). One user's batches can then
hold no more run slots than the cap, queued ones included, so a burst of one user leaves the
other slots to the others' batches, which Airflow's scheduler starts oldest first; and a batch
waits behind at most the cap's worth of each other user's batches. The other limits are off
(0) by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_vllm_batch.exceptions import ConfigurationError

if TYPE_CHECKING:
    from airflow_vllm_batch.openai_api.batch_runs import Verifier
    from airflow_vllm_batch.openai_api.files import FileStore

SECTION = "vllm_batch"
#: The options, by field of :class:`UserLimits`.
OPTIONS = {
    "max_files": "openai_max_user_files",
    "max_bytes": "openai_max_user_bytes",
    "max_active_batches": "openai_max_user_active_batches",
    "max_enqueued_requests": "openai_max_user_enqueued_requests",
}
#: The value of ``openai_max_user_active_batches`` (its default) that derives the cap from the batch DAG.
AUTO = "auto"


@dataclass(frozen=True)
class UserLimits:
    """What one user may hold at a time; 0 is no limit.

    :param max_files: uploaded files kept (``openai_max_user_files``).
    :param max_bytes: bytes of uploaded files kept (``openai_max_user_bytes``).
    :param max_active_batches: batches not ended (``openai_max_user_active_batches``); None for
        ``auto``: half the batch DAG's ``max_active_runs``, at least 1 (:func:`batch_cap`).
    :param max_enqueued_requests: requests of the batches not ended, the new one's included
        (``openai_max_user_enqueued_requests``).
    """

    max_files: int = 0
    max_bytes: int = 0
    max_active_batches: int | None = None
    max_enqueued_requests: int = 0


class LimitExceeded(Exception):
    """A call over a user's limit: answered 429 in OpenAI's shape.

    :param message: what was exceeded and what to do.
    :param kind: the limited dimension (OpenAI's ``type`` of a rate-limit error): ``files``, ``bytes``, ``batches``, ``requests``.
    :param param: the request parameter the limit is about.
    """

    status = 429

    def __init__(self, message: str, kind: str, param: str) -> None:
        super().__init__(message)
        self.kind, self.param = kind, param
        self.code = f"{kind}_limit_exceeded"


def load_limits() -> UserLimits:
    """The limits of ``[vllm_batch]``.

    :raises ConfigurationError: an option is not a whole number of 0 or more (or, for the batch cap, ``auto``).
    """
    batch_cap_raw = _option("max_active_batches", AUTO)
    return UserLimits(
        max_files=_whole("max_files", _option("max_files", "0")),
        max_bytes=_whole("max_bytes", _option("max_bytes", "0")),
        max_active_batches=None
        if batch_cap_raw.lower() == AUTO
        else _whole("max_active_batches", batch_cap_raw),
        max_enqueued_requests=_whole("max_enqueued_requests", _option("max_enqueued_requests", "0")),
    )


def _option(name: str, default: str) -> str:
    """The raw value of the option of :class:`UserLimits`'s field ``name``."""
    from airflow_vllm_batch.version_compat import conf

    return (conf.get(SECTION, OPTIONS[name], fallback=default) or default).strip()


def _whole(name: str, raw: str) -> int:
    """``raw`` as a whole number of 0 or more.

    :raises ConfigurationError: it is not one, naming the option (and ``auto`` where it may be given).
    """
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        option = OPTIONS[name]
        also = (
            f", or {AUTO!r} for half the batch DAG's max_active_runs" if name == "max_active_batches" else ""
        )
        raise ConfigurationError(
            f"[{SECTION}] {option} is {raw!r}: give a whole number, 0 for no limit{also} "
            f"(AIRFLOW__VLLM_BATCH__{option.upper()})"
        )
    return value


def batch_cap(configured: int | None, dag_slots: int | None) -> tuple[int, str]:
    """The cap on one user's batches that have not ended, and how it was set (for the 429's message).

    :param configured: ``openai_max_user_active_batches`` (None: ``auto``).
    :param dag_slots: the batch DAG's ``max_active_runs`` (None: the DAG is not deployed, and no
        batch can be created anyway).
    :return: the cap (0: none) and the option's value as the message names it.
    """
    if configured is not None:
        return configured, f"[{SECTION}] {OPTIONS['max_active_batches']} = {configured}"
    if dag_slots is None:
        return 0, ""
    cap = max(1, dag_slots // 2)
    return cap, (
        f"[{SECTION}] {OPTIONS['max_active_batches']} = {AUTO}: half the batch DAG's max_active_runs ({dag_slots}), "
        "so that other users' batches keep the other run slots"
    )


def check_new_file(limits: UserLimits, files: int) -> None:
    """Refuse an upload when the user keeps ``max_files`` already.

    :param files: the uploads they keep (:meth:`.files.FileStore.upload_usage`).
    :raises LimitExceeded: they keep as many as allowed.
    """
    if limits.max_files and files >= limits.max_files:
        raise LimitExceeded(
            f"You keep {files} uploaded files, the most allowed ([{SECTION}] {OPTIONS['max_files']} = {limits.max_files}): "
            "delete files you no longer need (DELETE /files/{file_id}) and upload again.",
            "files",
            "file",
        )


def check_file_bytes(limits: UserLimits, kept: int, uploading: int) -> None:
    """Refuse an upload once its bytes so far and the user's kept bytes pass ``max_bytes``.

    :param kept: the bytes of the uploads they keep.
    :param uploading: the bytes of this upload received so far.
    :raises LimitExceeded: the sum passes the limit (nothing of the upload is kept).
    """
    if limits.max_bytes and kept + uploading > limits.max_bytes:
        raise LimitExceeded(
            f"This upload would bring your stored files past {limits.max_bytes} bytes ([{SECTION}] "
            f"{OPTIONS['max_bytes']}; you keep {kept}): nothing was kept. Delete files you no longer need, or split the file.",
            "bytes",
            "file",
        )


def check_new_batch(
    limits: UserLimits, active_requests: Sequence[int], new_requests: int, dag_slots: int | None = None
) -> None:
    """Refuse a batch when the user's batches that have not ended are at the caps.

    :param active_requests: the request count of each of their batches that has not ended.
    :param new_requests: the new batch's requests (its input file's lines).
    :param dag_slots: the batch DAG's ``max_active_runs``, for the ``auto`` batch cap.
    :raises LimitExceeded: the batch cap is reached, or the requests would pass theirs.
    """
    active = len(active_requests)
    cap, source = batch_cap(limits.max_active_batches, dag_slots)
    if cap and active >= cap:
        raise LimitExceeded(
            f"You have {active} batches that have not ended, the most allowed at a time ({source}): "
            "create this one when one of them has ended.",
            "batches",
            "input_file_id",
        )
    enqueued = sum(active_requests)
    if limits.max_enqueued_requests and enqueued + new_requests > limits.max_enqueued_requests:
        raise LimitExceeded(
            f"Your batches that have not ended hold {enqueued} requests and this one {new_requests}: more than the "
            f"{limits.max_enqueued_requests} allowed at a time ([{SECTION}] {OPTIONS['max_enqueued_requests']}). "
            "Create it when some have ended, or split the file.",
            "requests",
            "input_file_id",
        )


def check_upload(limits: UserLimits, store: FileStore, owner: str) -> int:
    """Refuse an upload over the user's file cap; the bytes of the uploads they keep (0 when no limit needs them).

    :param store: the API's files.
    :param owner: the user's key (:func:`.access.owner_key`).
    :raises LimitExceeded: they keep as many files as allowed.
    """
    if not (limits.max_files or limits.max_bytes):
        return 0
    files, kept = store.upload_usage(owner)
    check_new_file(limits, files)
    return kept


def check_batch(
    limits: UserLimits,
    dag_id: str,
    store: FileStore,
    aws_conn_id: str,
    user: Any,
    requests: int,
    verify: Verifier,
) -> None:
    """Refuse a batch over the user's caps of batches (and requests) that have not ended.

    A batch has not ended while its run is queued or running and its ending is not published:
    the status shows a batch ``cancelled`` (or ``completed``) once its manifest is, a few
    seconds before its run ends, and the cap counts what the user sees.

    :param dag_id: the batch DAG.
    :param store: the API's files (the batches' records hold their request counts).
    :param aws_conn_id: the connection of ``store``'s client (named in the storage layer's messages).
    :param user: the caller (Airflow's user).
    :param requests: the new batch's requests.
    :param verify: the request's verifier (only the runs the API signed count).
    :raises LimitExceeded: a cap is reached.
    """
    if not (limits.max_active_batches != 0 or limits.max_enqueued_requests):
        return
    from airflow_vllm_batch.openai_api.batch_runs import active_batches, dag_max_active_runs
    from airflow_vllm_batch.openai_api.batch_view import published_manifest

    dag_slots = dag_max_active_runs(dag_id) if limits.max_active_batches is None else None
    files_uri = store.uri(store.prefix)
    active = []
    for batch_id, spec in active_batches(dag_id, user.get_id(), user.get_name(), verify):
        where = spec.locations(files_uri)
        if published_manifest(store, spec, where.output_uri, where.error_uri, aws_conn_id) is None:
            active.append(batch_id)
    # A batch's request count is in the API's record (one small object each); read only for the request cap.
    totals = [
        int((store.get_json(store.batch_record_key(b)) or {}).get("total") or 0)
        if limits.max_enqueued_requests
        else 0
        for b in active
    ]
    check_new_batch(limits, totals, requests, dag_slots)
