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

:func:`open_lines` is a context manager, so an HTTP connection or a file is
closed as soon as the ``with`` block ends, even when the consumer stops early::

    with open_lines("s3-presigned-or-local-path") as lines:
        report = preflight(lines, options)
"""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from typing import IO, Protocol, Union

from airflow_vllm_batch.exceptions import VLLMBatchError

#: Bytes read from the source per call; large enough that the per-call overhead
#: vanishes, small enough to keep memory flat.
DEFAULT_CHUNK_SIZE = 1 << 20
#: Longest line a reader keeps whole. Generous on purpose (a result line with a
#: large embedding is tens of KiB); validation applies its own, smaller limit.
DEFAULT_READER_MAX_LINE_BYTES = 64 << 20

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class SupportsRead(Protocol):
    """Anything with ``read(n) -> bytes``: an open file, an HTTP response, a botocore StreamingBody."""

    def read(self, n: int = ..., /) -> bytes: ...


Source = Union[str, os.PathLike, SupportsRead]
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

    :param url: any URL, possibly presigned.
    """
    parts = urllib.parse.urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc = f"{netloc}:{parts.port}"
    suffix = "?<redacted>" if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", "")) + suffix


def iter_lines(
    stream: SupportsRead,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    max_line_bytes: int | None = DEFAULT_READER_MAX_LINE_BYTES,
    on_bytes: ProgressCallback | None = None,
) -> Iterator[bytes]:
    """
    Yield the lines of a binary stream, without their ``\\n``, reading it in chunks.

    :param stream: an object with ``read(n)`` returning ``bytes`` (``b""`` at the end).
    :param chunk_size: bytes per ``read`` call. Default 1 MiB.
    :param max_line_bytes: lines longer than this are cut to ``max_line_bytes + 1``
        bytes; ``None`` keeps every line whole. Default 64 MiB.
    :param on_bytes: called with the size of every chunk read, e.g. to move a progress bar.
    """
    # chain() walks each chunk's list of lines in C; a generator yielding line
    # by line would add a frame switch per line (~40% of the reading time).
    return chain.from_iterable(_line_batches(stream, chunk_size, max_line_bytes, on_bytes))


def _line_batches(
    stream: SupportsRead,
    chunk_size: int,
    cap: int | None,
    on_bytes: ProgressCallback | None,
) -> Iterator[list[bytes]]:
    """Yield, per chunk read, the list of lines it completes."""
    read = stream.read
    # Pieces of a line that spans chunks, joined once when its newline arrives;
    # concatenating on every chunk would be quadratic for a very long line.
    pending: list[bytes] = []
    pending_len = 0
    while True:
        chunk = read(chunk_size)
        if not chunk:
            break
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
    if pending:
        last = b"".join(pending)
        yield [last if cap is None else last[: cap + 1]]


@contextmanager
def open_lines(
    source: Source,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    max_line_bytes: int | None = DEFAULT_READER_MAX_LINE_BYTES,
    on_bytes: ProgressCallback | None = None,
    timeout: float = 60.0,
) -> Iterator[Iterator[bytes]]:
    """
    Open a source and give an iterator over its lines (``bytes``, no ``\\n``).

    A context manager: the file or connection it opened is closed on exit. A
    file-like object passed in is *not* closed (its owner closes it).

    :param source: a local path (``str`` or ``os.PathLike``), an ``http://`` or
        ``https://`` URL (e.g. a presigned S3 GET URL, streamed with urllib), or
        a binary file-like object with ``read(n)`` such as a botocore ``StreamingBody``.
    :param chunk_size: bytes per read. Default 1 MiB.
    :param max_line_bytes: see :func:`iter_lines`. Default 64 MiB.
    :param on_bytes: progress callback, called with the size of each chunk read.
    :param timeout: socket timeout in seconds for URLs. Default 60.
    """
    kwargs = {"chunk_size": chunk_size, "max_line_bytes": max_line_bytes, "on_bytes": on_bytes}
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if isinstance(text, str) and text.startswith(("http://", "https://")):
            with _open_url(text, timeout) as response:
                yield iter_lines(response, **kwargs)
            return
        if isinstance(text, str) and _SCHEME.match(text):
            raise VLLMBatchError(
                f"{text!r}: only local paths and http(s) URLs can be read here; "
                "open s3:// objects with S3Hook and pass the body (a file-like object)."
            )
        try:
            handle: IO[bytes] = open(text, "rb")
        except OSError as exc:
            raise VLLMBatchError(f"{text}: cannot open the file ({exc.strerror}).") from exc
        with handle:
            yield iter_lines(handle, **kwargs)
        return
    if not hasattr(source, "read"):
        raise TypeError(f"open_lines() needs a path, an http(s) URL or a binary file-like object, got {type(source).__name__}")
    yield iter_lines(source, **kwargs)


def _open_url(url: str, timeout: float):
    """Open a GET request for ``url``, raising an error that never shows the query string."""
    try:
        return urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout)  # noqa: S310
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
