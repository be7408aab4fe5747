"""The manifest: what one published batch output holds, written beside it last.

``VLLMBatchOperator`` returns it (XCom), writes it to ``<output stem>.manifest.json``
after the results and the error file, and trusts it on a later try only when its
``fingerprint`` equals the new run's (see :mod:`airflow_vllm_batch.identity`).
``VLLMBatchMergeOperator`` writes the same shape for a sharded batch, with the shard
fields filled in; the CLI reads it. No field ever holds a credential: ``input_uri`` is
stored redacted (no query string) when it is an http(s) URL.

Every manifest written says its ``schema_version`` (:data:`MANIFEST_SCHEMA_VERSION`); one
written before the field existed has none and reads as version 1. Every reader of manifests
calls :func:`schema_version` (or :meth:`Manifest.from_json` / :meth:`Manifest.from_dict`,
which do), so a manifest of a newer airflow-vllm-batch is refused rather than misread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from airflow_vllm_batch.exceptions import ManifestVersionError

#: The manifest schema this package writes, and the newest it reads. Raise it when a change
#: would mislead an older reader (a field whose meaning changes, or one it must not ignore).
MANIFEST_SCHEMA_VERSION = 1


def schema_version(manifest: Mapping[str, Any], source: str = "the manifest") -> int:
    """The schema version of a manifest (decoded JSON): 1 when it has none (written before the field existed).

    :param manifest: the manifest, as plain JSON types (XCom, or its object decoded).
    :param source: where it was read, for the message (its URI, or the shard it belongs to).
    :raises ManifestVersionError: the version is newer than :data:`MANIFEST_SCHEMA_VERSION`, or not a version.
    """
    version = manifest.get("schema_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ManifestVersionError(
            f"{source} has schema_version {version!r}, which is not a manifest schema version. "
            "Read a manifest written by airflow-vllm-batch, or run the batch again to publish a new one."
        )
    if version > MANIFEST_SCHEMA_VERSION:
        raise ManifestVersionError(
            f"{source} has schema_version {version}, newer than this airflow-vllm-batch reads "
            f"({MANIFEST_SCHEMA_VERSION}). Upgrade airflow-vllm-batch where it is read (the workers, the API server)."
        )
    return version


class _Versioned(msgspec.Struct):
    """A stored manifest's version alone (every other field is ignored), read before the manifest itself."""

    schema_version: Any = 1


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
    :param schema_version: the manifest schema it was written in (:data:`MANIFEST_SCHEMA_VERSION`);
        always written, and 1 when read from a manifest written before the field existed.
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
    schema_version: int = MANIFEST_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The manifest as plain JSON types, what goes to XCom (fields left at their default are omitted, but
        ``schema_version``, which is always there)."""
        data: dict[str, Any] = msgspec.to_builtins(self)
        return {"schema_version": self.schema_version, **data}

    def to_json(self) -> bytes:
        """The manifest as stored beside the output."""
        return msgspec.json.format(msgspec.json.encode(self.to_dict()), indent=2)

    @classmethod
    def from_json(cls, data: bytes | str, source: str = "the manifest") -> Manifest:
        """Read a stored manifest.

        :param source: where it was read, for the message.
        :raises ManifestVersionError: it was written in a newer schema than this package reads.
        :raises msgspec.ValidationError: when ``data`` is not a manifest of this shape.
        """
        schema_version({"schema_version": msgspec.json.decode(data, type=_Versioned).schema_version}, source)
        return msgspec.json.decode(data, type=cls)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "the manifest") -> Manifest:
        """Read a manifest from XCom (plain JSON types).

        :param source: where it was read, for the message.
        :raises ManifestVersionError: it was written in a newer schema than this package reads.
        """
        schema_version(data, source)
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
