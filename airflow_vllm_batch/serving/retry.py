"""When the stream retries a request: which answers are final, and how long to wait before the next attempt.

See :mod:`~airflow_vllm_batch.serving.stream` for what a final answer and a transient failure
become. This module has no Airflow imports.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from datetime import timezone

#: Default retries of a transient failure; with the backoff below, about 30 s of patience
#: (a server restart behind a load balancer) before the task gives up and Airflow retries.
DEFAULT_RETRIES = 6
DEFAULT_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
#: The longest ``Retry-After`` honoured: a gateway asking for more is better served by the
#: task's retry (Airflow's ``retry_delay``) than by a worker holding its slot idle.
MAX_RETRY_AFTER_S = 60.0
#: Statuses that, once the retries ran out, say the server (or all behind its balancer) is gone.
GONE_STATUSES = frozenset({502, 503})
AUTH_STATUSES = frozenset({401, 403})
#: 4xx answers that are the server's state, not the request's fault: retried, never final.
TRANSIENT_4XX = frozenset({408, 429})
#: Answers that say the server (or its balancer) is full: a neighbourly batch backs off on them.
FULL_STATUSES = frozenset({429, 503})


def backoff(attempt: int, first_s: float) -> float:
    """Delay before retry ``attempt`` (0-based): exponential, capped, with jitter so retries do not march in step."""
    delay: float = min(MAX_BACKOFF_S, first_s * 2**attempt)  # int ** int is Any to mypy (may be a float)
    return delay * random.uniform(0.5, 1.0)


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Return the seconds a ``Retry-After`` header asks to wait, at most :data:`MAX_RETRY_AFTER_S`.

    :param value: the header: delay-seconds (a decimal is accepted too) or an HTTP date.
    :param now: the current time as a Unix timestamp, for an HTTP date. Default: the clock.
    :return: the delay, 0 for a date in the past, or None when the header is absent or unreadable.
    """
    if not value or not value.strip():
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value.strip())
        except (TypeError, ValueError):
            return None
        # An HTTP date is GMT; a date without a zone is read as such rather than as local time.
        timestamp = (
            when.timestamp() if when.tzinfo is not None else when.replace(tzinfo=timezone.utc).timestamp()
        )
        seconds = timestamp - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))


def is_final(status: int) -> bool:
    """Whether an answer with this status is the request's own (checkpointed), not the server's state (retried)."""
    return status == 200 or (400 <= status < 500 and status not in TRANSIENT_4XX)


class Transient(Exception):
    """One attempt failed in a way worth retrying; ``gone`` says whether running out of retries stops the run.

    :param gone: the server looks gone (connection errors, 502, 503): stop the run when the retries run out.
    :param detail: what happened, for messages.
    :param reason: the kind of answer, for the counts of requests set aside (``"HTTP 429"``, ``"timeout"``).
    :param line: the line the request gets if this is its last answer, when known now.
    :param retry_after: seconds the server asked to wait (``Retry-After``), or None.
    """

    def __init__(
        self,
        *,
        gone: bool,
        detail: str,
        reason: str = "",
        line: bytes | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(detail)
        self.gone = gone
        self.detail = detail
        self.reason = reason
        self.line = line
        self.retry_after = retry_after
