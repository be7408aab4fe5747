"""Media URLs in an API batch's chat lines: refused unless their host is allowed (``[vllm_batch] openai_media_domains``).

A chat message's content parts may name media by URL (``image_url``, ``audio_url``,
``video_url``, and vLLM's short forms ``{"image_url": "https://..."}``): the engine fetches
them from the worker's network, so a user could make the workers read an internal address
(a metadata service, a database's admin page) and get what it answered back as the model's
input. The batch task therefore refuses, before any engine starts, a batch one of whose
lines names a media URL that is not a ``data:`` URL or an http(s) URL of a host the
deployment allows, and names those lines in the batch's ``errors``.

It is a pass of its own over the batch's input copy, not a check of preflight's: preflight
tells its problems in the task log, which every viewer reads under the simple auth manager,
and a refused URL's host (an internal address) goes to the batch's owner only, in its
failure record. The pass costs one more streamed read of the copy, and parses only the lines
that name a media key (:func:`media_problems`).

Free of Airflow imports but the configuration read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

#: The option that lists the allowed hosts.
OPTION = "openai_media_domains"
#: How many refused lines a batch's ``errors`` lists (all are counted).
MAX_LISTED = 50


def media_domains() -> frozenset[str]:
    """The hosts whose http(s) media URLs API batches may carry: ``[vllm_batch] openai_media_domains``, lower-cased."""
    from airflow_vllm_batch.version_compat import conf

    raw = conf.get("vllm_batch", OPTION, fallback="") or ""
    return frozenset(d.strip().lower().rstrip(".") for d in raw.split(",") if d.strip())


def refused_url(url: str, allowed: frozenset[str]) -> str | None:
    """Why a media URL may not be fetched by the workers, or None when it may.

    A ``data:`` URL carries its media itself and is always accepted; an http(s) URL is
    accepted when its host is one of ``allowed`` (exactly: list every host); anything else
    (another scheme, such as ``file:``, a URL without a host) is refused. The reason names
    the host, never the URL (its path or query may hold a credential).

    :param url: the URL of a content part.
    :param allowed: :func:`media_domains`.
    """
    if url.startswith("data:"):
        return None
    try:
        parts = urlsplit(url.strip())
        host = (parts.hostname or "").rstrip(".")
    except ValueError:
        return "a media URL that cannot be parsed"
    if parts.scheme not in ("http", "https") or not host:
        return f"a media URL of scheme {parts.scheme or 'none'!r} (only data: URLs, and http(s) URLs of allowed hosts)"
    if host not in allowed:
        return (
            f"a media URL of the host {host!r}, which [vllm_batch] {OPTION} does not allow"
            if allowed
            else f"a media URL of the host {host!r}: [vllm_batch] {OPTION} allows no host"
        )
    return None


def media_urls(body: Any) -> Iterable[str]:
    """The media URLs of a request body's chat messages: every URL a content part names but its text."""
    messages = body.get("messages") if isinstance(body, Mapping) else None
    if not isinstance(messages, list):
        return
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            for name, value in part.items():
                if name in ("type", "text"):
                    continue
                if isinstance(value, str) and name.endswith("url"):
                    yield value
                elif isinstance(value, Mapping) and isinstance(value.get("url"), str):
                    yield value["url"]


def media_problems(lines: Iterable[bytes], allowed: frozenset[str]) -> tuple[int, list[dict[str, Any]]]:
    """The lines of a batch input that name a refused media URL: how many, and the first :data:`MAX_LISTED` as ``errors`` entries.

    Only lines that hold ``url"`` twice are parsed: every request line names its endpoint
    (``"url": "/v1/..."``) once, and a media part adds a key that ends so (``image_url``, a
    part's ``url``); inside a JSON string a quote is escaped, so a prompt adds none. A line of
    plain chat is therefore never parsed here. A line that is not JSON is left to preflight,
    which names it.

    :param lines: the input's physical lines, in order.
    :param allowed: :func:`media_domains`.
    """
    count, listed = 0, list[dict[str, Any]]()
    for number, raw in enumerate(lines, start=1):
        if raw.count(b'url"') < 2:
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(line, dict):
            continue
        why = next((w for url in media_urls(line.get("body")) if (w := refused_url(url, allowed))), None)
        if why is None:
            continue
        count += 1
        if len(listed) < MAX_LISTED:
            listed.append(
                {
                    "code": "invalid_request",
                    "line": number,
                    "param": "body.messages",
                    "message": f"This line names {why}: workers do not fetch it. Send the media inline as a "
                    f"data: URL (base64), or ask the deployment to add the host to [vllm_batch] {OPTION}.",
                }
            )
    return count, listed
