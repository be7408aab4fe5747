"""The manifest: what one published batch output holds, written beside it last.

``VLLMBatchOperator`` returns it (XCom), writes it to ``<output stem>.manifest.json``
after the results and the error file, and trusts it on a later try only when its
``fingerprint`` equals the new run's (see :mod:`airflow_vllm_batch.identity`).
``VLLMBatchMergeOperator`` writes the same shape for a sharded batch, with the shard
fields filled in; the CLI reads it. No field ever holds a credential: ``input_uri`` is
stored redacted (no query string) when it is an http(s) URL.
"""

from __future__ import annotations

from typing import Any

import msgspec


class RequestCounts(msgspec.Struct):
    """How many requests the batch held, and how they ended."""

    total: int = 0
    completed: int = 0
    failed: int = 0


class Usage(msgspec.Struct):
    """Tokens the engine reported over all completed requests."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Cost(msgspec.Struct, omit_defaults=True):
    """What the run's engine time was, and what it cost (see :mod:`airflow_vllm_batch.run.cost`).

    :param device: ``"gpu"`` (an engine this task started on leased GPUs), ``"cpu"`` (no GPU),
        or ``"vllm_connection"`` (a warm server, possibly shared with other tasks).
    :param engine_s: seconds counted: the engine's time in this try; a connection's, the task's wall time.
    :param gpus: GPUs leased for the engine (``None`` for a connection: not the task's to know).
    :param gpu_s: engine GPU-seconds, ``gpus × engine_s`` (``"gpu"`` only).
    :param tokens_per_gpu_s: total tokens per GPU-second (``"gpu"`` only).
    :param tokens_per_engine_s: total tokens per engine-second (``"cpu"``, ``"vllm_connection"``).
    :param gpu_hour_cost: the engine options' ``gpu_hour_cost``, when given.
    :param cost: the run's cost at that price, when given.
    :param note: how to read the figures when they are not GPU-seconds.
    """

    device: str
    engine_s: float = 0.0
    gpus: int | None = None
    gpu_s: float | None = None
    tokens_per_gpu_s: float | None = None
    tokens_per_engine_s: float | None = None
    gpu_hour_cost: float | None = None
    cost: float | None = None
    note: str | None = None


class Manifest(msgspec.Struct, omit_defaults=True):
    """One published batch output.

    :param output_uri: the results (successful requests).
    :param error_uri: the failed requests, or None when none failed.
    :param input_uri: the input, redacted.
    :param model: the ``model`` argument.
    :param request_counts: total, completed and failed requests.
    :param usage: prompt, completion and total tokens.
    :param duration_s: the task's time from start to publish.
    :param vllm_version: the engine's vLLM version, when known.
    :param fingerprint: the run identity this output was made under.
    :param manifest_uri: where this manifest is stored.
    :param input_etag: the input's pinned ETag (or local fingerprint), when there is one.
    :param engine_duration_s: the engine's own time.
    :param identity: the parts of the run identity, to tell a later run what changed.
    :param per_model: requests, completed, failed and tokens per model name: an adapter's
        name, or the base model's first served name (see
        :mod:`airflow_vllm_batch.batchfile.per_model`).
    :param failed_by_reason: failed requests counted by reason (the error file's ``error.code``:
        ``invalid_request``, ``engine_error``, ``timeout``, ...; see :mod:`airflow_vllm_batch.summary`);
        omitted when none failed.
    :param cost: engine GPU-seconds (or engine-seconds), tokens per GPU-second and, with
        ``gpu_hour_cost``, the run's cost; ``per_model`` then holds each model's ``cost`` too.
        Absent in manifests written before it existed.
    :param invalid_output: answers that did not fit ``output_type`` (in the error file with
        ``error.code`` ``"invalid_output"``, counted in ``request_counts.failed``); omitted when none.
    :param from_cache: requests answered from the answer cache (counted as completed in
        ``request_counts``); absent when the run used no cache.
    :param output_etag: the ETag the results got when this manifest's run published them: an
        output whose results have another ETag is not this manifest's (absent in older manifests).
    :param error_etag: the same for the error file, when there is one.
    :param status: how the batch ended when it did not run to its end: ``"expired"`` (its deadline
        passed) or ``"cancelled"``; the answers finished by then are published, every other request
        is in the error file as ``batch_expired`` / ``batch_cancelled``. Absent for a batch run to its end.
    :param shards: (merge only) how many shards were merged; the other shard fields too.
    """

    output_uri: str
    error_uri: str | None
    input_uri: str | None
    model: str | None
    request_counts: RequestCounts
    usage: Usage
    duration_s: float
    vllm_version: str | None
    fingerprint: str | None
    manifest_uri: str
    input_etag: str | None = None
    engine_duration_s: float = 0.0
    identity: dict[str, Any] | None = None
    # int counts, and a float "cost" when the run was priced.
    per_model: dict[str, dict[str, int | float]] | None = None
    failed_by_reason: dict[str, int] | None = None
    shards: int | None = None
    shard_duration_s: float | None = None
    max_shard_duration_s: float | None = None
    merge_duration_s: float | None = None
    shard_manifest_uris: list[str | None] | None = None
    cost: Cost | None = None
    invalid_output: int | None = None
    from_cache: int | None = None
    output_etag: str | None = None
    error_etag: str | None = None
    status: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The manifest as plain JSON types, what goes to XCom (fields left at their default are omitted)."""
        return msgspec.to_builtins(self)

    def to_json(self) -> bytes:
        """The manifest as stored beside the output."""
        return msgspec.json.format(msgspec.json.encode(self), indent=2)

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Read a stored manifest.

        :raises msgspec.ValidationError: when ``data`` is not a manifest of this shape.
        """
        return msgspec.json.decode(data, type=cls)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Read a manifest from XCom (plain JSON types)."""
        return msgspec.convert(data, type=cls)


class Tombstone(msgspec.Struct, omit_defaults=True):
    """What the manifest key holds while one try publishes: "not complete" to every reader.

    :meth:`airflow_vllm_batch.storage.publishing.OutputStore.publish` writes it first (conditionally on
    the manifest the try read before its first lease check) and replaces it with the manifest
    last (``If-Match`` its own tombstone), so a successor's publish, which replaces the
    tombstone, makes a paused predecessor's manifest write fail (invariant *Fencing*). It
    has none of a manifest's fields but ``output_uri``, so no reader takes it for one.

    :param tombstone: this publish's own random id: every tombstone's bytes (and ETag) are
        unique, so a write whose answer was lost is known by the ETag it left.
    :param output_uri: the output being published.
    :param fingerprint: the run identity of the try publishing.
    :param note: what a person reading the object should know.
    """

    tombstone: str
    output_uri: str
    fingerprint: str | None = None
    note: str = (
        "A try of this output is publishing it, or was stopped while it did: the output is not complete. "
        "The manifest replaces this object once the results and the error file are written."
    )

    def to_json(self) -> bytes:
        """The tombstone as stored at the manifest key."""
        return msgspec.json.format(msgspec.json.encode(self), indent=2)


def is_tombstone(data: Any) -> bool:
    """Whether a manifest key's content (JSON bytes, or the object decoded from them) is a :class:`Tombstone`."""
    if isinstance(data, (bytes, str)):
        try:
            data = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return False
    return isinstance(data, dict) and "tombstone" in data and "request_counts" not in data
