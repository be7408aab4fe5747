"""Stream a batch file through a vLLM OpenAI-compatible server; one output line per request.

:func:`run_stream` reads request lines lazily, keeps at most ``max_in_flight`` requests
in flight over one keep-alive ``aiohttp`` session, and appends every answer to a
:class:`~airflow_vllm_batch.serving.journal.Journal` as soon as it arrives.

Output lines are vLLM's batch runner's, see :mod:`~airflow_vllm_batch.serving.wire`.

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
import dataclasses
import itertools
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from airflow_vllm_batch.exceptions import (
    BadRequestLineError,
    ServerAuthError,
    ServerUnavailableError,
)
from airflow_vllm_batch.serving.flow import Feed, Gate, all_or_first_error
from airflow_vllm_batch.serving.neighbour import (
    InFlightController,
    NeighbourPlan,
    Reading,
    ServerLoad,
    combine,
    parse_metrics,
    with_priority,
)

# Each ``X as X`` is re-exported: callers import it from here (run_stream's defaults, its output line).
from airflow_vllm_batch.serving.retry import (
    AUTH_STATUSES,
    DEFAULT_BACKOFF_S as DEFAULT_BACKOFF_S,
    DEFAULT_RETRIES as DEFAULT_RETRIES,
    FULL_STATUSES,
    GONE_STATUSES,
    MAX_BACKOFF_S as MAX_BACKOFF_S,
    MAX_RETRY_AFTER_S as MAX_RETRY_AFTER_S,
    Transient,
    backoff,
    is_final,
    retry_after_s as retry_after_s,
)
from airflow_vllm_batch.serving.wire import (
    SERVED_URLS as SERVED_URLS,
    RequestLine,
    Usage,
    decode_answer,
    decode_request,
    encode,
    error_line,
    one_line,
    result_line as result_line,
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
#: Default seconds one request may take, its retries included. A long generation on a busy
#: server queues behind ``--max-num-seqs`` others; a too-short timeout would resend it
#: again and again. A server that answers no request for this long ends the try (wedged).
DEFAULT_REQUEST_TIMEOUT_S = 1800.0
#: Lines read from the input per trip to the reader thread, at least. A trip waits for the GIL
#: (the loop holds it while it answers), so a chunk is ``max(_READ_CHUNK, 2 * max_in_flight)``
#: lines: with one in_flight's worth, senders found the buffer empty on 1 request in 7 (20,000
#: requests, 256 in flight, an instant server); with two, only when the run starts.
_READ_CHUNK = 64

#: Seconds one read of a server's ``/metrics`` may take (a neighbourly batch's check).
_METRICS_TIMEOUT_S = 2.0


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
        self.gate: Gate | None = None
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
        bounds the requests in flight; they take their requests from a
        :class:`~airflow_vllm_batch.serving.flow.Feed` that reads the input a chunk at a time.
        """
        import aiohttp  # here, not at the top: DAG files import this module; only a worker that streams needs aiohttp

        #: What says the connection (so, likely, the server) failed, for :meth:`_answer`'s except clause.
        self._connection_errors = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
        self._started = time.monotonic()
        feed = Feed(
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
                await all_or_first_error([self._send_loop(session, feed) for _ in range(self.max_in_flight)])
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
        self.gate = Gate(controller.start(load).bound)
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

    def _read_chunk(self, requests: Iterator[tuple[int, bytes]], size: int) -> list[RequestLine] | None:
        """Return the next requests to send (skipped lines left out), or None at the end of the input."""
        chunk: list[RequestLine] = []
        consumed = 0
        for number, raw in itertools.islice(requests, size):
            consumed += 1
            if not raw.strip():
                continue
            self.stats.read += 1
            try:
                request = decode_request(raw)
            except msgspec.DecodeError as err:
                raise BadRequestLineError(
                    f"Input line {number} is not a request line ({err}); run preflight on the input first."
                ) from None
            if self.skip is not None and self.skip(request.custom_id):
                self.stats.skipped += 1
                continue
            chunk.append(request)
        return chunk if consumed else None

    async def _send_loop(self, session: aiohttp.ClientSession, feed: Feed) -> None:
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
        self, session: aiohttp.ClientSession, request: RequestLine
    ) -> tuple[bytes, bool, Usage | None, str | None]:
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
                    raise Transient(gone=True, detail=f"{type(err).__name__}: {err}") from None
                return self._final(request, url, response, payload)
            except Transient as transient:
                if transient.retry_after is not None:
                    # Never sooner than asked; the spread keeps the requests the gateway refused together apart.
                    delay = transient.retry_after * random.uniform(1.0, 1.2)
                else:
                    delay = backoff(attempt, self.backoff_s)
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

    def _timed_out(self, err: asyncio.TimeoutError) -> Transient:
        """A timeout: a connect that timed out says the server is gone; a slow answer does not."""
        import aiohttp

        if isinstance(err, aiohttp.ConnectionTimeoutError):
            return Transient(gone=True, detail=f"could not connect to {self.base_url} (timeout)")
        return Transient(gone=False, detail=f"no answer within {self.request_timeout_s:g}s", reason="timeout")

    def _final(
        self, request: RequestLine, url: str, response: aiohttp.ClientResponse, payload: bytes
    ) -> tuple[bytes, bool, Usage | None, None]:
        """One attempt's answer: return the output line of a final answer, its failure and usage, or raise :class:`~airflow_vllm_batch.serving.retry.Transient`."""
        status = response.status
        if status == 200:
            try:
                # Decoded once: this checks the body is JSON and reads its usage.
                usage = decode_answer(payload).usage
            except msgspec.DecodeError:
                # A body cut short or replaced on the way (a proxy's page): the answer is yet to come.
                error = encode(f"HTTP 200 from {request.url} with a body that is not JSON: {payload[:200]!r}")
                line = result_line(request.custom_id, 500, None, error)
                raise Transient(
                    gone=False, detail=f"HTTP 200 from {url}, not JSON", reason="HTTP 200 not JSON", line=line
                ) from None
            return result_line(request.custom_id, 200, one_line(payload), None), False, usage, None
        if status in AUTH_STATUSES:
            raise ServerAuthError(
                f"The vLLM server at {self.base_url} refused the API key (HTTP {status} for {request.url}). "
                "Check the API key (the password of the vllm connection, or the server's --api-key)."
            )
        if not is_final(status):
            if status in FULL_STATUSES:
                self.rejections += 1
            raise Transient(
                gone=status in GONE_STATUSES,
                detail=f"HTTP {status} from {url}",
                reason=f"HTTP {status}",
                line=error_line(request.custom_id, request.url, status, payload),
                retry_after=retry_after_s(response.headers.get("Retry-After")),
            )
        return error_line(request.custom_id, request.url, status, payload), True, None, None

    def _gave_up(self, request: RequestLine, transient: Transient, attempts: int) -> bytes:
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
            request.custom_id, 504, None, encode(f"{transient.detail}, {attempts} attempt{plural}")
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
