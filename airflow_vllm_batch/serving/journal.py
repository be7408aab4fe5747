"""The journal: answers appended to local files, sealed into numbered *parts* as the run goes.

A part is sealed every ``checkpoint_interval_s`` seconds (counted from its first line) or
once it holds ``max_part_bytes`` bytes, whichever comes first. Each sealed part is
handed to ``on_part(path, index)`` (the operator uploads it to S3 next to the output) in a
worker thread, so a slow upload never stalls the event loop that receives the answers,
and strictly in order, one at a time. An answer counts as *durable* only once the part
that holds it was fully written, fsynced and accepted by ``on_part``; that is the number
a resumed run may rely on.

Parts are named ``part-000000.jsonl``, ``part-000001.jsonl``, ... in ``directory``;
``first_index`` lets a resumed run number its parts after those of earlier tries.

Lines that are not final answers (a request whose retries ran out on a 429 or a 500) are
*set aside* in ``unanswered.jsonl`` in the same directory: never in a part, so that a
checkpoint holds only final answers and a retry sends those requests again. A caller that
decides they are final after all (the task's last try) journals them with
:meth:`Journal.write_set_aside`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

#: Default seconds between checkpoints: at 100 answers/s a kill loses at most ~6,000
#: answers' work (plus what is in flight), and an 8-hour run makes ~480 parts.
DEFAULT_CHECKPOINT_INTERVAL_S = 60.0
#: Default size bound of a part: small enough to upload in seconds, large enough that a
#: fast run does not make thousands of objects.
DEFAULT_MAX_PART_BYTES = 64 * 1024 * 1024
#: How often the sealing task looks at the clock when no part is open.
_IDLE_TICK_S = 1.0
#: The file of the lines set aside, in the journal's directory; never a part.
SET_ASIDE_NAME = "unanswered.jsonl"


def part_name(index: int) -> str:
    """Return the file name of part ``index``."""
    return f"part-{index:06d}.jsonl"


@dataclass(frozen=True)
class SealedPart:
    """A part that is complete on local disk.

    :param path: its file.
    :param index: its number.
    :param lines: how many answers it holds.
    :param size: its size in bytes.
    """

    path: Path
    index: int
    lines: int
    size: int


class Journal:
    """Append answers to local part files and report each sealed part.

    Use it as an async context manager around the run (``async with journal:``): that
    starts the task that seals parts on time and reports them, and on the way out (also on
    an error) seals the last part and waits until every part was reported. Without an
    event loop, call :meth:`write` and then :meth:`close`.

    :param directory: where the part files go (created if missing).
    :param on_part: called with ``(path, index)`` of every sealed part, in order, in a
        worker thread. An exception from it fails the run. It must be idempotent (an S3
        put is): a run cancelled in the middle of a report reports that part again.
        Default: nothing.
    :param checkpoint_interval_s: seal a part this many seconds after its first line.
        Default 60.
    :param max_part_bytes: seal a part once it holds this many bytes. Default 64 MiB.
    :param first_index: the number of the first part (a resumed run continues after the
        parts of earlier tries). Default 0.
    """

    def __init__(
        self,
        directory: Path | str,
        *,
        on_part: Callable[[Path, int], None] | None = None,
        checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S,
        max_part_bytes: int = DEFAULT_MAX_PART_BYTES,
        first_index: int = 0,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.on_part = on_part
        self.checkpoint_interval_s = checkpoint_interval_s
        self.max_part_bytes = max_part_bytes
        self.next_index = first_index
        #: Answers written so far, and those in reported parts (durable).
        self.lines_written = 0
        self.lines_durable = 0
        #: Parts reported to ``on_part``, in order.
        self.parts: list[SealedPart] = []
        #: Lines set aside (not final answers), in :attr:`set_aside_path`.
        self.lines_set_aside = 0
        self._set_aside_file: IO[bytes] | None = None
        self._file: IO[bytes] | None = None
        self._path: Path | None = None
        self._opened_at = 0.0
        self._seal_at = 0.0
        self._part_lines = 0
        self._part_bytes = 0
        self._unreported: collections.deque[SealedPart] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        #: Why a part could not be written whole (a full disk): every later write raises it.
        self._failed: OSError | None = None

    # -- writing -------------------------------------------------------------------

    def write(self, line: bytes) -> None:
        """Append one answer (one JSON line, with or without its newline).

        Seals the part when it reaches the size bound or its time is up. Raises the error of
        the reporting task if it failed, so that a run whose checkpoints fail stops at once.
        """
        # Once per answer, on the event loop: kept to attribute look-ups and one clock read.
        if self._task is not None and self._task.done():
            self._task.result()
        if self._failed is not None:
            raise self._failed
        file = self._file if self._file is not None else self._open_part()
        if line[-1:] != b"\n":
            line += b"\n"
        file.write(line)
        self._part_lines += 1
        self._part_bytes += len(line)
        self.lines_written += 1
        if self._part_bytes >= self.max_part_bytes or time.monotonic() >= self._seal_at:
            self.seal()

    @property
    def set_aside_path(self) -> Path:
        """The file of the lines set aside by this journal."""
        return self.directory / SET_ASIDE_NAME

    def set_aside(self, line: bytes) -> None:
        """Keep one line that is not a final answer out of every part (see the module docs)."""
        if self._set_aside_file is None:
            # "wb": what an earlier try of the run set aside in this directory is not this try's.
            self._set_aside_file = open(self.set_aside_path, "wb")  # noqa: SIM115 - closed by close_set_aside()
        self._set_aside_file.write(line if line.endswith(b"\n") else line + b"\n")
        self.lines_set_aside += 1

    def write_set_aside(self) -> int:
        """Journal the lines set aside as answers after all; return how many.

        Call it once the async context is over; then :meth:`close` seals and reports them.
        """
        if self._task is not None:
            raise RuntimeError("Journal.write_set_aside() while its async context runs")
        self._close_set_aside()
        if not self.lines_set_aside:
            return 0
        with open(self.set_aside_path, "rb") as lines:
            for line in lines:
                self.write(line)
        return self.lines_set_aside

    def _close_set_aside(self) -> None:
        if self._set_aside_file is not None:
            self._set_aside_file.close()
            self._set_aside_file = None

    def seal(self) -> SealedPart | None:
        """Close the open part, if any, and queue it to be reported; return it.

        Sealing only closes the file (the data reaches the page cache); the fsync happens
        in the reporting thread, before ``on_part``.
        """
        if self._file is None:
            return None
        assert self._path is not None
        file, path, self._file, self._path = self._file, self._path, None, None
        try:
            file.close()
        except OSError as err:
            # Its buffer did not reach the disk whole (ENOSPC, EDQUOT): the part is no checkpoint
            # (it may end in a torn line) and is neither reported nor written to again (a closed
            # file's ValueError hid the disk's error); its answers are the retry's to send again.
            self._failed = err
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        part = SealedPart(path, self.next_index, self._part_lines, self._part_bytes)
        self.next_index += 1
        self._unreported.append(part)
        if self._wakeup is not None:
            self._wakeup.set()
        return part

    def due(self) -> bool:
        """Return whether the open part should be sealed now (by size or by time)."""
        return self._file is not None and (
            self._part_bytes >= self.max_part_bytes or self._part_age() >= self.checkpoint_interval_s
        )

    def _open_part(self) -> IO[bytes]:
        self._path = self.directory / part_name(self.next_index)
        # A large buffer: answers arrive on the event loop, which should rarely touch the disk.
        self._file = open(self._path, "wb", buffering=1024 * 1024)  # noqa: SIM115 - closed by seal()
        self._opened_at = time.monotonic()
        self._seal_at = self._opened_at + self.checkpoint_interval_s
        self._part_lines = self._part_bytes = 0
        return self._file

    def _part_age(self) -> float:
        return time.monotonic() - self._opened_at if self._file is not None else 0.0

    # -- reporting -----------------------------------------------------------------

    def _report(self, part: SealedPart) -> None:
        """Make ``part`` durable on local disk, then hand it to ``on_part`` (in a worker thread)."""
        fd = os.open(part.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if self.on_part is not None:
            self.on_part(part.path, part.index)

    def _reported(self, part: SealedPart) -> None:
        self._unreported.popleft()
        self.parts.append(part)
        self.lines_durable += part.lines

    async def _run(self) -> None:
        """Seal parts when their time is up and report sealed parts, until closed."""
        assert self._wakeup is not None
        while True:
            while self._unreported:
                part = self._unreported[0]
                await asyncio.to_thread(self._report, part)
                self._reported(part)
            if self._closing:
                return
            timeout = (
                self.checkpoint_interval_s - self._part_age() if self._file is not None else _IDLE_TICK_S
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), max(timeout, 0.0))
            self._wakeup.clear()
            if self.due():
                self.seal()

    def adopt(self, path: Path) -> SealedPart:
        """Report a part another process's journal sealed (and fsynced) as this journal's next part.

        The file is moved into :attr:`directory` under this journal's next part name, so that
        the parts of several client processes make one sequence of part numbers (one
        checkpoint protocol); then it is handed to ``on_part``, in this thread. Call it only
        outside the async context.

        :param path: the sealed part file, on the same file system as :attr:`directory`.
        :return: the part, now counted in :attr:`lines_durable`.
        """
        if self._task is not None:
            raise RuntimeError("Journal.adopt() while its async context runs")
        data_lines = path.read_bytes().count(b"\n")
        target = self.directory / part_name(self.next_index)
        os.replace(path, target)
        part = SealedPart(target, self.next_index, data_lines, target.stat().st_size)
        self.next_index += 1
        if self.on_part is not None:
            self.on_part(part.path, part.index)
        self.parts.append(part)
        self.lines_written += part.lines
        self.lines_durable += part.lines
        return part

    def check(self) -> None:
        """Raise the error of the reporting task, if it failed (e.g. ``on_part`` could not upload)."""
        if self._task is not None and self._task.done():
            self._task.result()

    async def __aenter__(self) -> Journal:
        self._wakeup = asyncio.Event()
        self._closing = False
        self._task = asyncio.create_task(self._run(), name="journal")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Seal the last part and wait until every part was reported.

        When the run is being cancelled (the task got SIGTERM, or hit its timeout), the
        parts still unreported are reported in this thread before the cancellation goes
        on: what was answered is checkpointed even by a run that is stopping.
        """
        self.seal()
        self._close_set_aside()
        self._closing = True
        if self._task is None:
            return
        assert self._wakeup is not None
        self._wakeup.set()
        task, self._task = self._task, None
        try:
            await task
        except asyncio.CancelledError:
            self._report_the_rest()
            raise

    def close(self) -> None:
        """Seal the last part and report every unreported part, in this thread (no event loop)."""
        if self._task is not None:
            raise RuntimeError("Journal.close() while its async context runs; use aclose()")
        self.seal()
        self._close_set_aside()
        self._report_the_rest()

    def _report_the_rest(self) -> None:
        while self._unreported:
            part = self._unreported[0]
            self._report(part)
            self._reported(part)
