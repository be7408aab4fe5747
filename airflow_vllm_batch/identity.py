"""Run identity: one fingerprint of everything that shapes a batch's results.

A retry, a cleared task or a backfill re-run may reuse earlier work (a published output,
results staged in S3, results kept on the worker) only when that work was made under the
same identity. The identity holds:

* the input, pinned: an S3 object's ETag and VersionId; a local file's size, mtime and
  SHA-256; an http(s) URL cannot be pinned, so it never matches an earlier run;
* the model, the vLLM version when known, the engine command and its arguments;
* what preflight does to the lines: ``default_body``, ``rewrite_model``,
  ``invalid_lines``, ``max_lines``, ``max_line_bytes``, explicit ``supported_urls``;
* the error URI (a different error location is a different publication).
* ``output_type``, only when set (so runs without it keep their identities): the
  model's import name and a SHA-256 of its JSON schema.

Not in it, on purpose: where the engine's Python lives (paths differ from worker to
worker, and a retry may land on another), the options' ``env`` (``CUDA_VISIBLE_DEVICES`` and
the like change per worker and do not change results), ``output_mode`` and timeouts.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_vllm_batch.batchfile import redact_url


@dataclass(frozen=True)
class PinnedInput:
    """The exact input a run reads.

    :param uri: the input as the user gave it; may hold a credential (http(s) query).
    :param etag: the S3 ETag (unquoted), or a local file's ``size-mtime-sha256``.
    :param version_id: the S3 VersionId, when the bucket is versioned.
    :param size: bytes, when known.
    """

    uri: str
    etag: str | None = None
    version_id: str | None = None
    size: int | None = None

    @property
    def display_uri(self) -> str:
        """The URI safe to log and store: http(s) URLs without credentials or query string."""
        if self.uri.startswith(("http://", "https://")):
            return redact_url(self.uri)
        return self.uri

    @property
    def pinned(self) -> bool:
        """Whether the content is pinned (an http(s) URL is not)."""
        return self.etag is not None or self.version_id is not None

    def components(self) -> dict[str, Any]:
        """The input's part of the run identity.

        An unpinned input gets a random nonce, so no two of its runs share an identity.
        """
        parts: dict[str, Any] = {"uri": self.display_uri, "etag": self.etag, "version_id": self.version_id}
        if not self.pinned:
            parts["unpinned"] = uuid.uuid4().hex
        return parts


def local_file_tag(path: str, chunk_size: int = 1 << 20) -> str:
    """Return ``size-mtime_ns-sha256`` of a local file: what pins it for the run identity."""
    stat = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return f"{stat.st_size}-{stat.st_mtime_ns}-{digest.hexdigest()}"


@dataclass(frozen=True)
class RunIdentity:
    """The identity of one batch run: its parts and their fingerprint.

    :param components: what shapes the results (JSON types), see the module docstring.
    """

    components: Mapping[str, Any]

    @property
    def fingerprint(self) -> str:
        """SHA-256 (hex) of the components, in canonical JSON."""
        canonical = json.dumps(self.components, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def short(self) -> str:
        """The first 16 hex digits: names this run's staging prefix and local scratch."""
        return self.fingerprint[:16]

    def changes_from(self, earlier: Mapping[str, Any] | None) -> list[str]:
        """Name the parts that differ from an earlier run's components (dotted, sorted).

        :param earlier: the components stored in an earlier manifest; None when it had none.
        """
        if earlier is None:
            return ["(the earlier output records no run identity)"]
        now, then = _flatten(self.components), _flatten(earlier)
        return sorted(key for key in now.keys() | then.keys() if now.get(key) != then.get(key))


def _flatten(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, Mapping) and item and name != "default_body":
            flat.update(_flatten(item, f"{name}."))
        else:
            flat[name] = json.dumps(item, sort_keys=True, default=str)
    return flat
