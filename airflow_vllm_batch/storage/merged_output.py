"""The merged output of a sharded batch in S3: what makes one merge, and its store.

:class:`~airflow_vllm_batch.operators.shards.VLLMBatchMergeOperator` publishes the shards'
merged files through :class:`MergedOutputStore`, an :class:`~airflow_vllm_batch.storage.publishing.OutputStore`
that also knows when the output already is this very merge, complete (the same shard runs
and the same shard manifests), so a retry or a zombie try of the merge writes nothing over
it (docs/protocol.md, the merge of shards under "The steps of one try").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from airflow_vllm_batch.exceptions import OutputBusyError
from airflow_vllm_batch.storage.publishing import OutputStore
from airflow_vllm_batch.storage.s3 import error_code

if TYPE_CHECKING:
    from airflow_vllm_batch.manifest import Manifest


def merged_fingerprint(manifests: Sequence[dict[str, Any]]) -> str:
    """The merged output's fingerprint: a hash of the shards' fingerprints, in shard order."""
    return hashlib.sha256("\n".join(m.get("fingerprint") or "" for m in manifests).encode()).hexdigest()


@dataclass(frozen=True)
class MergeIdentity:
    """What one merge is: the merged output of these shard runs and these shard files, in this order.

    :param fingerprint: :func:`merged_fingerprint` (the manifest's ``fingerprint``).
    :param shards: :func:`~airflow_vllm_batch.sharding.merged_shards_key` (the manifest's
        ``identity["merged_shards"]``).
    """

    fingerprint: str
    shards: str


class AlreadyMerged(Exception):
    """The manifest a merge's publish pinned is a complete merge of its very shard files: nothing is written."""

    def __init__(self, manifest: Manifest, why: str) -> None:
        super().__init__(why)
        self.manifest = manifest
        self.why = why


class MergedOutputStore(OutputStore):
    """The merged output's :class:`OutputStore`, which knows when the output is already this merge's, complete.

    The core's ``VLLMBatchOperator`` checks for a complete output of its run before and again
    after taking the lease. A merge does the same (:meth:`completed_merge`), and the second
    check reads the very manifest its publish pinned for the tombstone (``If-Match`` the ETag the
    publish read, in :meth:`mark_publishing`): a try that finds this merge complete there
    writes nothing, not even its tombstone. A check on a separate read would let a try see "not
    complete", then pin a complete manifest another try of this merge landed meanwhile, and
    bury it under its tombstone.

    :param merge: what this merge is; set by the operator before it publishes. None: no check.
    """

    merge: MergeIdentity | None = None

    def completed_merge(self) -> tuple[Manifest | None, str]:
        """Return the manifest beside the output if it is a complete merge of these very shard files.

        :return: the manifest (or None) and one line that says why it was (not) taken.
        """
        return self._complete_merge(self._manifest_body())

    def mark_publishing(self, seen: str | None, fingerprint: str | None = None) -> str:
        """Write the tombstone over ``seen``, unless ``seen`` is this very merge, complete.

        :raises AlreadyMerged: the pinned manifest, or the one that replaced it since while this try still
            holds the lease, is a complete merge of these shard manifests; nothing was written.
        :raises OutputBusyError: the lease was lost, or the manifest changed since ``seen`` was read into
            anything but this merge, complete: another try publishes.
        """
        if self.merge is None:
            return super().mark_publishing(seen, fingerprint)
        try:
            if seen is not None:
                manifest, why = self._complete_merge(self._manifest_body_at(seen))
                if manifest is not None:
                    raise AlreadyMerged(manifest, why)
            return super().mark_publishing(seen, fingerprint)
        except OutputBusyError:
            # Nothing of this try is written yet. While it still holds the lease, a manifest that changed
            # since ``seen`` is a paused earlier try's, which landed after its last fence: when that is this
            # merge, complete, it is this try's result too (or a last try would fail over a finished merge).
            self._fence()
            manifest, why = self.completed_merge()
            if manifest is None:
                raise
            raise AlreadyMerged(manifest, why) from None

    def _manifest_body_at(self, etag: str) -> bytes:
        """What the manifest key holds while it still has ``etag``: the content the tombstone would replace."""
        try:
            body: bytes = (
                self.hook.get_conn()
                .get_object(Bucket=self.manifest_bucket, Key=self.manifest_key, IfMatch=f'"{etag}"')["Body"]
                .read()
            )
            return body
        except ClientError as err:
            if error_code(err) in _CHANGED_CODES:
                # Replaced or removed since the publish read it: the tombstone's If-Match would fail alike.
                raise self._changed_meanwhile(self.manifest_uri) from None
            raise

    def _complete_merge(self, data: bytes | None) -> tuple[Manifest | None, str]:
        """Whether the manifest key's content ``data`` is this merge's manifest, with its files as it names them."""
        assert self.merge is not None
        manifest, why = self.published_manifest(data)
        if manifest is None:
            return None, why
        if manifest.fingerprint != self.merge.fingerprint:
            return None, f"the output at {self.output_uri} was merged from other shard runs"
        if (manifest.identity or {}).get("merged_shards") != self.merge.shards:
            return None, (
                f"the output at {self.output_uri} was merged from other shard manifests (a shard published again, "
                "or an older merge that did not record them)"
            )
        if changed := self.files_changed(manifest):
            return None, changed
        return (
            manifest,
            f"the output at {self.output_uri} is complete for this very merge (the same shard manifests)",
        )


#: What a GET ``If-Match`` answers when the object changed (412; SeaweedFS may answer 409) or is gone.
_CHANGED_CODES = frozenset(
    {"PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey", "404"}
)
