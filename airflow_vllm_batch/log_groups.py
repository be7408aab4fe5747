"""Fold the engine's own log lines in the Airflow UI: ``::group::`` / ``::endgroup::`` markers.

Airflow 3's task log view folds the lines between a ``::group::<title>`` line and an
``::endgroup::`` line under ``<title>`` (its own "Pre Execute" / "Post Execute" groups
work this way), and the markers read well in a plain log file too. The engine's lines
stay in the log, folded, so the operator's own lines (progress, the summary table) are
visible without scrolling past thousands of vLLM lines.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Iterator

GROUP_START = "::group::"
GROUP_END = "::endgroup::"


@contextlib.contextmanager
def log_group(log: logging.Logger, title: str) -> Iterator[None]:
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
        self.lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self.seen = 0

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.seen += 1

    def flush(self, log: logging.Logger, title: str) -> None:
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
            for line in lines:
                log.info("%s", line)
