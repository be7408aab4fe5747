"""The stream spread over several client processes, for servers that answer faster than one core sends.

One client process sends about 3,400 short requests per second (docs/benchmarks.md): the
event loop, aiohttp and the journal hold one core. :func:`run_stream_processes` runs
``processes`` workers, each a :func:`~airflow_vllm_batch.serving.stream.run_stream` of its
own (its own ``aiohttp`` session, ``max_in_flight`` split between them, its own local
journal) on the requests whose input line number modulo ``processes`` is its index.

There is still one journal and one checkpoint protocol: a worker's sealed part is handed
to this (the parent) process, which adopts it as the next part of *its* journal
(:meth:`Journal.adopt <airflow_vllm_batch.serving.journal.Journal.adopt>`: one sequence of
part numbers, ``on_part`` called in order, in this process); the worker counts it durable
only once the parent accepted it. Workers need no credentials and no Airflow: they only
talk to the server. The parent reads the input, leaves out what ``skip`` says is answered
already, and sends each worker its lines in chunks over a bounded queue.

Workers are started with the ``spawn`` context, not ``fork``: the task process has threads
(boto3's, the log handlers') whose locks a forked child could inherit held. The first error
of any worker (or of the parent's reading or checkpointing) stops every worker and is raised
as it was, so a retryable error stays retryable. A stopped worker's answers not yet in an
adopted part are lost and sent again by the task's retry, like requests in flight.

This module has no Airflow imports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from airflow_vllm_batch.batchfile.models import decode_custom_id
from airflow_vllm_batch.exceptions import BadRequestLineError
from airflow_vllm_batch.serving.journal import Journal
from airflow_vllm_batch.serving.stream import (
    DEFAULT_BACKOFF_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_RETRIES,
    StreamStats,
    run_stream,
)

#: Lines per message to a worker; at most :data:`_QUEUED_CHUNKS` wait in its queue (bounded memory).
_CHUNK_LINES = 256
_QUEUED_CHUNKS = 8
#: How often a blocked put or get looks whether the run stopped (or its parent died).
_POLL_S = 0.5
#: Seconds a worker gets to exit after the run, or after SIGTERM, before it is killed.
_JOIN_S = 5.0


#: The runs under way in this process, for :func:`terminate_workers` (``on_kill`` runs in another thread).
_RUNNING: weakref.WeakSet[_Parent] = weakref.WeakSet()


def terminate_workers() -> None:
    """Stop the client processes of every run under way in this process (the task is being killed)."""
    for run in list(_RUNNING):
        run.stopping.set()
        for worker in run.workers:
            if worker.is_alive():
                worker.terminate()


def worker_in_flight(max_in_flight: int, processes: int, index: int) -> int:
    """Return worker ``index``'s share of ``max_in_flight`` (at least 1; the shares add up to the bound)."""
    share, rest = divmod(max_in_flight, processes)
    return max(1, share + (1 if index < rest else 0))


# Its keyword parameters repeat run_stream's on purpose (the duplicates tool pairs the two):
# spelled out, a misspelled keyword fails at the call in the task, not in a worker process.
def run_stream_processes(
    requests: Iterable[tuple[int, bytes]],
    *,
    processes: int,
    base_url: str,
    api_key: str | None,
    journal: Journal,
    max_in_flight: int,
    skip: Callable[[str], bool] | None = None,
    retries: int = DEFAULT_RETRIES,
    on_progress: Callable[[StreamStats], None] | None = None,
    progress_every_s: float = 15.0,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    backoff_s: float = DEFAULT_BACKOFF_S,
) -> StreamStats:
    """Send every request line through ``processes`` client processes; journal their answers into ``journal``.

    Takes the arguments of :func:`~airflow_vllm_batch.serving.stream.run_stream` and returns
    the combined counts. ``journal`` is used outside an event loop: its directory holds each
    worker's journal, its ``checkpoint_interval_s`` and ``max_part_bytes`` are theirs, and
    every sealed part of theirs becomes its next part. The lines the workers set aside are
    set aside in ``journal`` (:meth:`Journal.set_aside`) once all are done.

    :param processes: client processes, at least 2 (one is :func:`run_stream` in this process).
    :raises ServerUnavailableError: a worker found the server gone.
    :raises ServerAuthError: the server refused the API key.
    :raises BadRequestLineError: a line is not a request line.
    """
    if processes < 2:
        raise ValueError(f"run_stream_processes needs at least 2 processes, got {processes}")
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
    return _Parent(
        processes,
        journal,
        on_progress,
        progress_every_s,
        {
            "base_url": base_url,
            "api_key": api_key,
            "retries": retries,
            "request_timeout_s": request_timeout_s,
            "backoff_s": backoff_s,
            "progress_every_s": progress_every_s,
            "checkpoint_interval_s": journal.checkpoint_interval_s,
            "max_part_bytes": journal.max_part_bytes,
        },
        max_in_flight,
    ).run(iter(requests), skip)


class _Parent:
    """One run of :func:`run_stream_processes`: the workers, their queues, the combined counts."""

    def __init__(
        self,
        processes: int,
        journal: Journal,
        on_progress: Callable[[StreamStats], None] | None,
        progress_every_s: float,
        config: dict[str, Any],
        max_in_flight: int,
    ) -> None:
        self.journal = journal
        self.on_progress = on_progress
        self.progress_every_s = progress_every_s
        context = multiprocessing.get_context("spawn")
        self.events: Any = context.Queue()
        self.inputs: list[Any] = [context.Queue(_QUEUED_CHUNKS) for _ in range(processes)]
        self.acks: list[Any] = [context.Queue() for _ in range(processes)]
        self.workers = [
            context.Process(
                target=_worker,
                args=(
                    index,
                    {**config, "max_in_flight": worker_in_flight(max_in_flight, processes, index)},
                    str(journal.directory / f"worker-{index}"),
                    self.inputs[index],
                    self.events,
                    self.acks[index],
                ),
                name=f"vllm-batch-client-{index}",
                daemon=True,
            )
            for index in range(processes)
        ]
        self.stats: list[StreamStats] = [StreamStats() for _ in range(processes)]
        self.done: set[int] = set()
        self.exited: dict[int, float] = {}
        self.set_aside: dict[int, str | None] = {}
        self.skipped = 0
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.started = 0.0

    def run(self, requests: Iterator[tuple[int, bytes]], skip: Callable[[str], bool] | None) -> StreamStats:
        self.started = time.monotonic()
        _RUNNING.add(self)
        for worker in self.workers:
            worker.start()
        feeder = threading.Thread(
            target=self._feed, args=(requests, skip), name="vllm-batch-feed", daemon=True
        )
        feeder.start()
        try:
            self._serve()
        finally:
            self.stopping.set()
            self._stop_workers()
            feeder.join(_JOIN_S)
            _RUNNING.discard(self)
        if self.error is not None:
            raise self.error
        for index in sorted(self.set_aside):
            path = self.set_aside[index]
            if path is not None:
                with open(path, "rb") as lines:
                    for line in lines:
                        self.journal.set_aside(line)
        return self.snapshot()

    # -- the parent's two threads: feeding the workers, serving their events --------------

    def _feed(self, requests: Iterator[tuple[int, bytes]], skip: Callable[[str], bool] | None) -> None:
        """Send each worker its lines (input line number modulo the workers), then the end of its input."""
        count = len(self.workers)
        chunks: list[list[tuple[int, bytes]]] = [[] for _ in range(count)]
        try:
            for number, raw in requests:
                if self.stopping.is_set():
                    return
                if not raw.strip():
                    continue
                if skip is not None:
                    try:
                        custom_id = decode_custom_id(raw).custom_id
                    except msgspec.DecodeError as err:
                        raise BadRequestLineError(
                            f"Input line {number} is not a request line ({err}); run preflight on the input first."
                        ) from None
                    if skip(custom_id):
                        self.skipped += 1
                        continue
                chunk = chunks[number % count]
                chunk.append((number, raw))
                if len(chunk) >= _CHUNK_LINES:
                    self._put(number % count, chunk)
                    chunks[number % count] = []
            for index in range(count):
                if chunks[index]:
                    self._put(index, chunks[index])
                self._put(index, None)
        except BaseException as err:  # noqa: BLE001 - handed to the serving thread, which raises it
            self.events.put(("error", -1, _picklable(err)))

    def _put(self, index: int, chunk: list[tuple[int, bytes]] | None) -> None:
        while not self.stopping.is_set():
            with contextlib.suppress(queue.Full):
                self.inputs[index].put(chunk, timeout=_POLL_S)
                return

    def _serve(self) -> None:
        """Adopt the workers' parts, collect their counts, until all are done or one failed."""
        next_progress = time.monotonic() + self.progress_every_s
        while len(self.done) < len(self.workers):
            if self.stopping.is_set():
                raise RuntimeError("The client processes were stopped (the task is being killed).")
            try:
                event = self.events.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive()
            else:
                kind, index = event[0], event[1]
                if kind == "part":
                    try:
                        self.journal.adopt(Path(event[2]))
                    except BaseException:
                        self.acks[index].put(False)
                        raise
                    self.acks[index].put(True)
                elif kind == "progress":
                    self.stats[index] = event[2]
                elif kind == "done":
                    self.stats[index] = event[2]
                    self.set_aside[index] = event[3]
                    self.done.add(index)
                else:
                    self.error = event[2]
                    return
            if self.on_progress is not None and time.monotonic() >= next_progress:
                next_progress = time.monotonic() + self.progress_every_s
                self.on_progress(self.snapshot())

    def _check_alive(self) -> None:
        now = time.monotonic()
        for index, worker in enumerate(self.workers):
            if index in self.done or worker.exitcode is None:
                continue
            # Its "done" or "error" may still be on its way through the queue: give it a moment.
            since = self.exited.setdefault(index, now)
            if now - since > _JOIN_S:
                raise RuntimeError(
                    f"Client process {worker.name} exited with code {worker.exitcode} before the end of its "
                    "requests (killed, out of memory?); the answers checkpointed so far stay, the task's retry "
                    "resumes from them."
                )

    def _stop_workers(self) -> None:
        for worker in self.workers:
            if worker.is_alive() and worker.pid is not None and len(self.done) < len(self.workers):
                worker.terminate()
        deadline = time.monotonic() + _JOIN_S
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
                worker.join(_JOIN_S)
        for channel in (self.events, *self.inputs, *self.acks):
            channel.cancel_join_thread()
            channel.close()

    def snapshot(self) -> StreamStats:
        """The workers' counts added up (their lines set aside too), with this run's wall time."""
        total = StreamStats(skipped=self.skipped, read=self.skipped)
        for stats in self.stats:
            for field in (
                "read",
                "done",
                "failed",
                "retried",
                "unanswered",
                "in_flight",
                "prompt_tokens",
                "completion_tokens",
            ):
                setattr(total, field, getattr(total, field) + getattr(stats, field))
            for reason, count in stats.unanswered_reasons.items():
                total.unanswered_reasons[reason] = total.unanswered_reasons.get(reason, 0) + count
            total.unanswered_example = total.unanswered_example or stats.unanswered_example
        total.durable = self.journal.lines_durable
        total.elapsed_s = time.monotonic() - self.started
        return total


# -- a worker (a spawned process of its own) ----------------------------------------------


def _worker(index: int, config: dict[str, Any], directory: str, inputs: Any, events: Any, acks: Any) -> None:
    """Stream this worker's lines, hand each sealed part to the parent, report the counts or the error."""
    parent = os.getppid()

    def requests() -> Iterator[tuple[int, bytes]]:
        while True:
            try:
                chunk = inputs.get(timeout=_POLL_S)
            except queue.Empty:
                if os.getppid() != parent:
                    raise RuntimeError("the task process is gone") from None
                continue
            if chunk is None:
                return
            yield from chunk

    def on_part(path: Path, part_index: int) -> None:
        events.put(("part", index, str(path)))
        # Durable only once the parent checkpointed it: the journal counts it when this returns.
        while True:
            try:
                accepted = acks.get(timeout=_POLL_S)
            except queue.Empty:
                if os.getppid() != parent:
                    raise RuntimeError("the task process is gone") from None
                continue
            if not accepted:
                raise RuntimeError("the parent could not checkpoint the part")
            return

    journal = Journal(
        directory,
        on_part=on_part,
        checkpoint_interval_s=config["checkpoint_interval_s"],
        max_part_bytes=config["max_part_bytes"],
    )
    try:
        stats = run_stream(
            requests(),
            base_url=config["base_url"],
            api_key=config["api_key"],
            journal=journal,
            max_in_flight=config["max_in_flight"],
            retries=config["retries"],
            on_progress=lambda stats: events.put(("progress", index, stats)),
            progress_every_s=min(config["progress_every_s"], 5.0),
            request_timeout_s=config["request_timeout_s"],
            backoff_s=config["backoff_s"],
        )
    except BaseException as err:  # noqa: BLE001 - the parent raises it
        events.put(("error", index, _picklable(err)))
        return
    events.put(
        (
            "done",
            index,
            dataclasses.replace(stats),
            str(journal.set_aside_path) if journal.lines_set_aside else None,
        )
    )


def _picklable(err: BaseException) -> BaseException:
    """``err`` itself when it crosses a process boundary intact (its class keeps its retryability), else its text."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - any failure to pickle
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err
