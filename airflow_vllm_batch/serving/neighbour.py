"""A batch as a good neighbour on a shared vLLM server: a low priority, and an in-flight bound that follows the server's load.

Two things, both off unless the warm server's options ask for them
(:class:`~airflow_vllm_batch.engines.options.YieldToInteractive`):

* **priority**: every request body gets ``"priority": N`` (N > 0; vLLM serves lower values
  first, and an interactive request carries 0 unless it says otherwise), so that on a
  server started with ``--scheduling-policy priority`` a waiting interactive request is
  scheduled before the batch's waiting ones and, when the KV cache runs short, the batch's
  running ones are preempted rather than it. Only sent to a server known to run that
  policy (:func:`with_priority` is not called otherwise): a server without it ignores the
  field (vLLM 0.32) or refuses the request (vLLM's v0 engine: ``Got priority N but
  Priority scheduling is not enabled``), and a refusal is a final 400 answer.
* **the bound** (:class:`InFlightController`, AIMD): every :data:`CHECK_EVERY_S` the stream
  reads the server's ``/metrics`` (:func:`parse_metrics`) and the 429/503 answers it got
  since the last check, and moves the number of requests it keeps in flight between a
  floor and the configured maximum: halved when interactive requests queue (requests
  waiting while others than the batch are on the server), when the KV cache is nearly
  full or the server's steps slow down with others on it, or on a 429/503; grown back
  by a fixed step while others are on the server and none of that happens, and doubled
  once nobody else has been on the server for a few checks. It starts at the floor, since
  a request sent cannot be called back: started at its maximum, a batch would have queued
  all of it before the first check. The requests over a lowered
  bound are not cancelled: they finish, and no new one starts until the batch is under
  it. The floor always stays in flight, so the batch always progresses.

*Others* are the server's running and waiting requests that are not the batch's:
``waiting + running - in flight``, which never counts a request of the batch as another's
(the batch counts a request in flight from before it is sent until its answer is read, a
span that holds the server's). It counts every client but this batch: another batch on
the same server is a neighbour too.

This module has no Airflow imports; the controller is a plain function of what it is given
(deterministic, so each branch has a fast test).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Seconds between two reads of the server's load: the bound doubles at most this often, so an idle
#: server gets the batch's maximum within a few seconds.
CHECK_EVERY_S = 0.5
#: The batch's priority when none is given: vLLM serves lower values first; interactive requests carry 0.
DEFAULT_PRIORITY = 10
#: The fewest requests the batch keeps in flight, whatever the server reports: it always progresses.
DEFAULT_MIN_IN_FLIGHT = 4
#: KV-cache use (0-1) above which, with others on the server, the batch backs off: an interactive
#: prefill then preempts (recomputes) batch sequences, or waits for blocks.
KV_CACHE_HIGH = 0.9
#: The server's mean queue time over a check above which, with others on it, the batch backs off.
QUEUE_TIME_HIGH_S = 0.25
#: A check's mean time per output token above this times the fastest seen, with others on the
#: server, backs the batch off: every sequence on the server shares its steps, so the batch's
#: sequences slow the interactive ones' tokens (on a CPU or a compute-bound GPU, in proportion).
SLOW_STEPS = 1.5
#: Output tokens a check must have seen for its mean time per token to count.
MIN_TOKENS_FOR_STEPS = 16
#: Checks without others on the server before the bound grows by doubling rather than by a step: 5 s.
#: Interactive users come and go between checks (a user's request every few hundred ms is not on
#: the server at every instant): a shorter quiet spell doubled a CPU benchmark's bound to its
#: maximum between two of the probe's requests, and the batch queued hundreds of requests.
QUIET_CHECKS = 10
#: The additive step is the maximum divided by this (at least 1): 8 for a maximum of 512, every check.
GROWTH_PARTS = 64


@dataclass(frozen=True)
class ServerLoad:
    """What the servers' ``/metrics`` say about their load, added up over the servers read.

    :param waiting: requests waiting in the servers' queues (``vllm:num_requests_waiting``).
    :param running: requests running (``vllm:num_requests_running``).
    :param kv_cache_usage: the fullest server's KV-cache use, 0-1 (``vllm:kv_cache_usage_perc``); None if unsaid.
    :param queue_time_s: the ``vllm:request_queue_time_seconds`` histogram's sum and count (counters).
    :param token_time_s: the ``vllm:inter_token_latency_seconds`` histogram's sum and count (counters).
    :param servers_read: how many of the metrics URLs answered.
    :param servers: how many metrics URLs were asked.
    """

    waiting: float = 0.0
    running: float = 0.0
    kv_cache_usage: float | None = None
    queue_time_s: tuple[float, float] | None = None
    token_time_s: tuple[float, float] | None = None
    servers_read: int = 1
    servers: int = 1


_SAMPLE = re.compile(r"^(vllm:[a-zA-Z0-9_:]+)(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)
_SUMMED = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:request_queue_time_seconds_sum": "queue_sum",
    "vllm:request_queue_time_seconds_count": "queue_count",
    "vllm:inter_token_latency_seconds_sum": "token_sum",
    "vllm:inter_token_latency_seconds_count": "token_count",
}


def parse_metrics(text: str) -> ServerLoad:
    """Read one vLLM server's load from its ``/metrics`` (Prometheus text), every engine and model added up.

    :raises ValueError: the text holds no ``vllm:num_requests_waiting`` (not a vLLM server's metrics).
    """
    sums: dict[str, float] = {}
    kv: float | None = None
    for name, value in _SAMPLE.findall(text):
        try:
            number = float(value)
        except ValueError:
            continue
        if not math.isfinite(number):
            continue
        if name == "vllm:kv_cache_usage_perc":
            kv = number if kv is None else max(kv, number)
        elif (key := _SUMMED.get(name)) is not None:
            sums[key] = sums.get(key, 0.0) + number
    if "waiting" not in sums:
        raise ValueError("no vllm:num_requests_waiting in it: not a vLLM server's /metrics")
    return ServerLoad(
        waiting=sums["waiting"],
        running=sums.get("running", 0.0),
        kv_cache_usage=kv,
        queue_time_s=(sums["queue_sum"], sums["queue_count"]) if "queue_count" in sums else None,
        token_time_s=(sums["token_sum"], sums["token_count"]) if "token_count" in sums else None,
    )


def combine(loads: Sequence[ServerLoad | None]) -> ServerLoad | None:
    """The load of several servers (one per metrics URL, None for one that did not answer), or None if none answered."""
    read = [load for load in loads if load is not None]
    if not read:
        return None
    kvs = [load.kv_cache_usage for load in read if load.kv_cache_usage is not None]
    return ServerLoad(
        waiting=sum(load.waiting for load in read),
        running=sum(load.running for load in read),
        kv_cache_usage=max(kvs) if kvs else None,
        queue_time_s=_sum_pairs(load.queue_time_s for load in read),
        token_time_s=_sum_pairs(load.token_time_s for load in read),
        servers_read=len(read),
        servers=len(loads),
    )


def _sum_pairs(pairs: Iterable[tuple[float, float] | None]) -> tuple[float, float] | None:
    present = [p for p in pairs if p is not None]
    return (sum(p[0] for p in present), sum(p[1] for p in present)) if present else None


def with_priority(body: bytes, priority: int) -> bytes:
    """Return a request body (a JSON object) with ``"priority": priority`` added, unless the line sets its own.

    The key goes first, so the rest of the body is sent byte for byte as the line has it.
    """
    stripped = body.lstrip()
    if not stripped.startswith(b"{"):
        return body
    if b'"priority"' in body:
        import msgspec

        try:
            decoded = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return body
        if isinstance(decoded, dict) and "priority" in decoded:
            return body  # the line's own priority is the user's choice
    rest = stripped[1:].lstrip()
    return b'{"priority":%d%s%s' % (priority, b"" if rest.startswith(b"}") else b",", rest)


@dataclass(frozen=True)
class Reading:
    """What one check sees.

    :param load: the servers' load, or None when no ``/metrics`` could be read.
    :param in_flight: the batch's requests in flight while the metrics were read (the most seen).
    :param rejections: the 429 and 503 answers the batch got since the last check.
    """

    load: ServerLoad | None
    in_flight: int
    rejections: int = 0


@dataclass(frozen=True)
class Move:
    """One check's decision: the bound after it, the bound before, and why.

    :param bound: requests the batch may keep in flight from now.
    :param before: the bound before this check.
    :param why: what the server reported that decided it, for the task log.
    """

    bound: int
    before: int
    why: str

    @property
    def verb(self) -> str:
        """How the bound moved: ``lowered``, ``raised`` or ``held``."""
        if self.bound < self.before:
            return "lowered"
        if self.bound > self.before:
            return "raised"
        return "held"

    def describe(self) -> str:
        """The move as the task log says it, e.g. ``lowered 64 -> 32: 3 requests waiting ...``."""
        if self.bound == self.before:
            return f"held at {self.bound}: {self.why}"
        return f"{self.verb} {self.before} -> {self.bound}: {self.why}"


class InFlightController:
    """How many requests the batch keeps in flight on a shared server, decided check by check (AIMD).

    :param ceiling: the most, ever (the options' ``max_in_flight``).
    :param floor: the fewest, ever (at least 1, at most ``ceiling``).
    :param metrics: whether the server's ``/metrics`` were readable when the stream began. Without
        them the bound follows 429/503 answers only (halved on one, grown a step per check without).
    """

    def __init__(self, ceiling: int, floor: int, *, metrics: bool = True) -> None:
        if ceiling < 1 or floor < 1:
            raise ValueError(f"ceiling and floor must be at least 1, got {ceiling} and {floor}")
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        self.metrics = metrics
        self.step = max(1, ceiling // GROWTH_PARTS)
        self.bound = self.floor
        #: The lowest mean time per output token a check has seen (the server's fastest steps).
        self.fastest_token_s: float | None = None
        self.quiet_checks = 0
        self.lowered = 0
        self.raised = 0
        self.last_change: Move | None = None
        self._previous: ServerLoad | None = None

    def start(self, load: ServerLoad | None) -> Move:
        """The first bound, before the batch sends anything: the floor (a request sent cannot be called back).

        On an idle server it doubles from the first check on; on a busy one it grows a step at a time.
        """
        if load is None:
            why = "the server's /metrics could not be read: the bound follows 429/503 answers only"
            return self._set(self.floor, why)
        self._previous = load
        others = _others(load, 0)
        if others:
            return self._set(self.floor, f"{others} requests of others on the server")
        self.quiet_checks = QUIET_CHECKS
        return self._set(self.floor, "the server is idle: doubling from the floor")

    def update(self, reading: Reading) -> Move:
        """Decide the bound from one check's reading; see the module's description for the rules."""
        load, previous = reading.load, self._previous
        if load is not None:
            self._previous = load
        if reading.rejections:
            return self._lower(f"{reading.rejections} answers 429/503 (the server or its balancer is full)")
        if load is None:
            if self.metrics:
                return self._set(self.bound, "the server's /metrics could not be read")
            return self._raise(self.bound + self.step, "no 429/503 since the last check")
        partial = (
            f" (read {load.servers_read} of {load.servers} servers)"
            if load.servers_read < load.servers
            else ""
        )
        others = _others(load, reading.in_flight)
        token_s = _mean_delta(
            load.token_time_s, previous.token_time_s if previous else None, MIN_TOKENS_FOR_STEPS
        )
        if token_s is not None and (self.fastest_token_s is None or token_s < self.fastest_token_s):
            self.fastest_token_s = token_s
        if not others:
            self.quiet_checks += 1
            if self.quiet_checks >= QUIET_CHECKS:
                return self._raise(self.bound * 2, f"no requests of others on the server{partial}")
            return self._raise(
                self.bound + self.step,
                f"no requests of others on the server since {self.quiet_checks} check(s){partial}",
            )
        self.quiet_checks = 0
        with_others = f"with {others} requests of others on the server{partial}"
        if load.waiting >= 1:
            return self._lower(f"{load.waiting:.0f} requests waiting {with_others}")
        if load.kv_cache_usage is not None and load.kv_cache_usage >= KV_CACHE_HIGH:
            return self._lower(f"KV cache {load.kv_cache_usage:.0%} full {with_others}")
        queue_s = _mean_delta(load.queue_time_s, previous.queue_time_s if previous else None, 1)
        if queue_s is not None and queue_s > QUEUE_TIME_HIGH_S:
            return self._lower(f"requests queued {queue_s:.2f}s on average {with_others}")
        fastest = self.fastest_token_s
        if token_s is not None and fastest is not None and token_s > SLOW_STEPS * fastest:
            return self._lower(
                f"{token_s * 1000:.0f} ms per token, the fastest seen {fastest * 1000:.0f} ms, {with_others}"
            )
        return self._raise(self.bound + self.step, f"none waiting {with_others}")

    def _lower(self, why: str) -> Move:
        return self._set(max(self.floor, self.bound // 2), why)

    def _raise(self, bound: int, why: str) -> Move:
        return self._set(min(self.ceiling, bound), why)

    def _set(self, bound: int, why: str) -> Move:
        move = Move(bound=bound, before=self.bound, why=why)
        if bound < self.bound:
            self.lowered += 1
        elif bound > self.bound:
            self.raised += 1
        if bound != self.bound:
            self.last_change = move
        self.bound = bound
        return move


def _others(load: ServerLoad, in_flight: int) -> int:
    """The server's requests that are not the batch's (never counting one of the batch's as another's)."""
    return max(0, math.floor(load.waiting + load.running) - in_flight)


def _mean_delta(
    now: tuple[float, float] | None, before: tuple[float, float] | None, min_count: float
) -> float | None:
    """A histogram's mean over the last check (its sum's and count's growth), when enough was observed."""
    if now is None or before is None:
        return None
    count = now[1] - before[1]
    if count < min_count:
        return None  # a restarted server's counters went back, or too little to tell
    return max(0.0, now[0] - before[0]) / count


@dataclass(frozen=True)
class NeighbourPlan:
    """What the stream is told to be a good neighbour (the warm engine decides it; the stream applies it).

    :param priority: the priority every request carries, or None to send none (the server
        does not run ``--scheduling-policy priority``, or nobody said so).
    :param min_in_flight: the floor of the bound.
    :param metrics_urls: the ``/metrics`` URLs to read (one per server behind the endpoint).
    :param check_every_s: seconds between checks.
    """

    priority: int | None
    min_in_flight: int = DEFAULT_MIN_IN_FLIGHT
    metrics_urls: tuple[str, ...] = ()
    check_every_s: float = CHECK_EVERY_S


__all__ = [
    "CHECK_EVERY_S",
    "DEFAULT_MIN_IN_FLIGHT",
    "DEFAULT_PRIORITY",
    "InFlightController",
    "Move",
    "NeighbourPlan",
    "Reading",
    "ServerLoad",
    "combine",
    "parse_metrics",
    "with_priority",
]
