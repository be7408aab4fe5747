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

What is retried (with exponential backoff and jitter, ``retries`` times): connection
refused or reset, a dropped keep-alive connection, timeouts, and HTTP 502, 503 and 504.
When the retries run out on a connection error or a 502/503, the server is taken to be
gone: the stream stops, the journal is flushed (sealed and reported) and
:class:`~airflow_vllm_batch.exceptions.ServerUnavailableError` is raised, so that the
task's retry resumes from the checkpoints. A request that still times out (or gets 504)
after its retries becomes that line's error instead: it is more likely the request (a
very long generation) than the server. HTTP 401/403 raise
:class:`~airflow_vllm_batch.exceptions.ServerAuthError` at once. Any other status
(4xx, 500) is that line's answer.

This module has no Airflow imports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from airflow_vllm_batch.exceptions import (
    BadRequestLineError,
    ServerAuthError,
    ServerUnavailableError,
)
from airflow_vllm_batch.serving.journal import Journal

if TYPE_CHECKING:
    # Imported where a stream runs: only a worker that streams to a vLLM server needs it
    # (the ``server`` extra), not the scheduler or dag processor parsing a DAG file.
    import aiohttp

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
#: Default seconds one request may take. A long generation on a busy server queues
#: behind ``--max-num-seqs`` others; a too-short timeout would resend it again and again.
DEFAULT_REQUEST_TIMEOUT_S = 1800.0
#: The batch URLs the stream can send: each body goes to the server as JSON, as is. Audio
#: lines are not among them: their ``file_url`` must be fetched and sent as a multipart
#: upload, which only vLLM's batch runner does. ``/score`` and ``/rerank`` are the server's
#: own routes for the URLs vLLM's runner matches by suffix.
SERVED_URLS: frozenset[str] = frozenset(
    {"/v1/chat/completions", "/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"}
)
#: Lines read from the input per trip to the reader thread.
_READ_CHUNK = 64

_UNAVAILABLE_STATUSES = frozenset({502, 503})
_TIMEOUT_STATUSES = frozenset({504})
_AUTH_STATUSES = frozenset({401, 403})


class _RequestLine(msgspec.Struct, gc=False):
    """What the stream needs of a request line; ``body`` stays raw JSON and is sent as is."""

    custom_id: str
    url: str
    body: msgspec.Raw


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
    :param done: requests answered in this run (a line written), failed ones included.
    :param failed: answers that are errors (``error`` is not null).
    :param retried: attempts that failed transiently and were tried again.
    :param in_flight: requests sent and not yet answered.
    :param prompt_tokens: prompt tokens of the answers, from their ``usage``.
    :param completion_tokens: output tokens of the answers, from their ``usage``.
    :param durable: answers in parts that ``on_part`` accepted (safe from a kill).
    :param elapsed_s: seconds since the stream started.
    """

    read: int = 0
    skipped: int = 0
    done: int = 0
    failed: int = 0
    retried: int = 0
    in_flight: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    durable: int = 0
    elapsed_s: float = 0.0

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
) -> StreamStats:
    """Send every request line to the server and journal one vLLM batch output line per answer.

    Output order is completion order (match answers to requests by ``custom_id``). The
    journal is sealed and its last part reported before this returns or raises.

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
    :param request_timeout_s: seconds one attempt may take. Default 1800.
    :param backoff_s: the first retry's delay; doubled per retry, at most 30 s. Default 0.5.
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
    return b"".join(
        (
            b'{"id":"vllm-',
            _random_hex().encode(),
            b'","custom_id":',
            _encode(custom_id),
            b',"response":{"status_code":',
            str(status_code).encode(),
            b',"request_id":"vllm-batch-',
            _random_hex().encode(),
            b'","body":',
            body if body is not None else b"null",
            b'},"error":',
            error if error is not None else b"null",
            b"}\n",
        )
    )


def _random_hex() -> str:
    """16 hex digits, as vLLM's ``random_uuid()``."""
    return f"{uuid.uuid4().int & 0xFFFFFFFFFFFFFFFF:016x}"


def _one_line(payload: bytes) -> bytes:
    """Return ``payload`` (valid JSON) on one line: a pretty-printing proxy must not split an output line."""
    if b"\n" in payload or b"\r" in payload:
        return _encode(msgspec.json.decode(payload))
    return payload


def _backoff(attempt: int, first_s: float) -> float:
    """Delay before retry ``attempt`` (0-based): exponential, capped, with jitter so retries do not march in step."""
    return min(MAX_BACKOFF_S, first_s * 2**attempt) * random.uniform(0.5, 1.0)  # noqa: S311 - not crypto


class _Transient(Exception):
    """One attempt failed in a way worth retrying; ``kind`` says how it ends when retries run out."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind  # "unavailable" (raise) or "timeout" (error line)
        self.detail = detail


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
    ) -> None:
        self.base_url = base_url
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

    async def run(
        self,
        requests: Iterator[tuple[int, bytes]],
        on_progress: Callable[[StreamStats], None] | None,
        progress_every_s: float,
    ) -> StreamStats:
        """Read, send and journal until the input is exhausted; the first error stops everything.

        ``max_in_flight`` sender tasks each send one request at a time, which is what
        bounds the requests in flight; a reader task keeps their queue filled.
        """
        import aiohttp

        self._started = time.monotonic()
        # A queue no longer than the in-flight bound: the reader stays just ahead of the senders.
        queue: asyncio.Queue[_RequestLine | None] = asyncio.Queue(maxsize=self.max_in_flight)
        # The connector's own limit (100 by default) would silently cap concurrency below ours.
        connector = aiohttp.TCPConnector(limit=self.max_in_flight, limit_per_host=0)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=30)
        progress = asyncio.create_task(self._report_progress(on_progress, progress_every_s)) if on_progress else None
        try:
            async with self.journal, aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                senders = [self._send_loop(session, queue) for _ in range(self.max_in_flight)]
                await _all_or_first_error([self._read(requests, queue), *senders])
        finally:
            if progress is not None:
                progress.cancel()
        return self._snapshot()

    async def _read(self, requests: Iterator[tuple[int, bytes]], queue: asyncio.Queue[_RequestLine | None]) -> None:
        """Read request lines in a worker thread, a chunk at a time, and queue those to send."""
        while (chunk := await asyncio.to_thread(self._read_chunk, requests)) is not None:
            for request in chunk:
                await queue.put(request)
        for _ in range(self.max_in_flight):
            await queue.put(None)

    def _read_chunk(self, requests: Iterator[tuple[int, bytes]]) -> list[_RequestLine] | None:
        """Return the next requests to send (skipped lines left out), or None at the end of the input."""
        chunk: list[_RequestLine] = []
        consumed = 0
        for number, raw in itertools.islice(requests, _READ_CHUNK):
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

    async def _send_loop(self, session: aiohttp.ClientSession, queue: asyncio.Queue[_RequestLine | None]) -> None:
        """Send queued requests one at a time until the reader says there are no more."""
        while (request := await queue.get()) is not None:
            self.stats.in_flight += 1
            try:
                line, failed, usage = await self._answer(session, request)
            finally:
                self.stats.in_flight -= 1
            # No await between the answer and the journal: an answer is written whole, in order.
            self.journal.write(line)
            self._count(failed, usage)

    def _count(self, failed: bool, usage: _Usage | None) -> None:
        self.stats.done += 1
        self.stats.failed += failed
        if usage is not None:
            self.stats.prompt_tokens += usage.prompt_tokens
            self.stats.completion_tokens += usage.completion_tokens or 0

    async def _answer(self, session: aiohttp.ClientSession, request: _RequestLine) -> tuple[bytes, bool, _Usage | None]:
        """Send one request, retrying transient failures; return its output line, whether it failed, its usage."""
        for attempt in range(self.retries + 1):
            try:
                status, payload = await self._post(session, request)
            except _Transient as transient:
                if attempt == self.retries:
                    return self._gave_up(request, transient), True, None
                self.stats.retried += 1
                await asyncio.sleep(_backoff(attempt, self.backoff_s))
                continue
            return self._to_line(request, status, payload)
        raise AssertionError("unreachable")

    async def _post(self, session: aiohttp.ClientSession, request: _RequestLine) -> tuple[int, bytes]:
        """One attempt: return the status and body, or raise :class:`_Transient`."""
        import aiohttp

        url = self.base_url + request.url
        try:
            async with session.post(url, data=bytes(request.body), headers=self.headers) as response:
                payload = await response.read()
                status = response.status
        except asyncio.TimeoutError as err:
            if isinstance(err, aiohttp.ConnectionTimeoutError):
                raise _Transient("unavailable", f"could not connect to {self.base_url} (timeout)") from None
            raise _Transient("timeout", f"no answer within {self.request_timeout_s:g}s") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
            raise _Transient("unavailable", f"{type(err).__name__}: {err}") from None
        if status in _UNAVAILABLE_STATUSES:
            raise _Transient("unavailable", f"HTTP {status} from {url}")
        if status in _TIMEOUT_STATUSES:
            raise _Transient("timeout", f"HTTP {status} from {url}")
        if status in _AUTH_STATUSES:
            raise ServerAuthError(
                f"The vLLM server at {self.base_url} refused the API key (HTTP {status} for {request.url}). "
                "Check the API key (the password of the vllm connection, or the server's --api-key)."
            )
        return status, payload

    def _to_line(self, request: _RequestLine, status: int, payload: bytes) -> tuple[bytes, bool, _Usage | None]:
        """Turn the server's answer into the output line vLLM's runner would have written."""
        if status == 200:
            try:
                answer = _decode_answer(payload)
            except msgspec.DecodeError:
                error = _encode(f"HTTP 200 from {request.url} with a body that is not JSON: {payload[:200]!r}")
                return result_line(request.custom_id, 500, None, error), True, None
            return result_line(request.custom_id, 200, _one_line(payload), None), False, answer.usage
        try:
            code = _decode_error(payload).error.code
        except msgspec.DecodeError:
            text = payload[:500].decode("utf-8", errors="replace")
            return result_line(request.custom_id, status, None, _encode(f"HTTP {status} from {request.url}: {text}")), True, None
        return result_line(request.custom_id, code, None, _one_line(payload)), True, None

    def _gave_up(self, request: _RequestLine, transient: _Transient) -> bytes:
        """The retries ran out: a gone server stops the run; a request that keeps timing out gets an error line."""
        if transient.kind == "unavailable":
            raise ServerUnavailableError(
                f"The vLLM server at {self.base_url} did not answer after {self.retries} retries "
                f"({transient.detail}). The answers so far are checkpointed; retrying the task resumes from them."
            )
        message = f"{transient.detail}, {self.retries + 1} attempts"
        return result_line(request.custom_id, 504, None, _encode(message))

    async def _report_progress(self, on_progress: Callable[[StreamStats], None], every_s: float) -> None:
        """Call ``on_progress`` every ``every_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            on_progress(self._snapshot())

    def _snapshot(self) -> StreamStats:
        self.stats.elapsed_s = time.monotonic() - self._started
        self.stats.durable = self.journal.lines_durable
        return dataclasses.replace(self.stats)


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
