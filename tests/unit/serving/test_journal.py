"""Unit tests of the journal: parts sealed by size and by time, durability, order, numbering."""

from __future__ import annotations

import asyncio
import errno
import io
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from airflow_vllm_batch.serving import Journal, part_name

LINE = b'{"custom_id":"r","n":"0123456789"}'  # 34 bytes + newline


def test_parts_are_sealed_by_size(tmp_path):
    reported: list[tuple[str, int]] = []
    journal = Journal(tmp_path, on_part=lambda p, i: reported.append((p.name, i)), max_part_bytes=100)
    for _ in range(7):
        journal.write(LINE)
    journal.close()
    # 35-byte lines: the third crosses 100 bytes and seals; 7 lines make parts of 3, 3, 1.
    assert [p.lines for p in journal.parts] == [3, 3, 1]
    assert reported == [(part_name(0), 0), (part_name(1), 1), (part_name(2), 2)]
    assert (tmp_path / part_name(0)).read_bytes() == (LINE + b"\n") * 3


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait until ``condition()`` holds; fail naming ``what`` after ``timeout_s`` (generous: the machine may be loaded)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.01)


def test_a_part_is_sealed_when_its_time_is_up_even_when_no_more_answers_come(tmp_path):
    async def scenario() -> None:
        journal = Journal(tmp_path, checkpoint_interval_s=0.2)
        async with journal:
            journal.write(LINE)
            # Only the journal's own timer can seal it now: nothing else is written.
            await _until(lambda: journal.lines_durable == 1, "the part sealed and reported on time")
            assert [p.lines for p in journal.parts] == [1]

    asyncio.run(scenario())


def test_answers_are_durable_only_once_on_part_returned(tmp_path):
    uploading, release = threading.Event(), threading.Event()

    def slow_upload(path: Path, index: int) -> None:
        uploading.set()
        release.wait(5)

    async def scenario() -> None:
        journal = Journal(tmp_path, on_part=slow_upload, max_part_bytes=1)
        async with journal:
            journal.write(LINE)  # sealed at once: it is over the size bound
            await asyncio.to_thread(uploading.wait, 5)
            journal.write(LINE)  # the loop is free while the upload runs
            assert (journal.lines_written, journal.lines_durable) == (2, 0)
            release.set()
        assert journal.lines_durable == 2

    asyncio.run(scenario())


def test_close_seals_the_last_part(tmp_path):
    journal = Journal(tmp_path)
    journal.write(LINE)
    assert journal.parts == []
    journal.close()
    assert [p.lines for p in journal.parts] == [1]
    assert journal.lines_durable == 1


def test_an_empty_journal_makes_no_part(tmp_path):
    journal = Journal(tmp_path)
    journal.close()
    assert journal.parts == []
    assert list(tmp_path.iterdir()) == []


def test_a_resumed_journal_numbers_its_parts_after_the_earlier_ones(tmp_path):
    journal = Journal(tmp_path, first_index=7)
    journal.write(LINE)
    journal.close()
    assert [p.path.name for p in journal.parts] == [part_name(7)]


def test_a_failed_upload_is_raised_on_the_next_write(tmp_path):
    def fail(path: Path, index: int) -> None:
        raise OSError("denied")

    def upload_failed(journal: Journal) -> bool:
        try:
            journal.check()
        except OSError:
            return True
        return False

    raised_by_write: list[BaseException] = []

    async def scenario() -> None:
        journal = Journal(tmp_path, on_part=fail, max_part_bytes=1)
        async with journal:
            journal.write(LINE)
            await _until(lambda: upload_failed(journal), "the upload of the first part failed")
            # Caught here, not by pytest.raises: leaving the context raises the same error,
            # which would hide a write that did not raise.
            try:
                journal.write(LINE)
            except OSError as err:
                raised_by_write.append(err)

    with pytest.raises(OSError, match="denied"):
        asyncio.run(scenario())
    assert [str(err) for err in raised_by_write] == ["denied"]


def test_a_cancelled_run_still_reports_what_it_wrote(tmp_path):
    reported: list[int] = []

    async def run() -> None:
        async with journal:
            journal.write(LINE)
            await asyncio.sleep(10)

    async def scenario() -> None:
        task = asyncio.create_task(run())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    journal = Journal(tmp_path, on_part=lambda p, i: reported.append(i))
    asyncio.run(scenario())
    assert reported == [0]
    assert journal.lines_durable == 1


def test_lines_set_aside_never_reach_a_part(tmp_path):
    journal = Journal(tmp_path, max_part_bytes=1)
    journal.write(LINE)
    journal.set_aside(b'{"custom_id":"left"}')
    journal.write(LINE)
    journal.close()
    assert [p.lines for p in journal.parts] == [1, 1]
    assert all(b"left" not in p.path.read_bytes() for p in journal.parts)
    assert journal.set_aside_path.read_bytes() == b'{"custom_id":"left"}\n'
    assert journal.lines_set_aside == 1


def test_write_set_aside_journals_them_as_the_next_part(tmp_path):
    reported: list[int] = []
    journal = Journal(tmp_path, on_part=lambda p, i: reported.append(i), first_index=3)
    journal.write(LINE)
    journal.set_aside(b'{"custom_id":"left-1"}\n')
    journal.set_aside(b'{"custom_id":"left-2"}')
    journal.close()
    assert journal.write_set_aside() == 2
    journal.close()
    assert reported == [3, 4]
    assert journal.parts[-1].path.read_bytes() == b'{"custom_id":"left-1"}\n{"custom_id":"left-2"}\n'


def test_a_new_journal_does_not_inherit_lines_an_earlier_try_set_aside(tmp_path):
    earlier = Journal(tmp_path)
    earlier.set_aside(b'{"custom_id":"old"}')
    earlier.close()
    journal = Journal(tmp_path)
    journal.set_aside(b'{"custom_id":"new"}')
    journal.close()
    assert journal.write_set_aside() == 1
    journal.close()
    assert journal.parts[-1].path.read_bytes() == b'{"custom_id":"new"}\n'


class _FullDisk(io.RawIOBase):
    """A part file on a full disk: every write of its buffer fails with ENOSPC (as a write(2) does)."""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_part_that_does_not_reach_a_full_disk_is_never_reported_and_every_later_write_raises_the_disks_error(
    tmp_path, monkeypatch
):
    reported: list[int] = []
    journal = Journal(tmp_path, on_part=lambda p, i: reported.append(i))
    real_open = open
    monkeypatch.setattr(
        "airflow_vllm_batch.serving.journal.open",
        lambda path, mode, buffering: (
            real_open(path, "wb").close(),
            io.BufferedWriter(_FullDisk(), 1 << 20),
        )[1],
        raising=False,
    )
    journal.write(LINE)  # in the buffer: the disk is not touched yet
    with pytest.raises(OSError, match="No space left") as sealing:
        journal.seal()
    assert sealing.value.errno == errno.ENOSPC
    # Not "ValueError: write to closed file": the disk's own error, which names the cause.
    with pytest.raises(OSError, match="No space left") as writing:
        journal.write(LINE)
    assert writing.value.errno == errno.ENOSPC
    journal.close()
    assert reported == []
    # Its torn bytes are gone too: no later listing of the directory takes them for a part.
    assert [f for f in tmp_path.rglob("*") if f.is_file()] == []
    assert journal.parts == []
    assert journal.lines_durable == 0
    assert not (tmp_path / part_name(0)).exists()  # its torn bytes are not left to fill the disk
