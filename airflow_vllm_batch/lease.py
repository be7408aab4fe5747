"""One writer per output: a lease object beside it, ``<output stem>.lease.json``.

A run takes the lease before it stages or publishes anything and gives it back when it
ends. While it holds the lease, a thread rewrites it every ``heartbeat_s`` seconds. Another
run that finds a live lease fails at once with a message naming the holder; nothing of
either run is overwritten or deleted. A lease never outlives a killed task for long:

* the *same task instance* (same DAG, run, task and map index: a retry, or a clear) takes
  the lease over at once, because Airflow never runs two tries of one task instance at
  the same time; so request-level resume after a SIGKILL is never blocked by the dead
  try's own lease. A take-over never goes to an *older* try: a zombie (a try Airflow gave
  up on, still running beside its successor) finding its successor's lease stops, however
  long that lease has been silent;
* anyone else takes it over once its heartbeat is older than ``stale_after_s``, measured
  on the S3 server's clock (the object's ``LastModified`` against the response's ``Date``),
  so workers' clocks do not matter.

Writes are conditional (``If-None-Match: *`` to create, ``If-Match: <etag>`` to renew or
take over, and to delete), so two runs racing for a free output cannot both win. On a
store without conditional writes the lease is read back after writing, which narrows the
race to the time between the two.

Every write puts a fresh *nonce* into the lease's body. A write whose PUT landed but whose
response was lost is retried by botocore with the same (now old) ``If-Match`` and gets 412;
so on any failed write the lease is read back, and when it holds this holder with a nonce
this lease wrote, the write landed: its ETag is adopted and the lease is still held (Fencing:
only a body someone else wrote means another run took over). When the lease cannot be read
back either, the write's own error is raised, never :class:`OutputBusyError`: a heartbeat
tries again at its next beat, whose 412 then finds this lease's nonce (Bounded).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from email.utils import parsedate_to_datetime
from typing import Any, NamedTuple

from botocore.exceptions import BotoCoreError, ClientError

from airflow_vllm_batch.exceptions import OutputBusyError

log = logging.getLogger(__name__)

#: Seconds between heartbeats of a held lease.
DEFAULT_HEARTBEAT_S = 30.0
#: Seconds after the last heartbeat at which another run may take the lease over.
DEFAULT_STALE_AFTER_S = 120.0
#: Reads of the lease one acquisition makes at most (a lease given back meanwhile is read again).
ACQUIRE_ROUNDS = 3
#: What a conditional write answers when its object is gone (S3: 404 NoSuchKey; SeaweedFS: 412).
_GONE_CODES = frozenset({"NoSuchKey", "404", "PreconditionFailed", "412"})


@dataclass(frozen=True, kw_only=True)
class TaskTry:
    """Who a task try is, read once from Airflow's context (:func:`airflow_vllm_batch.operators.task_try.task_try`).

    :param dag_id: the DAG.
    :param run_id: the DAG run.
    :param task_id: the task.
    :param map_index: the map index. Default -1 (not mapped).
    :param try_number: the try. Default 0.
    :param last_try: whether this is the task's last try (Airflow does not retry it on failure). Default True.
    """

    dag_id: str
    run_id: str
    task_id: str
    map_index: int = -1
    try_number: int = 0
    last_try: bool = True


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds (or asks for) an output.

    :param dag_id: the DAG.
    :param run_id: the DAG run.
    :param task_id: the task.
    :param map_index: the map index (-1 when not mapped).
    :param try_number: the try.
    :param fingerprint: the run identity's fingerprint.
    :param hostname: the worker.
    """

    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    try_number: int
    fingerprint: str
    hostname: str = socket.gethostname()

    @classmethod
    def of_try(cls, task: TaskTry, fingerprint: str) -> LeaseHolder:
        """The holder for one task try."""
        return cls(
            dag_id=task.dag_id,
            run_id=task.run_id,
            task_id=task.task_id,
            map_index=task.map_index,
            try_number=task.try_number,
            fingerprint=fingerprint,
        )

    def same_task_instance(self, other: LeaseHolder) -> bool:
        """Whether ``other`` is another try of the same task instance."""
        return (self.dag_id, self.run_id, self.task_id, self.map_index) == (
            other.dag_id,
            other.run_id,
            other.task_id,
            other.map_index,
        )

    def describe(self) -> str:
        where = f"{self.dag_id}.{self.task_id}" + (f"[{self.map_index}]" if self.map_index >= 0 else "")
        return f"{where} of run {self.run_id!r} (try {self.try_number}, on {self.hostname})"


class LeaseState(NamedTuple):
    """The lease object as read from S3.

    :param holder: who holds it (None when its body cannot be read: free to take over).
    :param etag: its ETag.
    :param age: seconds since it was written, on the S3 server's clock.
    :param nonce: the nonce of the write that made it (None in a lease written without one).
    """

    holder: LeaseHolder | None
    etag: str
    age: float
    nonce: str | None


class OutputLease:
    """The lease of one output; a context manager that acquires, heartbeats and releases it.

    :param client: a boto3 S3 client (only ``get_object``, ``put_object`` and ``delete_object`` are used).
    :param bucket: the output's bucket.
    :param key: the lease object's key.
    :param holder: who asks for it.
    :param heartbeat_s: seconds between heartbeats.
    :param stale_after_s: seconds without a heartbeat after which others may take it.
    :param clock: the wall clock written into the lease as ``written_at`` (for people reading
        it; staleness is measured on the S3 server's clock). Default ``time.time``.
    """

    def __init__(
        self,
        client: Any,
        bucket: str,
        key: str,
        holder: LeaseHolder,
        *,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.key = key
        self.holder = holder
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._etag: str | None = None
        #: The nonces of this lease's writes: a lease body holding one was written by this lease.
        self._nonces: set[str] = set()
        self._beats = 0
        self._beat_done = threading.Condition()
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def __enter__(self) -> OutputLease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lease, or raise :class:`OutputBusyError` naming the run that holds it.

        A lease given back between this try's read of it and its take-over write (its holder
        ended; the write's ``If-Match`` then finds no object), or taken meanwhile by an older try
        of this task instance (a zombie racing it: simulator seed 2335 at fdc20fc), is read and
        taken again, up to :data:`ACQUIRE_ROUNDS` reads, rather than failing the try (Liveness).
        """
        for round_ in range(1, ACQUIRE_ROUNDS + 1):
            try:
                self._take(self._read())
                break
            except (ClientError, OutputBusyError) as err:
                if round_ == ACQUIRE_ROUNDS or (
                    isinstance(err, ClientError) and _code(err) not in _GONE_CODES
                ):
                    raise
                now = self._read()
                older = (
                    now is not None and now.holder is not None and now.holder.same_task_instance(self.holder)
                )
                # `older` holds only with a holder: mypy cannot carry that through the bool.
                if now is not None and not (older and now.holder.try_number < self.holder.try_number):  # type: ignore[union-attr]
                    raise  # someone the rules let hold it: not a lease given back, nor one an older try took meanwhile
                log.info(
                    "The lease %s was given back (or taken by an older try) while this try took it over; taking it again.",
                    self.uri,
                )
        self._verify()
        self._thread = threading.Thread(target=self._heartbeat, name="vllm-batch-lease", daemon=True)
        self._thread.start()

    def _take(self, current: LeaseState | None) -> None:
        """Create the lease (``current`` None), or take it over from the holder ``current`` names, if the rules allow."""
        if current is None:
            self._write(IfNoneMatch="*")
        else:
            other, etag, age, _ = current
            if (
                other is not None
                and other.same_task_instance(self.holder)
                and other.try_number > self.holder.try_number
            ):
                # A take-over never goes to an older try: this try is a zombie whose successor took the
                # lease (Airflow started it after giving up on this one), live or stale, and owns the output.
                raise OutputBusyError(
                    f"A later try of this task, {other.describe()}, holds {self.uri}: this try (try "
                    f"{self.holder.try_number}) was given up by Airflow and stops here. Nothing was run by it."
                )
            if other is not None and not other.same_task_instance(self.holder) and age < self.stale_after_s:
                raise OutputBusyError(
                    f"Another run is writing this output: {other.describe()} holds {self.uri} "
                    f"(last heartbeat {age:.0f}s ago); nothing was run. Give each run its own output_uri "
                    "(template it with {{ run_id }}), or wait for that run "
                    f"(its lease is taken over after {self.stale_after_s:.0f}s of silence)."
                )
            if other is not None and not other.same_task_instance(self.holder):
                log.warning("Taking over the stale lease of %s (silent for %.0fs)", other.describe(), age)
            elif other is not None:
                log.info("Taking over the lease of an earlier try of this task (try %s)", other.try_number)
            self._write(IfMatch=etag)

    def ensure_held(self, verify: bool = False) -> None:
        """Raise :class:`OutputBusyError` when another run took the lease over meanwhile.

        :param verify: read the lease from S3 now instead of trusting the last heartbeat:
            before every write beside the output (a checkpoint part, staged results, the
            manifest), so that a try that lost the lease between two heartbeats (a zombie
            whose successor took over) writes nothing more.
        """
        if verify and not self._lost.is_set():
            current = self._read()
            # Another ETag with one of our nonces is our heartbeat racing this read.
            if current is None or (current.etag != self._etag and not self._is_ours(current)):
                self._lost.set()
        if self._lost.is_set():
            other = self._read()
            who = other.holder.describe() if other and other.holder else "another run"
            raise OutputBusyError(
                f"{who} took over the lease {self.uri} while this try ran (this try's heartbeats "
                "did not reach S3 in time?). Nothing was published by this try."
            )

    @property
    def lost(self) -> bool:
        """Whether this lease knows it was taken over (by a heartbeat, or :meth:`ensure_held`)."""
        return self._lost.is_set()

    def beat(self) -> None:
        """Renew the lease now, as the heartbeat thread does every ``heartbeat_s`` seconds."""
        try:
            self._write(IfMatch=self._etag)
        except OutputBusyError:
            log.error("Lost the lease %s to another run; this try will not publish.", self.uri)
            self._lost.set()
        except Exception as err:  # noqa: BLE001 - S3 down for a moment: try again at the next beat
            log.warning("Lease heartbeat failed (%s); retrying in %.0fs", err, self.heartbeat_s)
        finally:
            with self._beat_done:
                self._beats += 1
                self._beat_done.notify_all()

    def wait_for_beats(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` heartbeats (renewals tried, failed or not) have ended; False on timeout.

        :param count: heartbeats since the lease was made.
        :param timeout: seconds to wait at most.
        """
        with self._beat_done:
            return self._beat_done.wait_for(lambda: self._beats >= count, timeout)

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + 5)
        if self._etag is None or self._lost.is_set():
            return
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self._etag)
        except (ClientError, BotoCoreError) as err:
            # Never hide the try's own failure (often this same S3 outage) behind the clean-up's.
            log.warning("Could not remove the lease %s (%s); it goes stale by itself", self.uri, err)
        self._etag = None

    # -- S3 ---------------------------------------------------------------------------

    def _read(self) -> LeaseState | None:
        """The current holder, the lease's ETag, its age in seconds and nonce; None when free."""
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as err:
            if _code(err) in ("NoSuchKey", "404"):
                return None
            raise
        body = response["Body"].read()
        server_now = parsedate_to_datetime(response["ResponseMetadata"]["HTTPHeaders"]["date"])
        age = (server_now - response["LastModified"]).total_seconds()
        holder: LeaseHolder | None
        nonce: str | None = None
        try:
            data = json.loads(body)
            holder = LeaseHolder(**{f.name: data[f.name] for f in fields(LeaseHolder)})
            nonce = data.get("nonce") if isinstance(data.get("nonce"), str) else None
        except (ValueError, TypeError, KeyError, AttributeError):
            holder = None  # unreadable: treat as free to take over
        return LeaseState(holder=holder, etag=response["ETag"], age=age, nonce=nonce)

    def _is_ours(self, state: LeaseState) -> bool:
        """Whether the lease as read was written by this lease (our holder, one of our nonces)."""
        return state.holder == self.holder and state.nonce is not None and state.nonce in self._nonces

    def _write(self, **condition: str | None) -> None:
        nonce = uuid.uuid4().hex
        # Remembered before the PUT: a write that lands with its response lost is still ours.
        self._nonces.add(nonce)
        body = json.dumps({**asdict(self.holder), "written_at": self.clock(), "nonce": nonce}).encode()
        try:
            response = self.client.put_object(
                Bucket=self.bucket, Key=self.key, Body=body, ContentType="application/json", **condition
            )
        except (ClientError, BotoCoreError) as err:
            try:
                current = self._read()
            except (ClientError, BotoCoreError) as read_err:
                # Whether the write landed (a retried PUT's 412 is often its own) is unknown: not a
                # lost lease (Bounded), and nothing adopted (Fencing); the next write reads it back.
                log.warning("Could not read the lease %s back after a failed write (%s)", self.uri, read_err)
                raise err from None
            if current is not None and current.nonce == nonce and current.holder == self.holder:
                # The PUT landed and its response was lost (botocore's retry of it got 412, or gave up).
                log.info(
                    "The lease write to %s landed although its response was lost; the lease is held.",
                    self.uri,
                )
                self._etag = current.etag
                return
            if isinstance(err, ClientError) and _code(err) in (
                "PreconditionFailed",
                "412",
                "ConditionalRequestConflict",
                "409",
            ):
                if current is not None and self._is_ours(current):
                    # An earlier write of ours whose response was lost: the lease is still ours; renew it from there.
                    self._etag = current.etag
                    self._write(IfMatch=current.etag)
                    return
                who = current.holder.describe() if current and current.holder else "another run"
                raise OutputBusyError(
                    f"{who} took the lease {self.uri} at the same moment. Nothing was run; give each run "
                    "its own output_uri."
                ) from None
            raise
        self._etag = response["ETag"]

    def _verify(self) -> None:
        current = self._read()
        if current is None or current.etag != self._etag:
            who = current.holder.describe() if current and current.holder else "another run"
            raise OutputBusyError(f"{who} took the lease {self.uri} at the same moment. Nothing was run.")

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.beat()
            if self._lost.is_set():
                return


def _code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))
