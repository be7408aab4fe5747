"""The keys of the answer cache: what shapes a request's answer, as one digest.

A request's key is a BLAKE2b digest of the *model identity* (see :func:`model_identity`),
the line's ``url`` and its ``body`` in canonical JSON (keys sorted at every level, no
whitespace: ``msgspec.json.encode(body, order="sorted")``), so key order and spacing in
the input do not matter, while any change to a message, a sampling field or the
``model`` the body names (a served name, a LoRA adapter) is another key.

Only requests whose answer is determined by that key are cached (:func:`cacheable`):
generation with ``temperature`` 0 or an integer ``seed``; embeddings, score and rerank
always. A request that samples is cached only when the user opts in (``sampled=True``);
an endpoint of another kind (audio, whose ``file_url`` may change behind the same URL)
never is.

Plain Python (msgspec, hashlib): no Airflow, no S3.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from airflow_vllm_batch.batchfile.models import endpoint_kind

#: Generation endpoints whose body holds the whole request. Audio is left out: its ``file_url``
#: may name other content tomorrow under the same URL.
TEXT_GENERATION_URLS = frozenset({"/v1/chat/completions", "/v1/completions"})

#: Hex digits of a key (a 128-bit digest).
KEY_HEX = 32

#: Engine options (they take a value) left out of the model identity. They decide how
#: requests are scheduled, served or logged, not what the model computes for one of them:
#:
#: * ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--max-num-partial-prefills``,
#:   ``--long-prefill-token-threshold``, ``--scheduling-policy``: which requests share a
#:   step (and vLLM 0.33's runner ``--max-inflight``: how many it queues). Batch
#:   composition can move low-order bits of the logits (vLLM is not batch-invariant by
#:   default), but so does running the same request twice in another
#:   batch: a cached answer is one the same model gave, as a fresh one would be.
#: * ``--gpu-memory-utilization``, ``--kv-cache-memory``, ``--swap-space``,
#:   ``--cpu-offload-gb``, ``--max-parallel-loading-workers``, ``--download-dir``: where
#:   weights and KV cache live, or how they are loaded; the same weights compute the same.
#: * ``--pipeline-parallel-size``, ``--data-parallel-size``, ``--api-server-count``:
#:   pipeline stages run the same layers in order; data parallel and API servers are
#:   replicas. (``--tensor-parallel-size`` stays in: it changes the reductions' order.)
#: * ``--host``, ``--port``, ``--api-key``, ``--uvicorn-log-level``, ``--max-log-len``:
#:   serving and logging only.
SCHEDULING_OPTIONS = frozenset(
    {
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-num-partial-prefills",
        "--long-prefill-token-threshold",
        "--scheduling-policy",
        "--max-inflight",
        "--gpu-memory-utilization",
        "--kv-cache-memory",
        "--swap-space",
        "--cpu-offload-gb",
        "--max-parallel-loading-workers",
        "--download-dir",
        "--pipeline-parallel-size",
        "-pp",
        "--data-parallel-size",
        "-dp",
        "--api-server-count",
        "--host",
        "--port",
        "--api-key",
        "--uvicorn-log-level",
        "--max-log-len",
    }
)
#: Engine switches (no value) left out of the model identity, for the same reasons: logging
#: and statistics only, and prefix caching (it reuses KV blocks the same model computed).
SCHEDULING_SWITCHES = frozenset(
    {
        "--disable-log-requests",
        "--enable-log-requests",
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        # vLLM 0.33 gives every --enable-x a --disable-x (and a --disable-x an --enable-x).
        "--disable-prefix-caching",
        "--no-enable-log-requests",
        "--enable-uvicorn-access-log",
        "--no-disable-uvicorn-access-log",
    }
)


def output_args(engine_args: Sequence[str]) -> list[str]:
    """``engine_args`` without the scheduling, serving and logging flags (which cannot change an answer).

    :param engine_args: the engine arguments, as the operator got them (``--flag value`` or ``--flag=value``).
    """
    kept: list[str] = []
    skip_value = False
    for arg in engine_args:
        if skip_value:
            skip_value = False
            if not arg.startswith("-"):
                continue
        flag = _normal(arg.split("=", 1)[0]) if arg.startswith("-") else None
        if flag in SCHEDULING_SWITCHES:
            continue
        if flag in SCHEDULING_OPTIONS:
            skip_value = "=" not in arg
            continue
        kept.append(arg)
    return kept


def _normal(flag: str) -> str:
    # vLLM's parser takes --max_num_seqs for --max-num-seqs.
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def model_identity(
    *,
    model: str,
    vllm_version: str | None,
    engine_args: Sequence[str] | None,
    engine_command: Sequence[str] | None = None,
    served_names: Sequence[str] = (),
    reported: Mapping[str, Any] | None = None,
) -> str:
    """The digest (32 hex) of what shapes every answer of an engine: model, vLLM version, output-affecting arguments.

    :param model: the operator's ``model`` (name or directory).
    :param vllm_version: the engine's vLLM version; None when unknown.
    :param engine_args: the engine's arguments (filtered by :func:`output_args` here); None for a
        warm server, whose arguments the task does not know.
    :param engine_command: the command that starts the engine, when not the default.
    :param served_names: the names a warm server answers to (its model and adapters).
    :param reported: what a warm server says about itself that shapes answers (see
        :func:`reported_models`); None when the engine is the task's own. Part of the digest
        only when given, so the keys of the other engines stay as they were.
    """
    parts: dict[str, Any] = {
        "model": model,
        "vllm_version": vllm_version,
        "engine_args": output_args(engine_args) if engine_args is not None else None,
        "engine_command": list(engine_command or ()),
        "served_names": sorted(served_names),
    }
    if reported is not None:
        parts["reported"] = dict(reported)
    return hashlib.blake2b(msgspec.json.encode(parts, order="sorted"), digest_size=KEY_HEX // 2).hexdigest()


#: The fields of a ``/v1/models`` card that shape the answers under its name: the weights' path
#: (``root``: the base model's, or a LoRA adapter's), the adapter's base (``parent``) and the
#: context length (``max_model_len``: a prompt too long for it is refused, ``max_tokens`` capped).
REPORTED_CARD_FIELDS = ("id", "root", "parent", "max_model_len")


def reported_models(cards: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What a warm server's ``/v1/models`` cards say that shapes its answers, in a stable order.

    ``created`` (the listing's time) and ``permission`` are left out: they change on every call.

    :param cards: the listing's ``data``.
    """
    kept = [{name: card.get(name) for name in REPORTED_CARD_FIELDS} for card in cards]
    return sorted(kept, key=lambda card: str(card["id"]))


class _Sampling(msgspec.Struct, gc=False):
    temperature: Any = None
    seed: Any = None


_decode_sampling = msgspec.json.Decoder(_Sampling).decode
_decode_any = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder(order="sorted").encode


def cacheable(url: str, body: bytes | msgspec.Raw, *, sampled: bool = False) -> bool:
    """Whether the answer of a request is determined by its key, so that it may be cached.

    :param url: the line's ``url``.
    :param body: the line's raw ``body`` JSON.
    :param sampled: also cache generation requests that sample (no temperature 0, no seed).
    """
    if endpoint_kind(url) == "pooling":
        return True
    if url not in TEXT_GENERATION_URLS:
        return False
    if sampled:
        return True
    fields = _decode_sampling(body)
    temperature, seed = fields.temperature, fields.seed
    greedy = isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature == 0
    return greedy or (isinstance(seed, int) and not isinstance(seed, bool))


def request_key(model_digest: str, url: str, body: bytes | msgspec.Raw) -> str:
    """The cache key (32 hex) of one request: the model identity, the url and the canonical body.

    :param model_digest: :func:`model_identity`'s digest.
    :param url: the line's ``url``.
    :param body: the line's raw ``body`` JSON (any key order and whitespace).
    """
    digest = hashlib.blake2b(digest_size=KEY_HEX // 2)
    digest.update(model_digest.encode())
    digest.update(b"\0")
    digest.update(url.encode())
    digest.update(b"\0")
    digest.update(_encode(_decode_any(body)))
    return digest.hexdigest()


class _Request(msgspec.Struct, gc=False):
    custom_id: str
    url: str
    body: msgspec.Raw


_decode_request = msgspec.json.Decoder(_Request).decode


def line_key(model_digest: str, line: bytes, *, sampled: bool = False) -> tuple[str, str | None]:
    """``(custom_id, key)`` of a request line that passed preflight; the key is None when the request is not cacheable.

    :param model_digest: :func:`model_identity`'s digest.
    :param line: one request line.
    :param sampled: see :func:`cacheable`.
    """
    request = _decode_request(line)
    if not cacheable(request.url, request.body, sampled=sampled):
        return request.custom_id, None
    return request.custom_id, request_key(model_digest, request.url, request.body)
