"""Everything a batch keeps in S3 beside its output: staging, publishing, the manifest, the lease.

One output ``s3://b/k/results.jsonl`` comes with::

    s3://b/k/results.errors.jsonl          failed requests (or error_uri)
    s3://b/k/results.manifest.json         written last: the output is complete
    s3://b/k/results.lease.json            held while a run writes (see lease.py)
    s3://b/k/results.requests/<sha>.jsonl  the batch file made from ``requests=`` (kept:
                                           the manifest's input_uri names it)
    s3://b/k/results.jsonl.staging/<run>/  one run's staging (<run>: its fingerprint's
                                           first 16 hex digits), shared by its tries
        .../<run>/parts/part-000000.jsonl  the server engine's checkpoints, in order (and the
                                           answers a dying runner finished)
        .../<run>/deaths/death-000000.json the runner engine's deaths and their suspects

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
and a retry publishes again), and :func:`read_answers` reads a manifest's files pinned to
them. A conditional write whose response was lost is sent again by botocore and then
fails its own condition; such a 412 is taken as this try's own write when the object now
holds exactly what was written (its MD5 ETag; each tombstone carries a random id, so its
bytes are its publish's alone).

The runner engine's finished results reach ``<run>/results.jsonl`` before they are checked
or published, so a retry on any worker (or pod) finds them there and publishes them without
running the engine again. The server engine checkpoints as it goes instead: each sealed
part of its journal goes to ``<run>/parts/``, a retry on any worker skips the requests
those parts answer, and the results check reads the parts in order (no assembled file). ``VLLMBatchOperator`` and ``VLLMBatchMergeOperator`` both use
this module; the object names are made here only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from airflow.providers.amazon.aws.exceptions import S3HookUriParseFailure
from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from botocore.exceptions import BotoCoreError, ClientError

from airflow_vllm_batch.batchfile import answers, open_lines
from airflow_vllm_batch.exceptions import (
    InputChangedError,
    InputNotFoundError,
    LocationError,
    OutputBusyError,
    ResultsCheckError,
    StorageUnavailableError,
    VLLMBatchError,
)
from airflow_vllm_batch.identity import RunIdentity
from airflow_vllm_batch.lease import LeaseHolder, OutputLease
from airflow_vllm_batch.manifest import Manifest, Tombstone, is_tombstone


def output_stem(output_uri: str) -> str:
    """The output URI without its ``.jsonl`` ending."""
    return output_uri.removesuffix(".jsonl")


def default_error_uri(output_uri: str) -> str:
    """Where failed lines go when no ``error_uri`` is given: ``<stem>.errors.jsonl``."""
    return f"{output_stem(output_uri)}.errors.jsonl"


def manifest_uri(output_uri: str) -> str:
    """Where the manifest is written, last: ``<stem>.manifest.json``."""
    return f"{output_stem(output_uri)}.manifest.json"


def requests_uri(output_uri: str, name: str) -> str:
    """Where a batch file made from ``requests`` goes: ``<stem>.requests/<name>`` (``name``: its content hash)."""
    return f"{output_stem(output_uri)}.requests/{name}"


def split_s3_uri(uri: str, parameter: str) -> tuple[str, str]:
    """Return ``(bucket, key)`` of an ``s3://bucket/key`` URI, or raise naming ``parameter``."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise LocationError(f"{parameter} must be an s3://bucket/key URI, got {uri!r}.")
    try:
        bucket, key = S3Hook.parse_s3_url(uri)
    except S3HookUriParseFailure:
        bucket, key = "", ""
    if not bucket or not key or key.endswith("/"):
        raise LocationError(f"{parameter} must name an object (s3://bucket/key, not a folder), got {uri!r}.")
    return bucket, key


log = logging.getLogger(__name__)

#: Above this size a file goes up in parts (S3 takes at most 5 GiB in one PUT).
MULTIPART_ABOVE = 512 * 2**20
#: The part size of such an upload (or server-side copy); one part is in memory at a time.
UPLOAD_PART_BYTES = 64 * 2**20
#: S3's limit for one CopyObject.
COPY_OBJECT_MAX = 5 * 2**30
#: The codes of a conditional write that found its condition false.
_PRECONDITION_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})


def upload_file(client: Any, path: Path, bucket: str, key: str, **condition: str) -> str:
    """Upload a local file (one PUT, or in parts when large); return the ETag S3 gave the object.

    The ETag comes from S3's own response, not a HEAD afterwards, which another writer's
    PUT could have overtaken.

    :param condition: ``IfMatch`` or ``IfNoneMatch`` (on the PUT, or on completing the parts).
    """
    if path.stat().st_size <= MULTIPART_ABOVE:
        with open(path, "rb") as body:
            return bare_etag(client.put_object(Bucket=bucket, Key=key, Body=body, **condition)["ETag"])
    with _multipart(client, bucket, key, condition) as parts:
        with open(path, "rb") as body:
            while chunk := body.read(UPLOAD_PART_BYTES):
                number = len(parts.done) + 1
                etag = client.upload_part(
                    Bucket=bucket, Key=key, UploadId=parts.upload_id, PartNumber=number, Body=chunk
                )["ETag"]
                parts.done.append({"ETag": etag, "PartNumber": number})
    return parts.etag


def copy_object(
    client: Any, source_bucket: str, source_key: str, bucket: str, key: str, **condition: str
) -> str:
    """Copy an object server side (no byte through the worker; in parts above 5 GiB); return the copy's ETag.

    :param condition: ``IfMatch`` or ``IfNoneMatch`` on the destination.
    """
    source = {"Bucket": source_bucket, "Key": source_key}
    size = client.head_object(**source)["ContentLength"]
    if size <= COPY_OBJECT_MAX:
        return bare_etag(
            client.copy_object(Bucket=bucket, Key=key, CopySource=source, **condition)["CopyObjectResult"][
                "ETag"
            ]
        )
    with _multipart(client, bucket, key, condition) as parts:
        for number, start in enumerate(range(0, size, 8 * UPLOAD_PART_BYTES), start=1):
            end = min(start + 8 * UPLOAD_PART_BYTES, size) - 1
            result = client.upload_part_copy(
                Bucket=bucket,
                Key=key,
                UploadId=parts.upload_id,
                PartNumber=number,
                CopySource=source,
                CopySourceRange=f"bytes={start}-{end}",
            )
            parts.done.append({"ETag": result["CopyPartResult"]["ETag"], "PartNumber": number})
    return parts.etag


@dataclasses.dataclass
class _Parts:
    """A multipart upload under way: its id, the parts sent, and the object's ETag once completed."""

    upload_id: str
    done: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    etag: str = ""


@contextlib.contextmanager
def _multipart(client: Any, bucket: str, key: str, condition: Mapping[str, str]) -> Iterator[_Parts]:
    """A multipart upload: the body sends the parts; completed (under ``condition``) after it, aborted if it raises."""
    parts = _Parts(client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"])
    try:
        yield parts
        done = client.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=parts.upload_id,
            MultipartUpload={"Parts": parts.done},
            **condition,
        )
        parts.etag = bare_etag(done["ETag"])
    except BaseException:
        with contextlib.suppress(ClientError, BotoCoreError):
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=parts.upload_id)
        raise


def bare_etag(etag: str) -> str:
    """An ETag without its quotes (S3 quotes it in headers; some stores leave them out of XML bodies)."""
    return etag.strip('"')


#: Requests of one :func:`delete_keys` for the keys S3 answered with a per-key error.
DELETE_ROUNDS = 3


def delete_keys(client: Any, bucket: str, keys: Sequence[str]) -> None:
    """Delete ``keys`` (1,000 to a request, S3's limit); the keys S3 failed to delete are sent again.

    ``DeleteObjects`` answers 200 even when it deletes only some keys: the others come back
    under ``Errors`` (``InternalError``, ``SlowDown``, ``AccessDenied``). They are sent again,
    up to :data:`DELETE_ROUNDS` requests in all; a key still not deleted then raises, so that
    no caller takes a key for gone that is still there (a dropped part would be resumed from).

    :raises StorageUnavailableError: S3 kept refusing to delete some keys.
    """
    keys = list(keys)
    for start in range(0, len(keys), 1000):
        chunk = keys[start : start + 1000]
        for _ in range(DELETE_ROUNDS):
            response = client.delete_objects(
                Bucket=bucket, Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True}
            )
            errors = [e for e in (response or {}).get("Errors", []) if e.get("Key")]
            if not errors:
                break
            chunk = [e["Key"] for e in errors]
        else:
            raise StorageUnavailableError(
                f"S3 did not delete {len(chunk)} object(s) in s3://{bucket}/ after {DELETE_ROUNDS} requests "
                f"(e.g. {chunk[0]}: {errors[0].get('Code')}). The task is retried."
            )


def head_etag(client: Any, bucket: str, key: str) -> str | None:
    """The object's ETag (without quotes), or None when there is no such object."""
    try:
        return bare_etag(client.head_object(Bucket=bucket, Key=key)["ETag"])
    except ClientError as err:
        if error_code(err) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def error_code(err: ClientError) -> str:
    """The S3 error code of a botocore ``ClientError`` (``NoSuchBucket``, ``AccessDenied``, ...)."""
    return str(err.response.get("Error", {}).get("Code", ""))


@contextlib.contextmanager
def s3_body(
    hook: S3Hook, bucket: str, key: str, *, if_match: str | None = None, version_id: str | None = None
) -> Iterator[Any]:
    """Open an object's streaming body; close it on exit.

    :param if_match: the ETag the object must still have (the pinned input).
    :param version_id: the version to read.
    :raises InputChangedError: when the object no longer has ``if_match``.
    """
    extra: dict[str, str] = {}
    if if_match:
        extra["IfMatch"] = f'"{if_match}"' if not if_match.startswith('"') else if_match
    if version_id:
        extra["VersionId"] = version_id
    try:
        body = hook.get_conn().get_object(Bucket=bucket, Key=key, **extra)["Body"]
    except ClientError as err:
        if error_code(err) in ("PreconditionFailed", "412"):
            raise InputChangedError(
                f"s3://{bucket}/{key} was overwritten while this task ran (its ETag is no longer "
                f"{if_match}). Nothing was published; the next try runs the new content."
            ) from None
        raise
    try:
        yield body
    finally:
        body.close()


@contextlib.contextmanager
def s3_lines(hook: S3Hook, bucket: str, key: str, **pin: str | None) -> Iterator[Iterator[bytes]]:
    """Stream an object's lines (bytes, no newline) without holding it in memory."""
    with s3_body(hook, bucket, key, **pin) as body, open_lines(body) as lines:
        yield lines


@contextlib.contextmanager
def _published_lines(hook: S3Hook, etags: Mapping[str, str], uri: str) -> Iterator[Iterator[bytes]]:
    """Stream a published file pinned to the ETag its manifest names: a file overwritten since is refused."""
    etag = etags.get(uri)
    if etag is None:
        with open_uri_lines(hook, uri) as lines:
            yield lines
        return
    bucket, key = split_s3_uri(uri, "source")
    try:
        with s3_lines(hook, bucket, key, if_match=etag) as lines:
            yield lines
    except InputChangedError:
        raise ResultsCheckError(
            f"{uri} is not the file its manifest published (its ETag is no longer {etag}): another run "
            "overwrote it. Run the batch again to publish a complete output."
        ) from None


@contextlib.contextmanager
def open_uri_lines(hook: S3Hook, uri: str) -> Iterator[Iterator[bytes]]:
    """Stream the lines of ``s3://bucket/key`` through ``hook``, or of anything else :func:`~airflow_vllm_batch.batchfile.open_lines` reads."""
    if not uri.startswith("s3://"):
        with open_lines(uri) as lines:
            yield lines
        return
    bucket, key = split_s3_uri(uri, "source")
    with s3_lines(hook, bucket, key) as lines:
        yield lines


def read_answers(
    source: Mapping[str, Any] | str,
    *,
    aws_conn_id: str | None = "aws_default",
    errors: bool = True,
    output_type: type | str | None = None,
) -> Iterator[answers.Answer]:
    """Stream the answers of a batch from S3 (or a local path): :func:`airflow_vllm_batch.batchfile.read_answers` with S3 opened here.

    :param source: the operator's manifest (its XCom), or one results or error file:
        ``s3://bucket/key`` or a local path.
    :param aws_conn_id: the Airflow AWS connection for ``s3://`` files. Default ``aws_default``.
    :param errors: with a manifest, also yield its error file's ``Failed`` records. Default True.
    :param output_type: a Pydantic model (or its import path): text answers come as ``Parsed``
        ``(custom_id, value)``, ``value`` an instance of it.
    :raises ResultsCheckError: with a manifest, the files do not answer its requests exactly once.
    """
    hook = S3Hook(aws_conn_id=aws_conn_id)
    etags: dict[str, str] = {}
    if isinstance(source, Mapping):
        # A manifest names the ETags of the files it published: read exactly those (Fencing).
        for uri_field, etag_field in (("output_uri", "output_etag"), ("error_uri", "error_etag")):
            if source.get(uri_field) and source.get(etag_field):
                etags[source[uri_field]] = source[etag_field]
    open_uri = (
        functools.partial(_published_lines, hook, etags) if etags else functools.partial(open_uri_lines, hook)
    )
    yield from answers.read_answers(source, open_uri=open_uri, errors=errors, output_type=output_type)


#: ``part-000123-<try token>.jsonl``: the journal's part number (:func:`airflow_vllm_batch.serving.part_name`)
#: and the token of the try that wrote it, so that two tries never write the same key (a zombie try
#: that lost its lease cannot overwrite its successor's parts). Parts without a token are read too.
_PART_NAME = re.compile(r"part-(\d{6,})(?:-([0-9a-z]+))?\.jsonl$")


class RunStaging:
    """The staging prefix of one run: shared by its tries, removed when it publishes.

    Every method that writes or deletes calls ``fence`` first (the lease check, see the module docstring).

    :param hook: the S3 hook (only its ``get_conn()`` client writes and deletes).
    :param bucket: the output's bucket.
    :param prefix: ``<output key>.staging/<run>/``.
    :param fence: called right before every mutation; raises when this try may no longer write.
    """

    def __init__(
        self, hook: S3Hook, bucket: str, prefix: str, fence: Callable[[], None] | None = None
    ) -> None:
        self.hook = hook
        self.bucket = bucket
        self.prefix = prefix
        self.fence = fence

    def _fenced(self) -> Any:
        """The S3 client, once the fence let this mutation through."""
        if self.fence is not None:
            self.fence()
        return self.hook.get_conn()

    @property
    def results_key(self) -> str:
        """The engine's finished results, durable: what a retry on any worker publishes."""
        return f"{self.prefix}results.jsonl"

    @property
    def input_key(self) -> str:
        """The cleaned copy of the input that the engine reads, when preflight rewrote lines."""
        return f"{self.prefix}input.jsonl"

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def has_results(self) -> bool:
        """Whether an earlier try of this run left finished results here."""
        return self.hook.head_object(self.results_key, bucket_name=self.bucket) is not None

    def put_results(self, path: Path) -> None:
        """Make the engine's finished results durable (multipart upload for large files)."""
        upload_file(self._fenced(), path, self.bucket, self.results_key)

    def open_results(self) -> contextlib.AbstractContextManager[Iterator[bytes]]:
        """Stream the staged results."""
        return s3_lines(self.hook, self.bucket, self.results_key)

    def drop_results(self) -> None:
        """Forget staged results and every checkpoint part, so that the next try runs the engine."""
        keys = [self.results_key, *self.list_parts()]
        delete_keys(self._fenced(), self.bucket, keys)

    def drop_parts(self, keys: Sequence[str]) -> None:
        """Delete the checkpoint parts ``keys`` (those a results check found unusable), and no other."""
        if keys:
            delete_keys(self._fenced(), self.bucket, keys)

    # -- the server engine's checkpoints ---------------------------------------------

    @property
    def parts_prefix(self) -> str:
        """Where the journal's sealed parts go: ``<run>/parts/``."""
        return f"{self.prefix}parts/"

    def part_key(self, name: str) -> str:
        """The key of the part file ``name`` (``part-000000.jsonl``)."""
        return f"{self.parts_prefix}{name}"

    def put_part(self, path: Path, token: str = "") -> None:
        """Upload one sealed part under its file name and the try's ``token``; idempotent (a part re-sent replaces itself).

        One streamed PUT rather than ``S3Hook.load_file``: a part is at most
        ``max_part_bytes`` (64 MiB by default, far below S3's 5 GB for one PUT), and
        ``load_file``'s multipart transfer buffers up to ten 8 MiB chunks at once, which
        made the task's memory grow with the part size.
        """
        client = self._fenced()
        with open(path, "rb") as body:
            name = path.name if not token else path.name.replace(".jsonl", f"-{token}.jsonl")
            client.put_object(Bucket=self.bucket, Key=self.part_key(name), Body=body)

    def list_parts(self) -> list[str]:
        """Return the keys of the parts earlier tries uploaded, in part order (then by try)."""
        keys = self.hook.list_keys(bucket_name=self.bucket, prefix=self.parts_prefix) or []
        found = [(int(m.group(1)), m.group(2) or "", key) for key in keys if (m := _PART_NAME.search(key))]
        return [key for _, _, key in sorted(found)]

    @contextlib.contextmanager
    def open_parts(self, parts: Sequence[str] | None = None) -> Iterator[Iterator[bytes]]:
        """Stream the lines of every part, in part order, one part's body open at a time.

        :param parts: the parts' keys, as :meth:`list_parts` returns them. Default: all.
        """
        keys = list(self.list_parts() if parts is None else parts)

        def lines() -> Iterator[bytes]:
            for key in keys:
                with s3_lines(self.hook, self.bucket, key) as part:
                    yield from part

        stream = lines()
        try:
            yield stream
        finally:
            stream.close()

    def put_file(self, path: Path, key: str) -> None:
        """Upload a local file to ``key`` under this prefix (the answer cache's staged hits, say)."""
        if not key.startswith(self.prefix):
            raise ValueError(f"{key} is not under the staging prefix {self.prefix}")
        upload_file(self._fenced(), path, self.bucket, key)

    # -- the runner engine's deaths (see airflow_vllm_batch.engines.runner_deaths) ---------

    @property
    def deaths_prefix(self) -> str:
        """Where the runner engine records its deaths and their suspects: ``<run>/deaths/``."""
        return f"{self.prefix}deaths/"

    def put_death(self, number: int, token: str, record: bytes) -> None:
        """Record one engine death (JSON) as ``death-<number>-<token>.json``: two tries never write the same key."""
        key = f"{self.deaths_prefix}death-{number:06d}-{token}.json"
        self._fenced().put_object(Bucket=self.bucket, Key=key, Body=record)

    def read_deaths(self) -> list[bytes]:
        """The recorded deaths, in order."""
        keys = sorted(self.hook.list_keys(bucket_name=self.bucket, prefix=self.deaths_prefix) or [])
        client = self.hook.get_conn()
        return [client.get_object(Bucket=self.bucket, Key=key)["Body"].read() for key in keys]

    def drop_staged_output(self) -> None:
        """Forget the results file a dying runner uploaded (its answers went into a part)."""
        delete_keys(self._fenced(), self.bucket, [self.results_key])

    def put_input(self, path: Path) -> str:
        """Upload the cleaned input for the engine; return its URI."""
        upload_file(self._fenced(), path, self.bucket, self.input_key)
        return self.uri(self.input_key)

    def remove(self) -> None:
        """Delete everything under this run's prefix (and nothing under anyone else's)."""
        keys = self.hook.list_keys(bucket_name=self.bucket, prefix=self.prefix) or []
        if keys:
            delete_keys(self._fenced(), self.bucket, keys)


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
                raise LocationError(
                    _location_message(parameter, bucket, err, self.hook.aws_conn_id)
                ) from None

    def read_manifest(self) -> Manifest | None:
        """The manifest beside the output, or None when there is none (or a publish's tombstone, or it is unreadable)."""
        return _decode_manifest(self._manifest_body())

    def _manifest_body(self) -> bytes | None:
        """What the manifest key holds (a manifest, or a publish's tombstone), or None when nothing."""
        try:
            return (
                self.hook.get_conn()
                .get_object(Bucket=self.manifest_bucket, Key=self.manifest_key)["Body"]
                .read()
            )
        except ClientError as err:
            code = error_code(err)
            if code in ("NoSuchKey", "404"):
                return None
            if code in ("NoSuchBucket", "AccessDenied", "403"):
                raise LocationError(
                    _location_message("output_uri", self.manifest_bucket, err, self.hook.aws_conn_id)
                ) from None
            raise

    def completed(self, identity: RunIdentity) -> tuple[Manifest | None, str]:
        """Return the published manifest of a run with this identity, if its files are all there.

        :return: the manifest (or None) and one line that says why it was (not) taken.
        """
        data = self._manifest_body()
        if data is not None and is_tombstone(data):
            return None, (
                f"the output at {self.output_uri} is not complete: a try began publishing it and has not finished "
                "(it still publishes, or it was stopped)"
            )
        manifest = _decode_manifest(data)
        if manifest is None:
            return None, f"no complete output at {self.output_uri} yet"
        if manifest.fingerprint != identity.fingerprint:
            changed = ", ".join(identity.changes_from(manifest.identity)) or "the fingerprint"
            return None, f"the output at {self.output_uri} was made by a different run (changed: {changed})"
        for uri, published in (
            (manifest.output_uri, manifest.output_etag),
            (manifest.error_uri, manifest.error_etag),
        ):
            if not uri:
                continue
            bucket, key = split_s3_uri(uri, "output_uri")
            etag = head_etag(self.hook.get_conn(), bucket, key)
            if etag is None:
                return None, f"the manifest names {uri}, which is gone"
            if published is not None and etag != bare_etag(published):
                # A writer that lost the lease landed a write after its last check (see the module docstring).
                return (
                    None,
                    f"{uri} was overwritten after its manifest was written (ETag {etag}, published {published})",
                )
        return manifest, f"the output at {self.output_uri} is complete for this very run"

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
                landed=lambda: head_etag(client, self.bucket, self.key) == _file_md5(results_path),
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
                landed=lambda: head_etag(client, self.error_bucket, self.error_key) == _file_md5(errors_path),
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
            f"{uri} changed while this try published (another try of this output, or another run, wrote it "
            "after this try read it); this try stopped without changing it. Give each run its own output_uri."
        )


def _decode_manifest(data: bytes | None) -> Manifest | None:
    """A manifest key's content as a manifest; None for nothing, a publish's tombstone, or something unreadable."""
    if data is None or is_tombstone(data):
        return None
    try:
        return Manifest.from_json(data)
    except msgspec.DecodeError:
        return None


def _condition(seen: str | None) -> dict[str, str]:
    """The condition of a write over what was seen: that very object, or none at all."""
    return {"IfMatch": f'"{seen}"'} if seen is not None else {"IfNoneMatch": "*"}


def _file_md5(path: Path) -> str | None:
    """The MD5 ETag S3 gives a file uploaded in one PUT; None for one uploaded in parts (its ETag is not an MD5)."""
    if path.stat().st_size > MULTIPART_ABOVE:
        return None
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


#: S3 error codes that say the location itself is wrong: the same call fails the same way on a retry.
_LOCATION_CODES = frozenset(
    {"NoSuchBucket", "404", "AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
)


def location_error(parameter: str, bucket: str, err: ClientError, conn_id: str | None) -> VLLMBatchError:
    """The error of a refused S3 call: a :class:`LocationError` (not retried) when the bucket is missing or
    denied, else :class:`StorageUnavailableError` (retried: S3 slowing down or failing for a moment)."""
    if error_code(err) in _LOCATION_CODES:
        return LocationError(_location_message(parameter, bucket, err, conn_id))
    return StorageUnavailableError(
        f"{parameter}: S3 failed on bucket {bucket!r} ({err}). The task is retried."
    )


def _location_message(parameter: str, bucket: str, err: ClientError, conn_id: str | None) -> str:
    code = error_code(err)
    if code in ("NoSuchBucket", "404"):
        return (
            f"{parameter}: bucket {bucket!r} does not exist. Create it, or fix {parameter}. Nothing was run."
        )
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return (
            f"{parameter}: connection {conn_id!r} may not use bucket {bucket!r} ({code}). "
            "Check the connection's credentials and the bucket policy. Nothing was run."
        )
    return f"{parameter}: cannot use bucket {bucket!r} ({code or err}). Nothing was run."


def head_input(hook: S3Hook, uri: str) -> dict[str, Any]:
    """HEAD the input object; raise :class:`InputNotFoundError` naming ``input_uri`` and the fix.

    Note that ``S3Hook.head_object`` returns None on a 404 instead of raising.
    """
    bucket, key = split_s3_uri(uri, "input_uri")
    try:
        head = hook.head_object(key, bucket_name=bucket)
    except ClientError as err:
        code = error_code(err)
        if code in ("403", "AccessDenied", "Forbidden"):
            raise InputNotFoundError(
                f"input_uri: connection {hook.aws_conn_id!r} may not read {uri} (403). Check the connection's "
                "credentials and the bucket policy. Nothing was run."
            ) from None
        raise
    if head is None:
        raise InputNotFoundError(
            f"input_uri: {uri} does not exist (no such key, or no bucket {bucket!r}). Check the name, and that "
            "the task that writes it ran first. Nothing was run."
        )
    return head
