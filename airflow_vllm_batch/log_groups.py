"""Fold the engine's own log lines in the Airflow UI: ``::group::`` / ``::endgroup::`` markers.

Airflow 3's task log view folds the lines between a ``::group::<title>`` line and an
``::endgroup::`` line under ``<title>`` (its own "Pre Execute" / "Post Execute" groups
work this way), and the markers read well in a plain log file too. The engine's lines
stay in the log, folded, so the operator's own lines (progress, the summary table) are
visible without scrolling past thousands of vLLM lines. A line vLLM logged as a warning
or an error keeps its level (:func:`engine_line_level`), so it is still told apart from
the rest, and level filters keep it while they drop the engine's chatter.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any, Protocol

GROUP_START = "::group::"
GROUP_END = "::endgroup::"

#: vLLM's own log prefix, ``WARNING 11-25 14:40:24 [cpu.py:224] ...`` (after a process tag).
_VLLM_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[")


class TaskLog(Protocol):
    """The task's logger, as this package calls it.

    Airflow's task logger (structlog's, ``airflow.sdk``'s ``Logger``) in a task, a
    ``logging.Logger`` elsewhere (the CLI, the tests): both fit, and no call here needs more.
    """

    def debug(self, msg: str, /, *args: Any) -> object: ...
    def info(self, msg: str, /, *args: Any) -> object: ...
    def warning(self, msg: str, /, *args: Any) -> object: ...
    def error(self, msg: str, /, *args: Any) -> object: ...
    def exception(self, msg: str, /, *args: Any) -> object: ...
    def log(self, level: int, msg: str, /, *args: Any) -> object: ...


def engine_line_level(line: str) -> int:
    """The level to log one engine output line at: vLLM's own for its warnings and errors, else INFO."""
    match = _VLLM_LEVEL.search(line[:80])
    if match is None:
        return logging.INFO
    # A level's name gives its number (getLevelName answers a name for a number, and the reverse).
    level = int(logging.getLevelName(match.group(1)))
    return max(logging.INFO, level)


def log_engine_line(log: TaskLog, line: str, max_level: int = logging.CRITICAL) -> None:
    """Log one engine output line at :func:`engine_line_level`, at most ``max_level``.

    :param max_level: the highest level to use: ``logging.WARNING`` for what an engine logs
        while the task stops it (vLLM's server logs its cancelled output loop as an error).
    """
    log.log(min(engine_line_level(line), max_level), "%s", line)


@contextlib.contextmanager
def log_group(log: TaskLog, title: str) -> Iterator[None]:
    """Log the lines written inside the block as one folded group titled ``title``.

    The group is closed however the block ends (an exception, a timeout), so a failure's
    message after it is never folded away.
    """
    log.info("%s%s", GROUP_START, title)
    try:
        yield
    finally:
        log.info("%s", GROUP_END)


class HeldLines:
    """Lines held back while other output is going on, then logged as one group.

    A server logs while the task logs its progress: folding the server's lines live would
    fold the progress lines with them. They are held here (the last ``max_lines``) and
    logged together by :meth:`flush`.

    :param max_lines: how many of the most recent lines to keep. Default 5000.
    """

    def __init__(self, max_lines: int = 5000) -> None:
        self.lines: collections.deque[tuple[str, int]] = collections.deque(maxlen=max_lines)
        self.seen = 0

    def add(self, line: str, max_level: int = logging.CRITICAL) -> None:
        """Hold ``line``, to be logged at most at ``max_level`` (see :func:`log_engine_line`)."""
        self.lines.append((line, max_level))
        self.seen += 1

    def flush(self, log: TaskLog, title: str) -> None:
        """Log the held lines as a group titled ``title`` (nothing when none were held)."""
        if not self.seen:
            return
        lines, seen = list(self.lines), self.seen
        self.lines.clear()
        self.seen = 0
        dropped = seen - len(lines)
        with log_group(log, f"{title} ({seen} lines)"):
            if dropped:
                log.info("... %d earlier lines not kept", dropped)
            for line, max_level in lines:
                log_engine_line(log, line, max_level)
