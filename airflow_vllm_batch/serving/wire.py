"""The stream's wire format: the request lines it reads, the answers it decodes, the output lines it writes.

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

This module has no Airflow imports.
"""

from __future__ import annotations

import random

import msgspec

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


class RequestLine(msgspec.Struct, gc=False):
    """What the stream needs of a request line; ``body`` stays raw JSON and is sent as is."""

    custom_id: str
    url: str
    body: msgspec.Raw


# A near-copy of run.answer_cache._Usage and batchfile.models.Usage, left on purpose: each
# reads usage with its own strictness (here an embedding's usage has no completion_tokens, and
# a count that is not a number fails the decode), so one struct for all three would change
# which answers decode.
class Usage(msgspec.Struct, gc=False):
    prompt_tokens: int = 0
    completion_tokens: int | None = None


class Answer(msgspec.Struct, gc=False):
    """What the stream reads of a successful answer (decoding it also checks it is JSON)."""

    usage: Usage | None = None


class ErrorInfo(msgspec.Struct, gc=False):
    message: str
    type: str
    code: int


class ErrorResponse(msgspec.Struct, gc=False):
    """vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


decode_request = msgspec.json.Decoder(RequestLine).decode
decode_answer = msgspec.json.Decoder(Answer).decode
decode_error = msgspec.json.Decoder(ErrorResponse).decode
encode = msgspec.json.encode


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
        encode(custom_id),
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


def one_line(payload: bytes) -> bytes:
    """Return ``payload`` (valid JSON) on one line: a pretty-printing proxy must not split an output line."""
    if b"\n" in payload or b"\r" in payload:
        return encode(msgspec.json.decode(payload))
    return payload


def error_line(custom_id: str, url: str, status: int, payload: bytes) -> bytes:
    """Turn the server's answer other than a 200 into the output line vLLM's runner would have written.

    :param custom_id: the request's ``custom_id``.
    :param url: the request line's ``url``, for the error of an answer that is not an ``ErrorResponse``.
    :param status: the answer's HTTP status.
    :param payload: the answer's body.
    """
    try:
        code = decode_error(payload).error.code
    except msgspec.DecodeError:
        text = payload[:500].decode("utf-8", errors="replace")
        return result_line(custom_id, status, None, encode(f"HTTP {status} from {url}: {text}"))
    return result_line(custom_id, code, None, one_line(payload))
