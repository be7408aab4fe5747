"""Requests and token usage per model name, for a batch whose lines use several names.

One engine may answer to several names (``--served-model-name`` values, LoRA adapters of
``--lora-modules``), and one batch file may mix them. vLLM names, in each response's
``model``, the adapter that answered, or the base model's *first* served name (whatever
alias the request used). The counts here follow the same rule, so that requests and
tokens land on the same key: an adapter's name, or the base model's first name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from airflow_vllm_batch.batchfile.models import Usage


# Only `model` and `usage` are read here; the results check decodes the rest (models.ResultLine).
class _Body(msgspec.Struct, gc=False):
    model: str | None = None
    usage: Usage | None = None


class _Response(msgspec.Struct, gc=False):
    body: _Body | None = None
    # The older result shape: the completion itself.
    model: str | None = None
    usage: Usage | None = None


class _Result(msgspec.Struct, gc=False):
    response: _Response | None = None


_decode = msgspec.json.Decoder(_Result).decode

_FIELDS = ("requests", "completed", "failed", "prompt_tokens", "completion_tokens", "total_tokens")


def engine_name(name: str, aliases: Mapping[str, str]) -> str:
    """The name vLLM reports for a request that named ``name``: its alias target, else itself.

    :param name: a request's ``body.model``.
    :param aliases: base model name -> the base model's first name.
    """
    return aliases.get(name, name)


def count_per_model(
    successes: Iterable[bytes],
    requests_per_model: Mapping[str, int],
    *,
    default_name: str,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, dict[str, int]]:
    """
    Return ``{name: {"requests", "completed", "failed", "prompt_tokens", "completion_tokens", "total_tokens"}}``.

    :param successes: the successful result lines (the published results file).
    :param requests_per_model: valid requests per ``body.model``, from preflight
        (:attr:`~airflow_vllm_batch.batchfile.PreflightReport.requests_per_model`).
    :param default_name: the base model's first name: where a response that names no
        model is counted.
    :param aliases: the base model's other names -> ``default_name``; requests that use
        an alias are counted under ``default_name``, as vLLM reports them. Default none.
    """
    aliases = aliases or {}
    stats: dict[str, dict[str, int]] = {}

    def entry(name: str) -> dict[str, int]:
        if name not in stats:
            stats[name] = dict.fromkeys(_FIELDS, 0)
        return stats[name]

    for name, count in requests_per_model.items():
        entry(engine_name(name, aliases))["requests"] += count
    for raw in successes:
        if not raw.strip():
            continue
        response = _decode(raw).response
        body = response.body if response is not None and response.body is not None else response
        model = getattr(body, "model", None) or default_name
        usage = getattr(body, "usage", None)
        counts = entry(engine_name(model, aliases))
        counts["completed"] += 1
        if usage is not None:
            counts["prompt_tokens"] += usage.prompt_tokens or 0
            counts["completion_tokens"] += usage.completion_tokens or 0
            counts["total_tokens"] += usage.total_tokens or 0
    for counts in stats.values():
        counts["failed"] = max(counts["requests"] - counts["completed"], 0)
    return stats
