"""Requests given as Python values (typically an upstream task's XCom) made into a batch file.

The quickest job is "run these prompts": ``LLM.generate(prompts, SamplingParams(...))`` in
vLLM, a list from an upstream ``@task`` in Airflow. :func:`build_batch_file` turns such a
list into the OpenAI batch JSONL that the rest of the pipeline (preflight, the engine, the
results check) reads, one line per item:

- a string: a prompt. For ``/v1/chat/completions`` one user message
  (``{"messages": [{"role": "user", "content": s}]}``); for ``/v1/embeddings`` the input
  (``{"input": s}``); for ``/v1/completions`` the prompt (``{"prompt": s}``, the server
  engine's).
- a list of message objects: a chat conversation (``{"messages": [...]}``; for
  ``/v1/embeddings`` vLLM's chat-style ``{"messages": [...]}``).
- an object: the request body itself, as given (any endpoint: score and rerank need one).

Every body gets ``model`` when it has none, and the ``default_body`` fields it lacks
(e.g. ``{"temperature": 0, "max_completion_tokens": 64}``), so that the file is complete
as written. ``custom_id`` is ``"request-<index>"`` (``custom_id="index"``, the default), or
the value of a key of each item (``custom_id="id"``: each item must be an object with a
non-empty ``id``; the key is taken out of the body, as it is not a request field).

The same items always give the same bytes (key order kept, compact JSON), so a retry
writes the same file and the run resumes (see :mod:`airflow_vllm_batch.identity`).

XCom lives in Airflow's metadata database, which is made for small values: at most
:data:`MAX_REQUESTS` items and :data:`MAX_REQUESTS_BYTES` bytes of batch file are taken
this way; above that, :class:`~airflow_vllm_batch.exceptions.ConfigurationError` says to
write the file to S3 in the upstream task and pass ``input_uri``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from airflow_vllm_batch.exceptions import ConfigurationError

#: The most items taken from XCom; more belongs in a file (``input_uri``).
MAX_REQUESTS = 10_000
#: The largest batch file made from XCom: 8 MiB of JSONL.
MAX_REQUESTS_BYTES = 8 * 1024 * 1024
#: The ``custom_id`` rule that numbers the items: ``request-0``, ``request-1``...
INDEX = "index"

_RESERVED_DEFAULTS = frozenset({"model", "stream"})


def build_batch_file(
    requests: Sequence[Any],
    *,
    model: str,
    url: str = "/v1/chat/completions",
    custom_id: str = INDEX,
    default_body: Mapping[str, Any] | None = None,
    parameter: str = "requests",
) -> bytes:
    """
    Return the batch file (JSONL bytes, one request per item) for a list of prompts, conversations or bodies.

    :param requests: strings, lists of chat messages, or request bodies (see the module docs).
    :param model: written as ``body.model`` where an item names none.
    :param url: the endpoint every line goes to. Default ``/v1/chat/completions``.
    :param custom_id: ``"index"`` (default): ``request-<index>``; else the key of each item that holds its custom_id.
    :param default_body: fields added to every body that lacks them. Default none.
    :param parameter: the operator parameter named in error messages. Default ``"requests"``.
    :raises ConfigurationError: the value is not a list of such items, an item cannot be
        made into a request, custom_ids repeat, or it is over the XCom limits.
    """
    items = _as_list(requests, parameter)
    if not items:
        raise ConfigurationError(
            f"{parameter} is empty: there is nothing to run. Return at least one request upstream."
        )
    if len(items) > MAX_REQUESTS:
        raise ConfigurationError(_too_big(parameter, f"{len(items):,} requests, more than {MAX_REQUESTS:,}"))
    defaults = dict(default_body or {})
    encode = msgspec.json.Encoder().encode
    seen: set[str] = set()
    lines: list[bytes] = []
    size = 0
    for index, item in enumerate(items):
        cid, body = _request_of(item, index, url=url, custom_id=custom_id, parameter=parameter)
        if cid in seen:
            raise ConfigurationError(
                f"{parameter}[{index}]: custom_id {cid!r} repeats an earlier item's; results are matched by "
                f"custom_id, so each must be unique (fix the {custom_id!r} values upstream, or use custom_id='index')."
            )
        seen.add(cid)
        body.setdefault("model", model)
        for key, value in defaults.items():
            if body.get(key) is None:
                body[key] = value
        line = encode({"custom_id": cid, "method": "POST", "url": url, "body": body}) + b"\n"
        size += len(line)
        if size > MAX_REQUESTS_BYTES:
            raise ConfigurationError(
                _too_big(parameter, f"more than {MAX_REQUESTS_BYTES // (1024 * 1024)} MiB of requests")
            )
        lines.append(line)
    return b"".join(lines)


def batch_file_name(data: bytes) -> str:
    """A name for a batch file made from requests: its content's SHA-256 (16 hex digits), so a retry writes the same object.

    :param data: the batch file's bytes.
    """
    return f"{hashlib.sha256(data).hexdigest()[:16]}.jsonl"


def check_requests_options(url: str, custom_id: str, default_body: Mapping[str, Any] | None) -> None:
    """Check the arguments that shape the batch file, at DAG parse time where they are plain values.

    :raises ConfigurationError: naming the parameter.
    """
    if not isinstance(url, str) or not url.startswith("/"):
        raise ConfigurationError(
            f"requests_url must be an endpoint path such as '/v1/chat/completions', got {url!r}."
        )
    if not isinstance(custom_id, str) or not custom_id:
        raise ConfigurationError(
            f"requests_custom_id must be 'index' or the key of each item that holds its custom_id, got {custom_id!r}."
        )
    if isinstance(default_body, Mapping) and _RESERVED_DEFAULTS.intersection(default_body):
        raise ConfigurationError(
            f"default_body may not set {sorted(_RESERVED_DEFAULTS.intersection(default_body))}."
        )


def _as_list(requests: Any, parameter: str) -> list[Any]:
    if isinstance(requests, (str, bytes, Mapping)) or not isinstance(requests, Iterable):
        raise ConfigurationError(
            f"{parameter} must be a list (of prompts, chat message lists or request bodies), got "
            f"{type(requests).__name__}. Return a list from the upstream task."
        )
    return list(requests)


def _request_of(
    item: Any, index: int, *, url: str, custom_id: str, parameter: str
) -> tuple[str, dict[str, Any]]:
    """Return ``(custom_id, body)`` of one item."""
    where = f"{parameter}[{index}]"
    if isinstance(item, Mapping):
        body = dict(item)
    elif isinstance(item, str):
        if url == "/v1/chat/completions":
            body = {"messages": [{"role": "user", "content": item}]}
        elif url == "/v1/embeddings":
            body = {"input": item}
        elif url == "/v1/completions":
            body = {"prompt": item}
        else:
            raise ConfigurationError(
                f"{where} is a string, but {url} needs a request body: give an object with its fields."
            )
    elif (
        isinstance(item, Sequence)
        and item
        and all(isinstance(m, Mapping) for m in item)
        and any("role" in m for m in item)
    ):
        # Messages have a role; a list of objects none of which has one is a list of bodies (a mapped upstream's).
        if url not in ("/v1/chat/completions", "/v1/embeddings"):
            raise ConfigurationError(
                f"{where} is a list of messages, but {url} needs a request body: give an object."
            )
        body = {"messages": [dict(m) for m in item]}
    else:
        # A list of prompts or bodies as one item is what a mapped upstream task gives: one list per map index.
        mapped = (
            " If requests comes from a mapped task (a list per map index), flatten it in a task first: "
            "[r for part in parts for r in part]."
            if isinstance(item, Sequence) and not isinstance(item, (str, bytes)) and item
            else ""
        )
        raise ConfigurationError(
            f"{where} is {type(item).__name__} {_short(item)}: each item must be a prompt (string), a list of chat "
            "messages ({'role': ..., 'content': ...}) or a request body (object)." + mapped
        )
    if custom_id == INDEX:
        return f"request-{index}", body
    if not isinstance(item, Mapping):
        raise ConfigurationError(
            f"{where} is not an object, so it has no {custom_id!r} key for its custom_id: give objects, or use custom_id='index'."
        )
    cid = body.pop(custom_id, None)
    if isinstance(cid, int) and not isinstance(cid, bool):
        cid = str(cid)
    if not isinstance(cid, str) or not cid:
        raise ConfigurationError(f"{where} has no non-empty {custom_id!r} (its custom_id): got {cid!r}.")
    return cid, body


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _too_big(parameter: str, what: str) -> str:
    return (
        f"{parameter} holds {what}: too much for XCom, which lives in Airflow's metadata database (limits: "
        f"{MAX_REQUESTS:,} requests, {MAX_REQUESTS_BYTES // (1024 * 1024)} MiB). Write the batch file to S3 in the "
        "upstream task and pass its URI as input_uri instead."
    )
