"""An HTTP proxy between the workers and S3 that delays, resets, refuses and loses what passes it.

``benchmarks/chaos.py`` points the deployment's ``aws_default`` connection at it; the
campaign's own checks talk to S3 directly. It reads each request whole (``Content-Length``
or ``chunked``), decides (seeded) what happens to it, and, unless refused, forwards it on
the client connection's own upstream connection and relays the response:

- ``delay``: the request waits 0.2-2 s before it is forwarded;
- ``reset``: the client connection is reset (RST) before anything is forwarded: the call
  never reached S3;
- ``slowdown`` / ``error500``: S3's ``503 SlowDown`` or ``500 InternalError`` is answered
  instead of forwarding (botocore retries both);
- ``lost``: the request is forwarded and S3 applies it, then the client connection is reset
  instead of relaying the answer: a write that landed while its client saw an error (botocore
  sends it again; the run protocol's conditional writes must recognise their own).

Faults are off until :meth:`FaultProxy.set_faults` turns a rate of them on; every injected
fault is counted by kind and logged (method and path only: a query may hold a presigned
URL's signature).

With ``observe`` it also counts: ``benchmarks/chaos.py --scenario resume`` puts one, faults off,
in front of the warm vLLM server and is told every request it forwards (method, path, body), to
count the sends of each request of a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

#: What the proxy can do to a request, besides forwarding it.
KINDS = ("delay", "reset", "slowdown", "error500", "lost")

_ERRORS = {
    "slowdown": (503, "Service Unavailable", "SlowDown", "Please reduce your request rate."),
    "error500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
}


class _Message:
    """One HTTP message's head (raw), start line and lower-cased headers."""

    def __init__(self, head: bytes) -> None:
        self.head = head
        lines = head.decode("latin-1").split("\r\n")
        self.start = lines[0]
        self.headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                self.headers[name.strip().lower()] = value.strip()

    @property
    def chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    @property
    def closes(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"


async def _read_body(reader: asyncio.StreamReader, msg: _Message, *, bodiless: bool = False) -> bytes:
    """The raw body of ``msg`` as it is on the wire (chunk framing kept)."""
    if bodiless:
        return b""
    if msg.chunked:
        parts = []
        while True:
            line = await reader.readuntil(b"\r\n")
            parts.append(line)
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = await reader.readuntil(b"\r\n")
                    parts.append(trailer)
                    if trailer == b"\r\n":
                        return b"".join(parts)
            parts.append(await reader.readexactly(size + 2))
    length = msg.headers.get("content-length")
    if length is not None:
        return await reader.readexactly(int(length))
    return b""


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a dropped connection looks to the client."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _cancel_all() -> None:
    """Cancel every connection's task but this one, and wait for them."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class FaultProxy:
    """A seeded fault-injecting HTTP proxy on 127.0.0.1 in front of one upstream (S3).

    :param upstream_host: the S3 server's host.
    :param upstream_port: its port.
    :param seed: the seed of the per-request decisions.
    :param log: called with one line per injected fault.
    :param observe: called with each request's method, path (no query) and raw body as it is
        read, before any fault is decided (from the proxy's thread: keep it short).
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        seed: int,
        log: Callable[[str], None] | None = None,
        observe: Callable[[str, str, bytes], None] | None = None,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rate = 0.0
        self._kinds: tuple[str, ...] = ()
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self._log = log or (lambda line: None)
        self._observe = observe
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    # -- control (any thread) ------------------------------------------------------------

    def set_faults(self, rate: float, kinds: tuple[str, ...] = KINDS) -> None:
        """From now on, inject one of ``kinds`` into a share ``rate`` of the requests (0: none)."""
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"FaultProxy.set_faults: unknown kinds {sorted(unknown)}; known: {KINDS}")
        with self._lock:
            self._rate, self._kinds = rate, tuple(kinds)

    def _decide(self) -> tuple[str | None, float]:
        with self._lock:
            self.requests += 1
            if not self._kinds or self._rng.random() >= self._rate:
                return None, 0.0
            kind = self._rng.choice(self._kinds)
            return kind, self._rng.uniform(0.2, 2.0)

    def start(self) -> FaultProxy:
        """Listen on a free loopback port (``self.port``), serving from a thread of its own."""
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._server = loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            self._server.close()
            loop.run_until_complete(_cancel_all())
            loop.close()

        self._thread = threading.Thread(target=serve, name="s3-fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the S3 fault proxy did not start listening in 30 s")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- serving -------------------------------------------------------------------------

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    request = _Message(await reader.readuntil(b"\r\n\r\n"))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if request.headers.get("expect", "").lower() == "100-continue":
                    # botocore sends a file-like body only once told to (it waits a second otherwise).
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                body = await _read_body(reader, request)
                method, _, rest = request.start.partition(" ")
                path = rest.split(" ")[0].split("?")[0]
                if self._observe is not None:
                    self._observe(method, path, body)
                kind, delay = self._decide()
                if kind is not None:
                    self.injected[kind] += 1
                    self._log(f"{time.time():.3f} proxy {kind} {method} {path}")
                if kind == "reset":
                    _reset(writer)
                    return
                if kind in _ERRORS:
                    status, reason, code, message = _ERRORS[kind]
                    xml = (
                        '<?xml version="1.0" encoding="UTF-8"?>'
                        f"<Error><Code>{code}</Code><Message>{message}</Message>"
                        f"<Resource>{path}</Resource><RequestId>chaos-proxy</RequestId></Error>"
                    ).encode()
                    writer.write(
                        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                        f"Content-Length: {len(xml)}\r\nConnection: close\r\n\r\n".encode()
                        + xml
                    )
                    with contextlib.suppress(ConnectionError):
                        await writer.drain()
                    return
                if kind == "delay":
                    await asyncio.sleep(delay)
                if upstream is None:
                    upstream = await asyncio.open_connection(*self.upstream)
                up_reader, up_writer = upstream
                up_writer.write(request.head + body)
                await up_writer.drain()
                while True:
                    response = _Message(await up_reader.readuntil(b"\r\n\r\n"))
                    status = int(response.start.split(" ")[1])
                    if status != 100:  # the client had its 100 Continue from the proxy
                        break
                bodiless = method == "HEAD" or status in (204, 304)
                if not bodiless and not response.chunked and "content-length" not in response.headers:
                    response_body = await up_reader.read()  # until the server closes
                    response.headers["connection"] = "close"
                else:
                    response_body = await _read_body(up_reader, response, bodiless=bodiless)
                if kind == "lost":
                    _reset(writer)
                    return
                writer.write(response.head + response_body)
                await writer.drain()
                if response.closes or request.closes:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError, IndexError):
            # The upstream died (S3 killed) or a client went away: the client sees a dropped connection.
            _reset(writer)
        except asyncio.CancelledError:
            # The proxy is stopping: the connection goes with it (a task left cancelled would be reported).
            _reset(writer)
        finally:
            if upstream is not None:
                upstream[1].transport.abort()
            if not writer.transport.is_closing():
                writer.close()
