"""Streaming line readers over a local path, an http(s) URL or a binary file-like object.

Every reader yields one ``bytes`` object per physical line, **without** its ``\\n``
terminator, so that line numbers match what an editor shows (blank lines are
yielded as ``b""`` and counted). The file is read in chunks of ``chunk_size``
bytes; memory is bounded by the chunk size plus the longest line, and a line
longer than ``max_line_bytes`` is cut to ``max_line_bytes + 1`` bytes (the rest
of it is discarded while reading) so that a file without newlines can never be
held in memory whole. A consumer that sees a line longer than its own limit
reports it as too long.

Line endings and BOM, by design:

* A missing final newline is fine (vLLM itself writes its uploaded output
  without one).
* ``\\r\\n`` line endings are passed through untouched: the ``\\r`` stays at the
  end of the yielded line. It is JSON whitespace, so the line still decodes,
  and vLLM's reader strips it too; a cleaned copy keeps the line's bytes as read.
* A UTF-8 byte order mark is passed through as well; :func:`preflight` rejects
  it with a clear message on line 1 (vLLM's own reader would crash on it).

Compressed files: :func:`open_lines` recognises gzip by its first bytes (``1f 8b``),
not by the file's name, and decompresses it while streaming (memory stays bounded;
a multi-member file such as ``cat a.gz b.gz`` reads as one). Corrupt or truncated
gzip data raises :class:`~airflow_vllm_batch.exceptions.PreflightError` naming the
file. zstd is recognised (``28 b5 2f fd``) and refused with a clear message: no
zstd library is a dependency. vLLM cannot read a compressed file, so a caller that
hands the file to the engine checks :attr:`Lines.compression` (or
:func:`is_compressed` before opening) and gives the engine an uncompressed copy
(preflight's cleaned copy).

:func:`open_lines` is a context manager, so an HTTP connection or a file is
closed as soon as the ``with`` block ends, even when the consumer stops early::

    with open_lines("s3-presigned-or-local-path") as lines:
        report = preflight(lines, options)
"""

from __future__ import annotations

import base64
import gzip
import http.client
import os
import re
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from typing import IO, Any, Protocol

from airflow_vllm_batch.exceptions import ConfigurationError, PreflightError, VLLMBatchError

#: Bytes read from the source per call; large enough that the per-call overhead
#: vanishes, small enough to keep memory flat.
DEFAULT_CHUNK_SIZE = 1 << 20
#: Longest line a reader keeps whole. Generous on purpose (a result line with a
#: large embedding is tens of KiB); validation applies its own, smaller limit.
DEFAULT_READER_MAX_LINE_BYTES = 64 << 20

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: Bytes needed to recognise every supported or refused compression format.
_MAGIC_BYTES = 4


class SupportsRead(Protocol):
    """Anything with ``read(n) -> bytes``: an open file, an HTTP response, a botocore StreamingBody."""

    def read(self, n: int = ..., /) -> bytes: ...


Source = str | os.PathLike[str] | SupportsRead
ProgressCallback = Callable[[int], None]


def describe_source(source: Source) -> str:
    """
    Return a printable name for a source, safe for logs and exception messages.

    The query string and any user info of a URL are dropped: a presigned URL
    carries its signature there, and it must never reach a log line.

    :param source: a path, an http(s) URL or a file-like object.
    """
    if isinstance(source, os.PathLike):
        return os.fspath(source)
    if isinstance(source, str):
        if source.startswith(("http://", "https://")):
            return redact_url(source)
        return source
    name = getattr(source, "name", None)
    if isinstance(name, str):
        return name
    return f"<{type(source).__name__}>"


def redact_url(url: str) -> str:
    """
    Return ``url`` without credentials, query string or fragment.

    :param url: any URL, possibly presigned, possibly malformed (a port that is no number is left out).
    """
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # e.g. an unclosed "[": nothing of it is safe to show but its scheme
        return url.partition(":")[0] + "://<a URL that cannot be parsed>"
    return urllib.parse.urlunsplit((parts.scheme, _host_and_port(parts), parts.path, "", "")) + (
        "?<redacted>" if parts.query else ""
    )


def url_secrets(url: str | None) -> list[str]:
    """The parts of an http(s) URL that may be credentials, for the secrets masker: the URL itself, its query, its user info.

    :param url: an input URL (``https://user:password@host/in.jsonl``, a presigned URL's ``?X-Amz-...``).
    """
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return []
    parts = urllib.parse.urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    found = [
        parts.query,
        userinfo,
        userinfo.partition(":")[2],
        urllib.parse.unquote(userinfo.partition(":")[2]),
    ]
    return [url, *dict.fromkeys(value for value in found if value)] if any(found) else []


def _host_and_port(parts: urllib.parse.SplitResult) -> str:
    """``host[:port]`` of a URL, without user info; a port that is no number is left out."""
    netloc = parts.hostname or ""
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{netloc}:{port}" if port else netloc


class Lines:
    """
    The lines of one source (``bytes``, no ``\\n``), and what is known about the file itself.

    Iterating a ``Lines`` iterates its inner C-level iterator directly, so a
    ``for`` loop over it costs no more than over a plain iterator.

    :ivar compression: ``"gzip"`` when the source was decompressed while reading, else ``None``.
    :ivar ended_with_newline: once every line was read: whether the file's last byte
        was ``\\n`` (``None`` before the end). Lets a writer reproduce the file's bytes
        exactly (vLLM uploads its output without a final newline).
    """

    __slots__ = ("_lines", "compression", "ended_with_newline")

    def __init__(self, lines: Iterator[bytes], compression: str | None = None) -> None:
        self._lines = lines
        self.compression = compression
        self.ended_with_newline: bool | None = None

    def __iter__(self) -> Iterator[bytes]:
        return self._lines

    def __next__(self) -> bytes:
        return next(self._lines)


_URL_QUERY = re.compile(r"(https?://[^\s?'\"]*)\?[^\s'\"]*")
_SIGNATURE = re.compile(r"((?:X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|Signature)=)[^\s&'\"]*")


def redact_urls(line: str) -> str:
    """Remove the query string of every http(s) URL in ``line``, and any bare signature.

    A presigned S3 URL carries its credential in the query string; the path alone
    (bucket and key) is safe and useful to show.

    :param line: a line of text, e.g. of the engine's log.
    :return: the line with ``?<query>`` replaced by ``?<redacted>``.
    """
    line = _URL_QUERY.sub(r"\1?<redacted>", line)
    return _SIGNATURE.sub(r"\1<redacted>", line)


def iter_lines(
    stream: SupportsRead,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    max_line_bytes: int | None = DEFAULT_READER_MAX_LINE_BYTES,
    on_bytes: ProgressCallback | None = None,
) -> Lines:
    """
    Yield the lines of a binary stream, without their ``\\n``, reading it in chunks.

    :param stream: an object with ``read(n)`` returning ``bytes`` (``b""`` at the end).
    :param chunk_size: bytes per ``read`` call. Default 1 MiB.
    :param max_line_bytes: lines longer than this are cut to ``max_line_bytes + 1``
        bytes; ``None`` keeps every line whole. Default 64 MiB.
    :param on_bytes: called with the size of every chunk read, e.g. to move a progress bar.
    """
    lines = Lines(iter(()))
    # chain() walks each chunk's list of lines in C; a generator yielding line
    # by line would add a frame switch per line (~40% of the reading time).
    lines._lines = chain.from_iterable(_line_batches(stream, chunk_size, max_line_bytes, on_bytes, lines))
    return lines


def _line_batches(
    stream: SupportsRead,
    chunk_size: int,
    cap: int | None,
    on_bytes: ProgressCallback | None,
    state: Lines | None = None,
) -> Iterator[list[bytes]]:
    """Yield, per chunk read, the list of lines it completes; record on ``state`` how the stream ended."""
    read = stream.read
    last = b""
    # Pieces of a line that spans chunks, joined once when its newline arrives;
    # concatenating on every chunk would be quadratic for a very long line.
    pending: list[bytes] = []
    pending_len = 0
    while True:
        chunk = read(chunk_size)
        if not chunk:
            break
        last = chunk
        if on_bytes is not None:
            on_bytes(len(chunk))
        parts = chunk.split(b"\n")
        if len(parts) == 1:
            # No newline in this chunk: the current line goes on (and past the
            # cap, its bytes are dropped rather than kept).
            if cap is None or pending_len <= cap:
                pending.append(chunk)
                pending_len += len(chunk)
            continue
        if pending:
            pending.append(parts[0])
            parts[0] = b"".join(pending)
            pending = []
            pending_len = 0
        tail = parts.pop()
        # One C-level max() per chunk rather than a Python test per line.
        if cap is not None and max(map(len, parts)) > cap:
            parts = [part if len(part) <= cap else part[: cap + 1] for part in parts]
        yield parts
        if tail:
            pending.append(tail)
            pending_len = len(tail)
    if state is not None:
        state.ended_with_newline = last.endswith(b"\n")
    if pending:
        tail_line = b"".join(pending)
        yield [tail_line if cap is None else tail_line[: cap + 1]]


@contextmanager
def open_lines(
    source: Source,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    max_line_bytes: int | None = DEFAULT_READER_MAX_LINE_BYTES,
    on_bytes: ProgressCallback | None = None,
    timeout: float = 60.0,
) -> Iterator[Lines]:
    """
    Open a source and give an iterator over its lines (``bytes``, no ``\\n``).

    A context manager: the file or connection it opened is closed on exit. A
    file-like object passed in is *not* closed (its owner closes it). gzip data
    is decompressed while reading (see the module docs); the :class:`Lines`
    given says so in its ``compression``.

    :param source: a local path (``str`` or ``os.PathLike``), an ``http://`` or
        ``https://`` URL (e.g. a presigned S3 GET URL, streamed with urllib), or
        a binary file-like object with ``read(n)`` such as a botocore ``StreamingBody``.
    :param chunk_size: bytes per read. Default 1 MiB.
    :param max_line_bytes: see :func:`iter_lines`; for a compressed file it applies
        to the decompressed lines. Default 64 MiB.
    :param on_bytes: progress callback, called with the size of each chunk read
        (compressed bytes for a compressed file, so it matches the file's size).
    :param timeout: socket timeout in seconds for URLs. Default 60.
    """
    kwargs = {"chunk_size": chunk_size, "max_line_bytes": max_line_bytes}
    name = describe_source(source)
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if isinstance(text, str) and text.startswith(("http://", "https://")):
            with _open_url(text, timeout) as response:
                yield _decoded_lines(response, name, on_bytes, kwargs)
            return
        if isinstance(text, str) and _SCHEME.match(text):
            raise VLLMBatchError(
                f"{text!r}: only local paths and http(s) URLs can be read here; "
                "open s3:// objects with S3Hook and pass the body (a file-like object)."
            )
        try:
            handle: IO[bytes] = open(text, "rb")  # noqa: SIM115 - closed by the `with` below; the open alone is guarded
        except OSError as exc:
            raise VLLMBatchError(f"{text}: cannot open the file ({exc.strerror}).") from exc
        with handle:
            yield _decoded_lines(handle, name, on_bytes, kwargs)
        return
    if not hasattr(source, "read"):
        raise TypeError(
            f"open_lines() needs a path, an http(s) URL or a binary file-like object, got {type(source).__name__}"
        )
    yield _decoded_lines(source, name, on_bytes, kwargs)


def _decoded_lines(
    stream: SupportsRead, name: str, on_bytes: ProgressCallback | None, kwargs: dict[str, Any]
) -> Lines:
    """Recognise the stream's compression from its first bytes and return its (decompressed) lines."""
    head = _read_at_least(stream, _MAGIC_BYTES)
    compression = compression_of_head(head)
    if compression == "zstd":
        raise PreflightError(
            f"{name} is compressed with zstd, which cannot be read here (no zstd library is installed) — "
            "decompress it (`zstd -d`) or compress it with gzip instead."
        )
    raw: SupportsRead = _Prefixed(head, stream) if head else stream
    if compression is None:
        return iter_lines(raw, on_bytes=on_bytes, **kwargs)
    if on_bytes is not None:
        raw = _Counting(raw, on_bytes)
    lines = iter_lines(_GzipReader(raw, name), **kwargs)
    lines.compression = compression
    return lines


def compression_of_head(head: bytes) -> str | None:
    """
    Return ``"gzip"`` or ``"zstd"`` when ``head`` (a file's first bytes) starts with that format's magic, else ``None``.

    :param head: at least the first 4 bytes of the file (fewer only for a shorter file).
    """
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    return None


def is_compressed(source: Source, *, timeout: float = 60.0) -> bool:
    """
    Return whether a source is compressed (gzip or zstd), reading only its first bytes.

    Decided by content, never by the name. For a file-like object only a seekable
    one can be asked (it is rewound); for a stream, open it with :func:`open_lines`
    and read :attr:`Lines.compression` instead.

    :param source: as for :func:`open_lines`.
    :param timeout: socket timeout in seconds for URLs. Default 60.
    """
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if isinstance(text, str) and text.startswith(("http://", "https://")):
            with _open_url(text, timeout, {"Range": f"bytes=0-{_MAGIC_BYTES - 1}"}) as response:
                return compression_of_head(response.read(_MAGIC_BYTES)) is not None
        try:
            with open(text, "rb") as handle:
                return compression_of_head(handle.read(_MAGIC_BYTES)) is not None
        except OSError as exc:
            raise VLLMBatchError(f"{text}: cannot open the file ({exc.strerror}).") from exc
    seek = getattr(source, "seek", None)
    if seek is None or not getattr(source, "seekable", lambda: False)():
        raise TypeError("is_compressed() cannot rewind this stream; use open_lines(...).compression instead")
    start = source.tell()  # type: ignore[attr-defined]  # seekable: checked above
    try:
        return compression_of_head(_read_at_least(source, _MAGIC_BYTES)) is not None
    finally:
        seek(start)


def _read_at_least(stream: SupportsRead, size: int) -> bytes:
    """Read ``size`` bytes (fewer only at the end of the stream): a network body may return less per call."""
    head = b""
    while len(head) < size:
        piece = stream.read(size - len(head))
        if not piece:
            break
        head += piece
    return head


class _Prefixed:
    """A stream with the bytes already read from it put back in front."""

    __slots__ = ("_head", "_stream")

    def __init__(self, head: bytes, stream: SupportsRead) -> None:
        self._head = head
        self._stream = stream

    def read(self, n: int = -1, /) -> bytes:
        if not self._head:
            return self._stream.read(n)
        if n is None or n < 0:
            data, self._head = self._head + self._stream.read(), b""
            return data
        # A short read is fine: every reader here loops until b"".
        data, self._head = self._head[:n], self._head[n:]
        return data


class _Counting:
    """A stream that reports the size of each read to a progress callback."""

    __slots__ = ("_on_bytes", "_stream")

    def __init__(self, stream: SupportsRead, on_bytes: ProgressCallback) -> None:
        self._stream = stream
        self._on_bytes = on_bytes

    def read(self, n: int = -1, /) -> bytes:
        data = self._stream.read(n)
        if data:
            self._on_bytes(len(data))
        return data


class _GzipReader:
    """Decompress a gzip stream while reading; corrupt or truncated data raises an error naming the file."""

    __slots__ = ("_gzip", "_name")

    def __init__(self, raw: SupportsRead, name: str) -> None:
        # GzipFile reads its fileobj forward only, so a socket or StreamingBody works.
        # GzipFile only ever calls read() on a fileobj opened "rb"; typeshed wants a whole file.
        self._gzip: gzip.GzipFile = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[call-overload]
        self._name = name

    def read(self, n: int = -1, /) -> bytes:
        try:
            return self._gzip.read(n)
        except EOFError:
            raise PreflightError(
                f"{self._name}: the gzip file is truncated (it ends before its compressed data does) — "
                "upload the whole file again (`gzip -t` checks a file)."
            ) from None
        except (gzip.BadGzipFile, zlib.error) as exc:
            raise PreflightError(
                f"{self._name}: the gzip data is corrupt ({exc}) — "
                "compress and upload the file again (`gzip -t` checks a file)."
            ) from None


def _open_url(url: str, timeout: float, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    """Open a GET request for ``url``, raising an error that never shows its credentials or query string.

    Credentials in the URL (``https://user:password@host/...``), which urllib cannot open, are
    sent as HTTP Basic authentication instead.

    :raises ConfigurationError: the URL cannot be opened as written (not retried).
    """
    headers = dict(headers or {})
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port that is no number, or out of range
        if "@" in parts.netloc:
            user, _, password = parts.netloc.rpartition("@")[0].partition(":")
            token = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(token).decode()
            parts = parts._replace(netloc=_host_and_port(parts))
        request = urllib.request.Request(urllib.parse.urlunsplit(parts), method="GET", headers=headers)
        # urlopen answers an http(s) request with an HTTPResponse (typeshed says Any).
        response: http.client.HTTPResponse = urllib.request.urlopen(request, timeout=timeout)
        return response
    except (http.client.InvalidURL, ValueError) as exc:
        # Their messages quote the URL's parts, credentials included: only the redacted URL is told.
        raise ConfigurationError(
            f"input_uri: {redact_url(url)} is not a URL that can be read ({type(exc).__name__}). "
            "Fix input_uri (http(s)://[user:password@]host[:port]/path)."
        ) from None
    except urllib.error.HTTPError as exc:
        raise VLLMBatchError(
            f"{redact_url(url)}: HTTP {exc.code} {exc.reason} while reading the batch file; "
            "check that the object exists and that a presigned URL has not expired."
        ) from None
    except urllib.error.URLError as exc:
        raise VLLMBatchError(f"{redact_url(url)}: cannot connect ({exc.reason}).") from None


def source_size(source: Source) -> int | None:
    """
    Return the size in bytes of a local file source, or ``None`` when unknown.

    :param source: as for :func:`open_lines`.
    """
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if isinstance(text, str) and _SCHEME.match(text):
            return None
        try:
            return os.path.getsize(text)
        except OSError:
            return None
    return None
