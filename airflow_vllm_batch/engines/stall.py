"""The runner's stall bound: what counts as progress of vLLM's batch runner, and when it has made none for too long.

vLLM's batch runner says how far it is in two ways, read from its own sources:

* its progress report, a log line ``Running batch: 40% Completed | 2/5 [...]`` (vLLM 0.32 and
  0.33 print it at most every 5 s, and only when a request finished; tqdm's monitor may print
  it again with the same count, which is no progress);
* vLLM 0.33 writes each answer to its local output as it goes, in input order (0.32 writes
  its output only at the end).

So the runner made progress when its output file changed, when a progress report counts more
requests than the last one, or when it printed any other log line (loading the model,
compiling, writing the output at the end), except vLLM's warning that it waits for another
of its processes (``No available shared memory broadcast block found in 60 seconds``), which a
hung worker (an NCCL hang under tensor parallelism) repeats forever.

A runner that made no progress for the stall bound is wedged (a hung ``EngineCore``, a hung
collective): :class:`StallWatch` says so, the runner engine stops it the way ``on_kill`` does
(the process group: SIGTERM, then SIGKILL) and fails the try as retryable, keeping what it
answered (invariants *Bounded* and *Durability*, ``docs/protocol.md``). Plain Python: no
Airflow, no S3.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from airflow_vllm_batch.log_groups import TaskLog

#: Seconds between two checks of the bound, at most (a quarter of the bound when that is shorter).
STALL_POLL_S = 5.0

#: vLLM's batch progress report (its ``_BAR_FORMAT``): the count of finished requests.
_PROGRESS_REPORT = re.compile(r"Running batch:.*?\|\s*(\d+)/(\d+)")
#: vLLM's warning, repeated every minute, that a process of the engine waits for a hung one: no progress.
_WAITING = "No available shared memory broadcast block found"


class StallWatch:
    """Whether vLLM's batch runner made progress in the last ``timeout_s`` seconds.

    :param timeout_s: the stall bound, seconds > 0.
    :param output: the runner's local output file (vLLM 0.33 writes it as it goes); None for a URL output.
    :param clock: a monotonic clock. Default ``time.monotonic`` (a simulation's virtual one).
    """

    def __init__(
        self, timeout_s: float, output: Path | None = None, clock: Callable[[], float] | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.output = output
        self._clock = clock or time.monotonic
        self._last = self._clock()
        self._done = -1
        self._seen: tuple[int, int] | None = None

    @property
    def poll_s(self) -> float:
        """How often the bound is checked."""
        return min(STALL_POLL_S, self.timeout_s / 4)

    def line(self, text: str) -> None:
        """Take one line of the runner's log: progress unless it repeats a count or says it waits for a hung process."""
        if _WAITING in text:
            return
        if (report := _PROGRESS_REPORT.search(text)) is not None:
            done = int(report.group(1))
            if done <= self._done:
                return
            self._done = done
        self._last = self._clock()

    def silent_s(self) -> float:
        """Seconds since the runner last made progress (a change of its output file counts when it is seen here)."""
        if self.output is not None:
            try:
                stat = self.output.stat()
                seen = (stat.st_size, stat.st_mtime_ns)
            except OSError:
                seen = (-1, 0)
            if self._seen is not None and seen != self._seen:
                self._last = self._clock()
            self._seen = seen
        return self._clock() - self._last

    def stalled(self) -> bool:
        """Whether the runner made no progress for the whole bound."""
        return self.silent_s() >= self.timeout_s


class StallBound:
    """One engine run's stall bound: its watch (None: no bound), and the bound in seconds once it fired."""

    def __init__(self, stall: StallWatch | None) -> None:
        self.stall = stall
        self.fired: float | None = None

    @property
    def watch(self) -> Callable[[str], None] | None:
        """What the engine's log lines are shown to (the hook's ``watch``)."""
        return self.stall.line if self.stall is not None else None


@contextlib.contextmanager
def stall_bound(
    timeout_s: float | None, output: Path | None, stop: Callable[[], None], log: TaskLog
) -> Iterator[StallBound]:
    """While an engine runs, check in a thread that it makes progress; ``stop`` it when it made none for the bound.

    :param timeout_s: the bound in seconds; None or 0: no bound, no thread.
    :param output: the engine's local output file (its changes are progress), None for a URL.
    :param stop: stops the engine (the hook's ``terminate``: its process group, SIGTERM then SIGKILL).
    :param log: the task's logger.
    """
    if not timeout_s:
        yield StallBound(None)
        return
    watch = StallWatch(timeout_s, output)
    bound = StallBound(watch)
    done = threading.Event()

    def check() -> None:
        while not done.wait(watch.poll_s):
            if watch.stalled():
                bound.fired = timeout_s
                log.warning(
                    "vLLM made no progress for %g s (no output line, no progress report): stopping it.",
                    timeout_s,
                )
                stop()
                return

    watcher = threading.Thread(target=check, name="vllm-batch-stall", daemon=True)
    watcher.start()
    try:
        yield bound
    finally:
        done.set()
        watcher.join()


def stall_message(timeout_s: float, answered: int) -> str:
    """The try's error when the runner stalled: what happened, then what to do."""
    kept = f"; the {answered} answer(s) it had written are staged for the retry" if answered else ""
    return (
        f"vLLM made no progress for {timeout_s:g} s (no output line, no progress report): the engine was "
        f"stopped and the try failed, to be retried{kept}. "
        "If requests legitimately take longer, raise VLLMRunner(stall_timeout=...)."
    )
