"""Publishing a batch output in S3: results, error file and manifest, fenced by the output's lease.

Publishing follows one protocol, so that no reader is ever misled (:meth:`OutputStore.publish`):

1. a *tombstone* (:class:`~airflow_vllm_batch.manifest.Tombstone`) takes the old manifest's
   place first: from here until step 4 a reader (or a later resume) sees *no* complete
   output rather than an old manifest beside new data;
2. the results go to the output key; 3. the error file is written, or an old one deleted;
4. the manifest takes the place of this try's own tombstone, last (``If-Match`` its ETag),
   holding the ETags that the results and the error file got in steps 2 and 3; 5. this
   run's staging prefix is removed (and nobody else's: other runs' staging lives under
   other prefixes).

Fencing (the invariant of ``docs/protocol.md``): once a run holds the output's lease
(:meth:`OutputStore.lease`), the lease is read back from S3 right before *every* mutation
under the output: each step above, every checkpoint part, staged results or cleaned input,
and every delete in the staging. A try whose lease another took over stops at its next
mutation and changes nothing more. A check and the write after it are two round trips, and
a try can pause between them (a zombie whose successor took over and published meanwhile),
so publishing does not trust the check alone: it reads the ETags of the manifest, results
and error file *before* its first check, and steps 1-3 are conditional on them
(``If-Match`` on what it saw, ``If-None-Match: *`` where it saw nothing), step 4 on the
try's own tombstone. A successor that changed an object in between makes the paused try's
change of it fail with 412, and the try stops; and since a successor's publish replaces
the tombstone before anything else, a paused try's manifest never lands once its successor
began publishing. The one change no condition can refuse is the creation of an error file
where neither try left one; the manifest names its files and their ETags, so no reader
takes such a file for part of the output. The manifest's ETags also close the gap for
readers: :meth:`OutputStore.completed` takes an output as complete only when its results
and error file still have the ETags its manifest names (anything else is "not complete",
and a retry publishes again), and :func:`~airflow_vllm_batch.storage.answers.read_answers` reads a manifest's files pinned to
them. A conditional write whose response was lost is sent again by botocore and then
fails its own condition; such a 412 is taken as this try's own write when the object now
holds exactly what was written (its MD5 ETag; each tombstone carries a random id, so its
bytes are its publish's alone).

:class:`OutputStore` is used by ``VLLMBatchOperator`` and ``VLLMBatchMergeOperator`` both; where each
object lives is :mod:`~airflow_vllm_batch.storage.layout`'s.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from botocore.exceptions import ClientError

from airflow_vllm_batch.docs_links import doc_ref
from airflow_vllm_batch.exceptions import LocationError, OutputBusyError
from airflow_vllm_batch.lease import LeaseHolder, OutputLease
from airflow_vllm_batch.manifest import Manifest, Tombstone, is_tombstone
from airflow_vllm_batch.storage.layout import default_error_uri, manifest_uri, output_stem
from airflow_vllm_batch.storage.s3 import (
    bare_etag,
    copy_object,
    error_code,
    file_md5,
    head_etag,
    location_message,
    split_s3_uri,
    upload_file,
)
from airflow_vllm_batch.storage.staging import RunStaging

if TYPE_CHECKING:
    from datetime import datetime

    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from airflow_vllm_batch.identity import RunIdentity

log = logging.getLogger(__name__)

#: The codes of a conditional write that found its condition false.
_PRECONDITION_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})


class OutputStore:
    """The S3 objects of one batch output: results, error file, manifest, lease and staging.

    :param hook: the S3 hook.
    :param output_uri: ``s3://bucket/key`` of the results.
    :param error_uri: where failed requests go. Default ``<output stem>.errors.jsonl``.
    :param fence: called right before every mutation under the output; :meth:`lease` sets it
        to the lease's check, so a try that lost the lease changes nothing more.
    """

    def __init__(
        self,
        hook: S3Hook,
        output_uri: str,
        error_uri: str | None = None,
        fence: Callable[[], None] | None = None,
    ) -> None:
        self.hook = hook
        self.fence = fence
        self.output_uri = output_uri
        self.error_uri = error_uri or default_error_uri(output_uri)
        self.manifest_uri = manifest_uri(output_uri)
        self.bucket, self.key = split_s3_uri(output_uri, "output_uri")
        self.error_bucket, self.error_key = split_s3_uri(self.error_uri, "error_uri")
        self.manifest_bucket, self.manifest_key = split_s3_uri(self.manifest_uri, "output_uri")
        #: When the manifest key's object read last was written (S3's ``LastModified``), or None.
        self.manifest_modified: datetime | None = None

    # -- before the run ----------------------------------------------------------------

    def check_writable(self) -> None:
        """Check that the output and error buckets exist and take writes, with a probe object.

        :raises LocationError: naming the parameter, the bucket and what S3 said.
        """
        client = self.hook.get_conn()
        locations = [("output_uri", self.bucket, self.key)]
        if self.error_bucket != self.bucket:  # the usual error file sits beside the output: one probe
            locations.append(("error_uri", self.error_bucket, self.error_key))
        for parameter, bucket, key in locations:
            probe = f"{key}.probe-{uuid.uuid4().hex[:8]}"
            try:
                # HEAD first: some stores (SeaweedFS) create a missing bucket on PUT.
                client.head_bucket(Bucket=bucket)
                client.put_object(Bucket=bucket, Key=probe, Body=b"")
                client.delete_object(Bucket=bucket, Key=probe)
            except ClientError as err:
                raise LocationError(location_message(parameter, bucket, err, self.hook.aws_conn_id)) from None

    def read_manifest(self) -> Manifest | None:
        """The manifest beside the output, or None when there is none (or a publish's tombstone, or it is unreadable)."""
        return _decode_manifest(self._manifest_body(), self.manifest_uri)

    def _manifest_body(self) -> bytes | None:
        """What the manifest key holds (a manifest, or a publish's tombstone), or None when nothing."""
        try:
            found = self.hook.get_conn().get_object(Bucket=self.manifest_bucket, Key=self.manifest_key)
            body: bytes = found["Body"].read()
            self.manifest_modified = found.get("LastModified")
            return body
        except ClientError as err:
            code = error_code(err)
            if code in ("NoSuchKey", "404"):
                return None
            if code in ("NoSuchBucket", "AccessDenied", "403"):
                raise LocationError(
                    location_message("output_uri", self.manifest_bucket, err, self.hook.aws_conn_id)
                ) from None
            raise

    def completed(self, identity: RunIdentity) -> tuple[Manifest | None, str]:
        """Return the published manifest of a run with this identity, if its files are all there.

        :return: the manifest (or None) and one line that says why it was (not) taken.
        """
        manifest, why = self.published_manifest(self._manifest_body())
        if manifest is None:
            return None, why
        if manifest.fingerprint != identity.fingerprint:
            changed = ", ".join(identity.changes_from(manifest.identity)) or "the fingerprint"
            return None, f"the output at {self.output_uri} was made by a different run (changed: {changed})"
        if overwritten := self.files_changed(manifest):
            return None, overwritten
        return manifest, f"the output at {self.output_uri} is complete for this very run"

    def published_manifest(self, data: bytes | None) -> tuple[Manifest | None, str]:
        """The manifest key's content ``data`` as a published manifest; else None and one line that says why.

        :param data: what the manifest key holds (None: nothing).
        """
        if data is not None and is_tombstone(data):
            return None, (
                f"the output at {self.output_uri} is not complete: a try began publishing it and has not finished "
                "(it still publishes, or it was stopped)"
            )
        manifest = _decode_manifest(data, self.manifest_uri)
        if manifest is None:
            return None, f"no complete output at {self.output_uri} yet"
        return manifest, ""

    def ended(self, input_etag: str | None) -> tuple[Manifest | None, str]:
        """The published manifest of a write-once output of this input, whatever run identity wrote it.

        A write-once output (an OpenAI API batch) has ended once a manifest pinning its input is
        published: a later run of it, under any identity (another vLLM, other engine flags, past its
        window), returns that manifest and writes nothing. A file the manifest names that its owner
        deleted since does not undo the ending; one overwritten since (a writer that lost the lease,
        see the module docstring) does, and a run publishes the output again as any run would.

        :param input_etag: the ETag of the input the output answers (None: an input that cannot be pinned, never ended).
        :return: the manifest (or None) and one line that says why it was (not) taken.
        """
        manifest, why = self.published_manifest(self._manifest_body())
        if manifest is None:
            return None, why
        if (
            input_etag is None
            or manifest.input_etag is None
            or bare_etag(manifest.input_etag) != bare_etag(input_etag)
        ):
            return None, f"the output at {self.output_uri} answers another input (ETag {manifest.input_etag})"
        if overwritten := self.files_changed(manifest, gone_ok=True):
            return None, overwritten
        return manifest, f"the output at {self.output_uri} was published, and a published batch never changes"

    def files_changed(self, manifest: Manifest, gone_ok: bool = False) -> str | None:
        """Why the files ``manifest`` names are not the ones it published (gone, overwritten); None when they are.

        :param manifest: a published manifest of this output.
        :param gone_ok: a file that is gone is no change (only an overwritten one is).
        """
        for uri, published in (
            (manifest.output_uri, manifest.output_etag),
            (manifest.error_uri, manifest.error_etag),
        ):
            if not uri:
                continue
            bucket, key = split_s3_uri(uri, "output_uri")
            etag = head_etag(self.hook.get_conn(), bucket, key)
            if etag is None:
                if gone_ok:
                    continue
                return f"the manifest names {uri}, which is gone"
            if published is not None and etag != bare_etag(published):
                # A writer that lost the lease landed a write after its last check (see the module docstring).
                return f"{uri} was overwritten after its manifest was written (ETag {etag}, published {published})"
        return None

    def lease(self, holder: LeaseHolder, **kwargs: Any) -> OutputLease:
        """The lease of this output (a context manager); see :mod:`airflow_vllm_batch.lease`.

        From here on every mutation under the output (and its staging) checks the lease first.
        """
        lease = OutputLease(
            self.hook.get_conn(), self.bucket, f"{output_stem(self.key)}.lease.json", holder, **kwargs
        )
        self.fence = functools.partial(lease.ensure_held, verify=True)
        return lease

    def staging(self, identity: RunIdentity) -> RunStaging:
        """The staging prefix of the run with this identity (fenced as the output is)."""
        return RunStaging(self.hook, self.bucket, f"{self.key}.staging/{identity.short}/", fence=self._fence)

    def other_stagings(self, identity: RunIdentity) -> list[RunStaging]:
        """The staging prefixes of this output's other run identities (earlier tries' under another vLLM, say), fenced."""
        root = f"{self.key}.staging/"
        keys = self.hook.list_keys(bucket_name=self.bucket, prefix=root) or []
        shorts = sorted({key[len(root) :].split("/", 1)[0] for key in keys if "/" in key[len(root) :]})
        return [
            RunStaging(self.hook, self.bucket, f"{root}{short}/", fence=self._fence)
            for short in shorts
            if short != identity.short
        ]

    def _fence(self) -> None:
        if self.fence is not None:
            self.fence()

    def _fenced(self) -> Any:
        """The S3 client, once the fence let this mutation through."""
        self._fence()
        return self.hook.get_conn()

    # -- publishing --------------------------------------------------------------------

    def publish(
        self,
        manifest: Manifest,
        *,
        staging: RunStaging | None = None,
        results_path: Path | None = None,
        errors_path: Path | None = None,
    ) -> None:
        """Publish results, error file and manifest, in the order the module docstring gives; each step fenced.

        :param manifest: written last; its ``output_etag`` and ``error_etag`` are filled in here.
        :param staging: the run's staging; its results are copied to the output (server side)
            when ``results_path`` is None, and the whole prefix is removed at the end.
        :param results_path: a local results file to upload instead.
        :param errors_path: the failed lines; None deletes an earlier error file.
        :raises OutputBusyError: this try lost the output's lease, or another run's manifest
            appeared while it published (nothing more is changed).
        """
        client = self.hook.get_conn()
        # Read before the first fence check: each change below is conditional on what was seen here
        # (see the module docstring), so a try paused after a check fails its write instead of
        # undoing what a successor published meanwhile.
        seen_manifest = head_etag(client, self.manifest_bucket, self.manifest_key)
        seen_results = head_etag(client, self.bucket, self.key)
        seen_errors = head_etag(client, self.error_bucket, self.error_key)
        tombstone = self.mark_publishing(seen_manifest, manifest.fingerprint)
        if results_path is not None:
            manifest.output_etag = self._conditional_write(
                lambda: upload_file(
                    self._fenced(), results_path, self.bucket, self.key, **_condition(seen_results)
                ),
                self.output_uri,
                landed=lambda: head_etag(client, self.bucket, self.key) == file_md5(results_path),
            )
        elif staging is not None:
            manifest.output_etag = self._conditional_write(
                lambda: copy_object(
                    self._fenced(),
                    staging.bucket,
                    staging.results_key,
                    self.bucket,
                    self.key,
                    **_condition(seen_results),
                ),
                self.output_uri,
                landed=lambda: (
                    head_etag(client, self.bucket, self.key)
                    == head_etag(client, staging.bucket, staging.results_key)
                ),
            )
        else:
            raise ValueError("publish needs staging or results_path")
        manifest.error_etag = None
        if errors_path is not None:
            manifest.error_etag = self._conditional_write(
                lambda: upload_file(
                    self._fenced(), errors_path, self.error_bucket, self.error_key, **_condition(seen_errors)
                ),
                self.error_uri,
                landed=lambda: head_etag(client, self.error_bucket, self.error_key) == file_md5(errors_path),
            )
        elif seen_errors is not None:
            # A re-run with no failures must not leave an earlier run's error file behind.
            self._conditional_delete(self.error_bucket, self.error_key, seen_errors, self.error_uri)
        self.write_manifest(manifest, over=tombstone)
        if staging is not None:
            staging.remove()

    def mark_publishing(self, seen: str | None, fingerprint: str | None = None) -> str:
        """Replace the manifest with this publish's tombstone, first thing before anything beside it changes.

        From here until :meth:`write_manifest` a reader (or a later resume) sees *no* complete
        output rather than an old manifest beside new data.

        :param seen: the ETag of the manifest (or tombstone) read before the fence check: the write
            is ``If-Match`` it (``If-None-Match: *`` for None), so a manifest or tombstone another
            try wrote since is never replaced.
        :param fingerprint: the run identity publishing, for a person reading the tombstone.
        :return: the tombstone's ETag, which the manifest's write is conditional on.
        :raises OutputBusyError: the manifest changed since ``seen`` was read: another try publishes.
        """
        body = Tombstone(uuid.uuid4().hex, self.output_uri, fingerprint).to_json()
        return self._put_manifest_key(body, _condition(seen))

    def write_manifest(self, manifest: Manifest, over: str | None = None) -> str:
        """Write the manifest, last, in place of this try's own tombstone.

        :param over: the ETag of the tombstone :meth:`mark_publishing` wrote: the write is ``If-Match``
            it, so a successor that replaced the tombstone (it publishes now) makes this write fail.
            None: only where there is no manifest at all (``If-None-Match: *``).
        :return: the manifest's ETag.
        :raises OutputBusyError: the tombstone was replaced (or a manifest appeared): another writer published.
        """
        return self._put_manifest_key(
            manifest.to_json(), {"IfMatch": f'"{over}"'} if over is not None else {"IfNoneMatch": "*"}
        )

    def _put_manifest_key(self, body: bytes, condition: Mapping[str, str]) -> str:
        """A fenced conditional PUT at the manifest key; return the ETag it got."""
        response = self._conditional_write(
            lambda: self._fenced().put_object(
                Bucket=self.manifest_bucket,
                Key=self.manifest_key,
                Body=body,
                ContentType="application/json",
                **condition,
            ),
            self.manifest_uri,
            # A tombstone's bytes are unique (its id): finding them there means this very write landed. A
            # manifest byte for byte like this one (another try's) names the very same files: the same output.
            landed=lambda: (
                head_etag(self.hook.get_conn(), self.manifest_bucket, self.manifest_key)
                == hashlib.md5(body).hexdigest()
            ),
        )
        return response if isinstance(response, str) else bare_etag(response["ETag"])

    def _conditional_write(self, write: Callable[[], Any], uri: str, *, landed: Callable[[], bool]) -> Any:
        """Run a fenced conditional write; a 412 is this try's own write when ``landed()`` (a lost response
        botocore sent again), else another try changed ``uri`` meanwhile: :class:`OutputBusyError`."""
        try:
            return write()
        except ClientError as err:
            if error_code(err) not in _PRECONDITION_CODES | {"NoSuchKey", "404"}:
                raise
            if error_code(err) in _PRECONDITION_CODES and landed():
                log.info("The write of %s landed although its answer was lost; going on", uri)
                # The ETag S3 gave it: what the write would have returned.
                bucket, key = split_s3_uri(uri, "output_uri")
                return head_etag(self.hook.get_conn(), bucket, key)
            raise self._changed_meanwhile(uri) from None

    def _conditional_delete(self, bucket: str, key: str, seen: str, uri: str) -> None:
        """Delete ``key`` if it still has the ETag ``seen`` (fenced); gone already counts as deleted."""
        try:
            self._fenced().delete_object(Bucket=bucket, Key=key, IfMatch=f'"{seen}"')
        except ClientError as err:
            code = error_code(err)
            # A missing object answers 404 on S3 and 412 on SeaweedFS: either way, gone is deleted (our own
            # delete whose answer was lost, or another's: nothing of it is left to undo).
            if code in ("NoSuchKey", "404") or (
                code in _PRECONDITION_CODES and head_etag(self.hook.get_conn(), bucket, key) is None
            ):
                return
            if code in _PRECONDITION_CODES:
                raise self._changed_meanwhile(uri) from None
            raise

    def _changed_meanwhile(self, uri: str) -> OutputBusyError:
        return OutputBusyError(
            f"{uri} changed while this try published, so this try stopped without changing it. "
            f"Give each run its own output_uri ({doc_ref('The run protocol and its invariants', 'Fencing')})."
        )


def _decode_manifest(data: bytes | None, uri: str) -> Manifest | None:
    """A manifest key's content as a manifest; None for nothing, a publish's tombstone, or something unreadable.

    :raises ManifestVersionError: a manifest of a newer schema than this package reads (never overwritten:
        the task fails without a retry, naming ``uri``).
    """
    if data is None or is_tombstone(data):
        return None
    try:
        return Manifest.from_json(data, uri)
    except msgspec.DecodeError:
        return None


def _condition(seen: str | None) -> dict[str, str]:
    """The condition of a write over what was seen: that very object, or none at all."""
    return {"IfMatch": f'"{seen}"'} if seen is not None else {"IfNoneMatch": "*"}
