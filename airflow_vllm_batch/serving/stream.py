"""Stream a batch file through a vLLM OpenAI-compatible server; one output line per request.

:func:`run_stream` reads request lines lazily, keeps at most ``max_in_flight`` requests
in flight over one keep-alive ``aiohttp`` session, and appends every answer to a
:class:`~airflow_vllm_batch.serving.journal.Journal` as soon as it arrives.

Output lines have exactly the shape vLLM 0.32's batch runner writes
(``BatchRequestOutput.model_dump_json()`` in ``vllm/entrypoints/launchers/run_batch.py``)::

    {"id": "vllm-<16 hex>", "custom_id": "...",
     "response": {"status_code": 200, "request_id": "vllm-batch-<16 hex>", "body": {...}},
     "error": null}

and, for a request the server refused with vLLM's ``ErrorResponse``
(``{"error": {"message", "type", "param", "code"}}``), as the runner's ``run_request``
writes it: ``"response": {"status_code": <error.code>, "request_id": ..., "body": null}``
and that ``ErrorResponse`` as ``"error"``. An answer that is not an ``ErrorResponse`` (a
proxy's 404 page, say) becomes a string ``error``, as the runner's own request errors do.

**Output order is completion order**, not input order: the results check matches
answers to requests by ``custom_id``, and writing as answers arrive is what keeps
memory flat and lets every answer reach a checkpoint at once.

**Only final answers are journaled**: HTTP 200, and any 4xx but 408 and 429 (the request
itself is wrong: retrying it cannot help). Everything else is transient and retried inside
the try, ``retries`` times, with exponential backoff and jitter, or as long as the answer's
``Retry-After`` asks (seconds or an HTTP date, at most :data:`MAX_RETRY_AFTER_S`): 408,
429, any 5xx (a dying engine answers 500), connection errors and timeouts. HTTP 401/403
raise :class:`~airflow_vllm_batch.exceptions.ServerAuthError` at once.

When the retries run out on a connection error or a 502/503, the server is taken to be
gone: the stream stops, the journal is flushed (sealed and reported) and
:class:`~airflow_vllm_batch.exceptions.ServerUnavailableError` is raised, so that the
task's retry resumes from the checkpoints. When they run out on any other non-final answer
(a 429 that does not end, a 500, a request that keeps timing out), the request is *set
aside*: the line it would have had goes to :meth:`Journal.set_aside
<airflow_vllm_batch.serving.journal.Journal.set_aside>`, never to a part, and the stream
goes on with the others. :attr:`StreamStats.unanswered` counts those requests; the caller
decides what they become (the server engine fails a try that may be retried, so that the
retry sends them again, and publishes them as failed lines on the task's last try).

**Bounded** (invariant): one request, all its attempts and the waits between them, ends
within ``request_timeout_s``; a request whose time ran out on a timeout while the server
answered no request at all is taken as a wedged server: the stream stops as for a gone
one. So a silent server holds the try at most ``request_timeout_s``, never
``retries + 1`` timeouts in a row.

**A yielding stream** (``neighbour``, see :mod:`~airflow_vllm_batch.serving.neighbour`) adds a
``priority`` to each body (only for a server known to run priority scheduling) and lets a
controller move the bound between a floor and ``max_in_flight`` from the server's ``/metrics``
and its 429/503 answers. It changes only *when* a request is sent and that key of its body:
answers are journaled, set aside and retried exactly as above, and a lowered bound cancels
no request in flight.

This module has no Airflow imports.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import email.utils
import itertools
import math
import random
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from datetime import timezone
from typing import TYPE_CHECKING, Any

import msgspec

from airflow_vllm_batch.exceptions import (
    BadRequestLineError,
    ServerAuthError,
    ServerUnavailableError,
)
from airflow_vllm_batch.serving.neighbour import (
    InFlightController,
    NeighbourPlan,
    Reading,
    ServerLoad,
    combine,
    parse_metrics,
    with_priority,
)

if TYPE_CHECKING:
    # Imported where a stream runs: only a worker that streams to a vLLM server needs it
    # (the ``server`` extra), not the scheduler or dag processor parsing a DAG file.
    import aiohttp

    from airflow_vllm_batch.serving.journal import Journal

#: Default requests in flight: twice vLLM's default ``--max-num-seqs`` on most GPUs (256;
#: 128 on a CPU, 1024 on H100/H200/B200). The server runs at most ``--max-num-seqs``
#: sequences at once; a finished one is replaced at the next step only if a request is
#: already waiting in the server, because the client's refill (answer, journal, next POST,
#: the server's parsing and tokenizing) takes longer than a step when the server is busy.
#: Measured on the CPU server (max-num-seqs 128, 5,000 requests, benchmarks/engines.py):
#: 64 in flight 88 s, 128 87 s, 256 52 s, 512 50 s. More than about twice buys nothing and
#: costs: requests in flight are never checkpointed, so a kill answers them twice. For a
#: bigger server or a load-balanced deployment, set twice its ``--max-num-seqs`` times
#: its replicas (the ``max_in_flight`` extra of the ``vllm`` connection).
DEFAULT_MAX_IN_FLIGHT = 512
#: Default retries of a transient failure; with the backoff below, about 30 s of patience
#: (a server restart behind a load balancer) before the task gives up and Airflow retries.
DEFAULT_RETRIES = 6
DEFAULT_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
#: The longest ``Retry-After`` honoured: a gateway asking for more is better served by the
#: task's retry (Airflow's ``retry_delay``) than by a worker holding its slot idle.
MAX_RETRY_AFTER_S = 60.0
#: Default seconds one request may take, its retries included. A long generation on a busy
#: server queues behind ``--max-num-seqs`` others; a too-short timeout would resend it
#: again and again. A server that answers no request for this long ends the try (wedged).
DEFAULT_REQUEST_TIMEOUT_S = 1800.0
#: The batch URLs the stream can send: each body goes to the server as JSON, as is. Audio
#: lines are not among them: their ``file_url`` must be fetched and sent as a multipart
#: upload, which only vLLM's batch runner does. ``/score`` and ``/rerank`` are the server's
#: own routes for the URLs vLLM's runner matches by suffix.
SERVED_URLS: frozenset[str] = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    }
)
#: Lines read from the input per trip to the reader thread, at least. A trip waits for the GIL
#: (the loop holds it while it answers), so a chunk is ``max(_READ_CHUNK, 2 * max_in_flight)``
#: lines: with one in_flight's worth, senders found the buffer empty on 1 request in 7 (20,000
#: requests, 256 in flight, an instant server); with two, only when the run starts.
_READ_CHUNK = 64

#: Statuses that, once the retries ran out, say the server (or all behind its balancer) is gone.
_GONE_STATUSES = frozenset({502, 503})
_AUTH_STATUSES = frozenset({401, 403})
#: 4xx answers that are the server's state, not the request's fault: retried, never final.
_TRANSIENT_4XX = frozenset({408, 429})
#: Answers that say the server (or its balancer) is full: a neighbourly batch backs off on them.
_FULL_STATUSES = frozenset({429, 503})
#: Seconds one read of a server's ``/metrics`` may take (a neighbourly batch's check).
_METRICS_TIMEOUT_S = 2.0


class _RequestLine(msgspec.Struct, gc=False):
    """What the stream needs of a request line; ``body`` stays raw JSON and is sent as is."""

    custom_id: str
    url: str
    body: msgspec.Raw


# A near-copy of run.answer_cache._Usage and batchfile.models.Usage, left on purpose: each
# reads usage with its own strictness (here an embedding's usage has no completion_tokens, and
# a count that is not a number fails the decode), so one struct for all three would change
# which answers decode.
class _Usage(msgspec.Struct, gc=False):
    prompt_tokens: int = 0
    completion_tokens: int | None = None


class _Answer(msgspec.Struct, gc=False):
    """What the stream reads of a successful answer (decoding it also checks it is JSON)."""

    usage: _Usage | None = None


class _ErrorInfo(msgspec.Struct, gc=False):
    message: str
    type: str
    code: int


class _ErrorResponse(msgspec.Struct, gc=False):
    """vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``."""

    error: _ErrorInfo


_decode_request = msgspec.json.Decoder(_RequestLine).decode
_decode_answer = msgspec.json.Decoder(_Answer).decode
_decode_error = msgspec.json.Decoder(_ErrorResponse).decode
_encode = msgspec.json.encode


@dataclass
class StreamStats:
    """Counts of a stream so far; ``on_progress`` gets a copy, :func:`run_stream` returns the last.

    :param read: request lines read from the input (the total so far).
    :param skipped: lines not sent because ``skip`` said they were answered already.
    :param done: requests given a final answer in this run (a line journaled), failed ones included.
    :param failed: final answers that are errors (``error`` is not null): a 4xx.
    :param retried: attempts that failed transiently and were tried again.
    :param unanswered: requests whose retries ran out on a non-final answer: set aside, not journaled.
    :param unanswered_reasons: those requests by their last answer (``"HTTP 429"``, ``"timeout"``, ...).
    :param unanswered_example: the custom_id of one of them, for messages.
    :param in_flight: requests sent and not yet answered.
    :param prompt_tokens: prompt tokens of the answers, from their ``usage``.
    :param completion_tokens: output tokens of the answers, from their ``usage``.
    :param durable: answers in parts that ``on_part`` accepted (safe from a kill).
    :param elapsed_s: seconds since the stream started.
    :param bound: a neighbourly stream's bound on requests in flight now (None: the fixed ``max_in_flight``).
    :param bound_lowered: times that bound was lowered so far.
    :param bound_raised: times it was raised so far.
    :param bound_last_move: the last change of the bound and why (``lowered 64 -> 32: ...``).
    """

    read: int = 0
    skipped: int = 0
    done: int = 0
    failed: int = 0
    retried: int = 0
    unanswered: int = 0
    unanswered_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    unanswered_example: str | None = None
    in_flight: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    durable: int = 0
    elapsed_s: float = 0.0
    bound: int | None = None
    bound_lowered: int = 0
    bound_raised: int = 0
    bound_last_move: str = ""

    @property
    def requests_per_s(self) -> float:
        """Answers per second of this run."""
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        """Output (completion) tokens per second of this run."""
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def run_stream(
    requests: Iterable[tuple[int, bytes]],
    *,
    base_url: str,
    api_key: str | None,
    journal: Journal,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    skip: Callable[[str], bool] | None = None,
    retries: int = DEFAULT_RETRIES,
    on_progress: Callable[[StreamStats], None] | None = None,
    progress_every_s: float = 15.0,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    backoff_s: float = DEFAULT_BACKOFF_S,
    stop: Callable[[], object] | None = None,
    neighbour: NeighbourPlan | None = None,
) -> StreamStats:
    """Send every request line to the server and journal one vLLM batch output line per answer.

    Output order is completion order (match answers to requests by ``custom_id``). Only
    final answers are journaled; requests left without one are set aside in the journal and
    counted in :attr:`StreamStats.unanswered`. The journal is sealed and its last part
    reported before this returns or raises.

    :param requests: ``(input line number, raw request line)`` pairs, read lazily, in a
        worker thread (so a network-backed reader does not block the event loop); blank
        lines are ignored.
    :param base_url: the server's root, e.g. ``http://127.0.0.1:8000`` (the lines' ``url``
        is appended).
    :param api_key: the server's API key, sent as ``Authorization: Bearer``; None for none.
    :param journal: where answers go; see :class:`~airflow_vllm_batch.serving.journal.Journal`.
    :param max_in_flight: most requests sent and not yet answered. Default 512.
    :param skip: ``skip(custom_id)`` is true for a request answered already (a resumed
        run); such lines are not sent. Called in the reader thread, one call at a time.
    :param retries: times a transiently failed request is sent again. Default 6.
    :param on_progress: called with a copy of the counts every ``progress_every_s``
        seconds, on the event loop (keep it quick).
    :param progress_every_s: seconds between progress calls. Default 15.
    :param request_timeout_s: seconds one request may take, all its attempts and the waits
        between them included; when no request got any answer for this long the server is taken
        to be wedged (:class:`ServerUnavailableError`). Default 1800.
    :param backoff_s: the first retry's delay; doubled per retry, at most 30 s. Default 0.5.
        An answer's ``Retry-After`` replaces it.
    :param stop: asked before each request is sent (keep it quick: it runs on the event loop); once it
        answers true, nothing more is sent, the requests in flight are answered and journaled, and the
        stream ends normally (the requests not sent are neither answered nor set aside). Default: never.
    :param neighbour: be a good neighbour on a shared server (see
        :mod:`~airflow_vllm_batch.serving.neighbour`): ``max_in_flight`` is then the most the bound
        grows to. Default None: a fixed bound.
    :raises ServerUnavailableError: the server stayed unreachable through the retries.
    :raises ServerAuthError: the server refused the API key.
    :raises BadRequestLineError: a line is not a request line.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
    stream = _Stream(
        base_url=base_url.rstrip("/"),
        api_key=api_key,
        journal=journal,
        max_in_flight=max_in_flight,
        skip=skip,
        retries=retries,
        request_timeout_s=request_timeout_s,
        backoff_s=backoff_s,
        stop=stop,
        neighbour=neighbour,
    )
    return asyncio.run(stream.run(iter(requests), on_progress, progress_every_s))


def result_line(custom_id: str, status_code: int, body: bytes | None, error: bytes | None) -> bytes:
    """Return one output line in vLLM 0.32's batch format (``BatchRequestOutput``), with its newline.

    :param custom_id: the request's ``custom_id``.
    :param status_code: ``response.status_code``.
    :param body: the answer's JSON (``response.body``), or None for ``null``.
    :param error: ``error`` as JSON (vLLM's ``ErrorResponse`` object, or a JSON string),
        or None for ``null``.
    """
    # One formatting of one template: this runs once per answer, on the event loop.
    return _RESULT_LINE % (
        _getrandbits(64),
        _encode(custom_id),
        status_code,
        _getrandbits(64),
        body if body is not None else b"null",
        error if error is not None else b"null",
    )


#: ``id`` and ``request_id`` are 16 hex digits, as vLLM's ``random_uuid()``. They only need to be
#: unique, not secret: the module's generator (reseeded in a forked child) costs a fraction of a
#: ``uuid4()``, which reads the OS's random source each time.
_RESULT_LINE = b'{"id":"vllm-%016x","custom_id":%s,"response":{"status_code":%d,"request_id":"vllm-batch-%016x","body":%s},"error":%s}\n'
_getrandbits = random.getrandbits


def _one_line(payload: bytes) -> bytes:
    """Return ``payload`` (valid JSON) on one line: a pretty-printing proxy must not split an output line."""
    if b"\n" in payload or b"\r" in payload:
        return _encode(msgspec.json.decode(payload))
    return payload


def _backoff(attempt: int, first_s: float) -> float:
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


def _is_final(status: int) -> bool:
    """Whether an answer with this status is the request's own (checkpointed), not the server's state (retried)."""
    return status == 200 or (400 <= status < 500 and status not in _TRANSIENT_4XX)


class _Transient(Exception):
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


class _Stream:
    """One run of :func:`run_stream`: the session, the bound on in-flight requests, the counts."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None,
        journal: Journal,
        max_in_flight: int,
        skip: Callable[[str], bool] | None,
        retries: int,
        request_timeout_s: float,
        backoff_s: float,
        stop: Callable[[], object] | None = None,
        neighbour: NeighbourPlan | None = None,
    ) -> None:
        self.base_url = base_url
        self.stop = stop
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.journal = journal
        self.max_in_flight = max_in_flight
        self.skip = skip
        self.retries = retries
        self.request_timeout_s = request_timeout_s
        self.backoff_s = backoff_s
        self.stats = StreamStats()
        self._started = 0.0
        #: When the server last answered any request (headers received): a timeout with no answer since is a wedged server.
        self._last_answer_at = 0.0
        self.neighbour = neighbour
        #: The priority every body carries (a neighbourly batch on a server that runs priority scheduling).
        self.priority = neighbour.priority if neighbour is not None else None
        #: A neighbourly stream's bound on requests in flight (None: ``max_in_flight`` senders are the bound).
        self.gate: _Gate | None = None
        #: 429/503 answers since the last check of a neighbourly stream.
        self.rejections = 0

    async def run(
        self,
        requests: Iterator[tuple[int, bytes]],
        on_progress: Callable[[StreamStats], None] | None,
        progress_every_s: float,
    ) -> StreamStats:
        """Read, send and journal until the input is exhausted; the first error stops everything.

        ``max_in_flight`` sender tasks each send one request at a time, which is what
        bounds the requests in flight; they take their requests from a :class:`_Feed` that
        reads the input a chunk at a time.
        """
        import aiohttp  # here, not at the top: DAG files import this module; only a worker that streams needs aiohttp

        #: What says the connection (so, likely, the server) failed, for :meth:`_answer`'s except clause.
        self._connection_errors = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
        self._started = time.monotonic()
        feed = _Feed(
            lambda size: self._read_chunk(requests, size), chunk=max(_READ_CHUNK, 2 * self.max_in_flight)
        )
        # The connector's own limit (100 by default) would silently cap concurrency below ours.
        connector = aiohttp.TCPConnector(limit=self.max_in_flight, limit_per_host=0)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=30)
        progress = (
            asyncio.create_task(self._report_progress(on_progress, progress_every_s)) if on_progress else None
        )
        steering: asyncio.Task[None] | None = None
        try:
            async with self.journal, aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                if self.neighbour is not None:
                    steering = await self._start_steering()
                await _all_or_first_error([self._send_loop(session, feed) for _ in range(self.max_in_flight)])
        finally:
            feed.close()
            if progress is not None:
                progress.cancel()
            if steering is not None:
                steering.cancel()
                await asyncio.gather(steering, return_exceptions=True)
        return self._snapshot()

    async def _start_steering(self) -> asyncio.Task[None]:
        """Read the server's load once, set the first bound, and start the checks that move it (a neighbourly stream)."""
        import aiohttp

        assert self.neighbour is not None
        # A session of its own: the requests' connector is sized for them, and a check must not wait behind them.
        metrics = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_METRICS_TIMEOUT_S))
        load = await self._read_load(metrics)
        controller = InFlightController(
            self.max_in_flight, self.neighbour.min_in_flight, metrics=load is not None
        )
        self.gate = _Gate(controller.start(load).bound)
        self._note_bound(controller)
        return asyncio.create_task(self._steer(controller, metrics))

    async def _steer(self, controller: InFlightController, metrics: aiohttp.ClientSession) -> None:
        """Every check: read the load and the 429/503s since the last, move the bound (until cancelled)."""
        assert self.neighbour is not None
        assert self.gate is not None
        try:
            while True:
                await asyncio.sleep(self.neighbour.check_every_s)
                before = self.stats.in_flight
                load = await self._read_load(metrics)
                rejections, self.rejections = self.rejections, 0
                move = controller.update(Reading(load, max(before, self.stats.in_flight), rejections))
                self.gate.set_limit(move.bound)
                self._note_bound(controller)
        finally:
            await metrics.close()

    def _note_bound(self, controller: InFlightController) -> None:
        self.stats.bound = controller.bound
        self.stats.bound_lowered = controller.lowered
        self.stats.bound_raised = controller.raised
        self.stats.bound_last_move = controller.last_change.describe() if controller.last_change else ""

    async def _read_load(self, session: aiohttp.ClientSession) -> ServerLoad | None:
        """The load of the servers behind the metrics URLs (None when none could be read)."""
        assert self.neighbour is not None
        urls = self.neighbour.metrics_urls or (self.base_url + "/metrics",)
        return combine(await asyncio.gather(*(self._read_metrics(session, url) for url in urls)))

    async def _read_metrics(self, session: aiohttp.ClientSession, url: str) -> ServerLoad | None:
        import aiohttp

        # The API key goes only to the server it is for, not to another URL a user listed.
        headers = (
            {"Authorization": self.headers["Authorization"]}
            if "Authorization" in self.headers and url.startswith(self.base_url + "/")
            else {}
        )
        try:
            async with session.get(url, headers=headers) as response:
                if response.status != 200:
                    return None
                return parse_metrics(await response.text())
        except (asyncio.TimeoutError, ValueError, UnicodeDecodeError, aiohttp.ClientError):
            return None

    def _read_chunk(self, requests: Iterator[tuple[int, bytes]], size: int) -> list[_RequestLine] | None:
        """Return the next requests to send (skipped lines left out), or None at the end of the input."""
        chunk: list[_RequestLine] = []
        consumed = 0
        for number, raw in itertools.islice(requests, size):
            consumed += 1
            if not raw.strip():
                continue
            self.stats.read += 1
            try:
                request = _decode_request(raw)
            except msgspec.DecodeError as err:
                raise BadRequestLineError(
                    f"Input line {number} is not a request line ({err}); run preflight on the input first."
                ) from None
            if self.skip is not None and self.skip(request.custom_id):
                self.stats.skipped += 1
                continue
            chunk.append(request)
        return chunk if consumed else None

    async def _send_loop(self, session: aiohttp.ClientSession, feed: _Feed) -> None:
        """Send requests from the feed one at a time until there are no more."""
        journal = self.journal
        stats = self.stats
        gate = self.gate
        while True:
            if gate is not None:
                # A sender waits for room under the bound before it takes a request: the feed keeps the order.
                await gate.acquire()
            request = feed.take()
            if request is None:
                request = await feed.next()
            if request is None or (self.stop is not None and self.stop()):
                # No more requests, or stopped: this sender sends nothing more; what it had in flight is journaled already.
                if gate is not None:
                    gate.release()
                return
            stats.in_flight += 1
            try:
                line, failed, usage, unanswered = await self._answer(session, request)
            finally:
                stats.in_flight -= 1
                if gate is not None:
                    gate.release()
            # No await between the answer and the journal: an answer is written whole, in order.
            if unanswered is None:
                journal.write(line)
                stats.done += 1
                if failed:
                    stats.failed += 1
                if usage is not None:
                    stats.prompt_tokens += usage.prompt_tokens
                    stats.completion_tokens += usage.completion_tokens or 0
            else:
                # Not a final answer: a checkpoint must not hold it, or no retry would send it again.
                journal.set_aside(line)
                self._count_unanswered(unanswered, request.custom_id)

    def _count_unanswered(self, reason: str, custom_id: str) -> None:
        self.stats.unanswered += 1
        self.stats.unanswered_reasons[reason] = self.stats.unanswered_reasons.get(reason, 0) + 1
        if self.stats.unanswered_example is None:
            self.stats.unanswered_example = custom_id

    async def _answer(
        self, session: aiohttp.ClientSession, request: _RequestLine
    ) -> tuple[bytes, bool, _Usage | None, str | None]:
        """Send one request, retrying transient failures.

        :return: its output line, whether it failed, its usage, and None for a final answer
            or, for a request whose retries ran out on a non-final one, why.
        """
        url = self.base_url + request.url
        body = bytes(request.body)
        if self.priority is not None:
            body = with_priority(body, self.priority)
        sent_at = time.monotonic()
        # Bounded: the request's attempts and the waits between them all end by this deadline.
        deadline = sent_at + self.request_timeout_s
        for attempt in range(self.retries + 1):
            try:
                # The POST is here, not in a coroutine of its own: every await of aiohttp's resumes
                # each coroutine frame above it, and this loop runs once per request.
                try:
                    if attempt == 0:  # the session's timeout: request_timeout_s
                        post = session.post(url, data=body, headers=self.headers)
                    else:
                        post = session.post(
                            url, data=body, headers=self.headers, timeout=self._time_left(deadline)
                        )
                    async with post as response:
                        self._last_answer_at = time.monotonic()
                        payload = await response.read()
                except asyncio.TimeoutError as err:
                    raise self._timed_out(err) from None
                except self._connection_errors as err:
                    raise _Transient(gone=True, detail=f"{type(err).__name__}: {err}") from None
                return self._final(request, url, response, payload)
            except _Transient as transient:
                if transient.retry_after is not None:
                    # Never sooner than asked; the spread keeps the requests the gateway refused together apart.
                    delay = transient.retry_after * random.uniform(1.0, 1.2)
                else:
                    delay = _backoff(attempt, self.backoff_s)
                if attempt == self.retries or time.monotonic() + delay >= deadline:
                    if transient.reason == "timeout" and self._last_answer_at < sent_at:
                        self._wedged()
                    return self._gave_up(request, transient, attempt + 1), True, None, transient.reason
                self.stats.retried += 1
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _time_left(self, deadline: float) -> aiohttp.ClientTimeout:
        import aiohttp

        return aiohttp.ClientTimeout(total=max(deadline - time.monotonic(), 0.001), sock_connect=30)

    def _wedged(self) -> None:
        """No request got any answer for a whole ``request_timeout_s``: the server is wedged; end the try."""
        raise ServerUnavailableError(
            f"The vLLM server at {self.base_url} answered no request for {self.request_timeout_s:g}s (request_timeout): "
            "it looks wedged. The answers so far are checkpointed; retrying the task resumes from them."
        )

    def _timed_out(self, err: asyncio.TimeoutError) -> _Transient:
        """A timeout: a connect that timed out says the server is gone; a slow answer does not."""
        import aiohttp

        if isinstance(err, aiohttp.ConnectionTimeoutError):
            return _Transient(gone=True, detail=f"could not connect to {self.base_url} (timeout)")
        return _Transient(
            gone=False, detail=f"no answer within {self.request_timeout_s:g}s", reason="timeout"
        )

    def _final(
        self, request: _RequestLine, url: str, response: aiohttp.ClientResponse, payload: bytes
    ) -> tuple[bytes, bool, _Usage | None, None]:
        """One attempt's answer: return the output line of a final answer, its failure and usage, or raise :class:`_Transient`."""
        status = response.status
        if status == 200:
            try:
                # Decoded once: this checks the body is JSON and reads its usage.
                usage = _decode_answer(payload).usage
            except msgspec.DecodeError:
                # A body cut short or replaced on the way (a proxy's page): the answer is yet to come.
                error = _encode(
                    f"HTTP 200 from {request.url} with a body that is not JSON: {payload[:200]!r}"
                )
                line = result_line(request.custom_id, 500, None, error)
                raise _Transient(
                    gone=False, detail=f"HTTP 200 from {url}, not JSON", reason="HTTP 200 not JSON", line=line
                ) from None
            return result_line(request.custom_id, 200, _one_line(payload), None), False, usage, None
        if status in _AUTH_STATUSES:
            raise ServerAuthError(
                f"The vLLM server at {self.base_url} refused the API key (HTTP {status} for {request.url}). "
                "Check the API key (the password of the vllm connection, or the server's --api-key)."
            )
        if not _is_final(status):
            if status in _FULL_STATUSES:
                self.rejections += 1
            raise _Transient(
                gone=status in _GONE_STATUSES,
                detail=f"HTTP {status} from {url}",
                reason=f"HTTP {status}",
                line=self._to_line(request, status, payload)[0],
                retry_after=retry_after_s(response.headers.get("Retry-After")),
            )
        return (*self._to_line(request, status, payload), None)

    def _to_line(
        self, request: _RequestLine, status: int, payload: bytes
    ) -> tuple[bytes, bool, _Usage | None]:
        """Turn the server's answer other than a 200 into the output line vLLM's runner would have written."""
        try:
            code = _decode_error(payload).error.code
        except msgspec.DecodeError:
            text = payload[:500].decode("utf-8", errors="replace")
            return (
                result_line(
                    request.custom_id, status, None, _encode(f"HTTP {status} from {request.url}: {text}")
                ),
                True,
                None,
            )
        return result_line(request.custom_id, code, None, _one_line(payload)), True, None

    def _gave_up(self, request: _RequestLine, transient: _Transient, attempts: int) -> bytes:
        """The retries ran out: a gone server stops the run; any other request gets the line of its last answer."""
        if transient.gone:
            raise ServerUnavailableError(
                f"The vLLM server at {self.base_url} did not answer after {self.retries} retries "
                f"({transient.detail}). The answers so far are checkpointed; retrying the task resumes from them."
            )
        if transient.line is not None:
            return transient.line
        plural = "s" if attempts > 1 else ""
        return result_line(
            request.custom_id, 504, None, _encode(f"{transient.detail}, {attempts} attempt{plural}")
        )

    async def _report_progress(self, on_progress: Callable[[StreamStats], None], every_s: float) -> None:
        """Call ``on_progress`` every ``every_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            on_progress(self._snapshot())

    def _snapshot(self) -> StreamStats:
        self.stats.elapsed_s = time.monotonic() - self._started
        self.stats.durable = self.journal.lines_durable
        return dataclasses.replace(self.stats, unanswered_reasons=dict(self.stats.unanswered_reasons))


class _Gate:
    """A bound on requests in flight that can move while they are (a neighbourly stream's).

    Lowering it cancels nothing: the requests over it finish, and no sender starts another
    until the count is under it.

    :param limit: the first bound.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        """Wait until a request may start under the bound, and count it."""
        while self.active >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if not waiter.done():
                    waiter.cancel()
        self.active += 1

    def release(self) -> None:
        """A request ended."""
        self.active -= 1
        self._wake()

    def set_limit(self, limit: int) -> None:
        """Move the bound (the senders it lets start are woken)."""
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        room = self.limit - self.active
        while room > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                room -= 1


class _Feed:
    """The requests to send, read a chunk at a time in a worker thread, shared by the sender tasks.

    A sender takes the next request with :meth:`take` (no await, no per-request queue
    hand-off) and awaits :meth:`next` only when none is buffered. Reading is one task at a
    time, started ahead once fewer than a chunk is left, so the senders rarely wait; at
    most two chunks are read ahead of what is in flight (the input is read lazily).

    :param read: ``read(size)`` returns up to the next ``size`` requests (a list, possibly
        empty when every line was skipped or blank), or None at the end of the input; it
        runs in a worker thread so that a network-backed reader does not block the loop.
    :param chunk: lines per read.
    """

    def __init__(self, read: Callable[[int], list[_RequestLine] | None], chunk: int) -> None:
        self._read = read
        self._chunk = chunk
        self._buffered: collections.deque[_RequestLine] = collections.deque()
        self._reading: asyncio.Task[None] | None = None
        self._ended = False

    def take(self) -> _RequestLine | None:
        """Return a buffered request, or None if there is none now (then await :meth:`next`)."""
        if not self._buffered:
            return None
        # Read ahead once a chunk is begun: with the senders all answered at once, waiting until
        # the buffer runs dry would park most of them on the read (measured: 0.8 waits per request).
        if len(self._buffered) < self._chunk and self._reading is None and not self._ended:
            self._reading = asyncio.create_task(self._read_ahead())
        return self._buffered.popleft()

    async def next(self) -> _RequestLine | None:
        """Return the next request, reading more if needed, or None at the end of the input.

        :raises BadRequestLineError: a line read is not a request line (raised to every sender that waits).
        """
        while not self._buffered:
            if self._reading is None:
                if self._ended:
                    return None
                self._reading = asyncio.create_task(self._read_ahead())
            # Shielded: one sender cancelled while waiting must not cancel the read the others wait for.
            await asyncio.shield(self._reading)
        return self._buffered.popleft()

    async def _read_ahead(self) -> None:
        # On an error this task is left in place, done with it: every sender that waits for it raises it.
        chunk = await asyncio.to_thread(self._read, self._chunk)
        if chunk is None:
            self._ended = True
        else:
            self._buffered.extend(chunk)
        self._reading = None

    def close(self) -> None:
        """Cancel a read still under way (the run stopped); its thread finishes its chunk and is dropped."""
        if self._reading is None:
            return
        if self._reading.done():
            if not self._reading.cancelled():
                self._reading.exception()  # raised to a sender already, or moot: the run stopped for another error
        else:
            self._reading.cancel()


async def _all_or_first_error(coroutines: list[Coroutine[Any, Any, None]]) -> None:
    """Run the coroutines as tasks; on the first error cancel the rest and raise it.

    ``asyncio.TaskGroup`` does this from Python 3.11; the provider supports 3.10.
    """
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
