"""The S3 primitives the storage layer is built on: URIs, uploads, copies, reads, deletes and S3's errors.

Every function takes a boto3 client (or an ``S3Hook``) and the bucket and key; what an
object is for is :mod:`~airflow_vllm_batch.storage.staging`'s and
:mod:`~airflow_vllm_batch.storage.publishing`'s to know (only the errors name the
operator parameter at fault: ``input_uri``, ``output_uri``). Writes take S3's conditions (``IfMatch``,
``IfNoneMatch``) as keyword arguments and return the ETag S3 gave the object, which is what
publishing's conditional writes and the manifest's pinned ETags are built on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from airflow.providers.amazon.aws.exceptions import S3HookUriParseFailure
from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from botocore.exceptions import BotoCoreError, ClientError

from airflow_vllm_batch.batchfile import open_lines
from airflow_vllm_batch.exceptions import (
    InputChangedError,
    InputNotFoundError,
    LocationError,
    StorageUnavailableError,
    VLLMBatchError,
)


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


#: Above this size a file goes up in parts (S3 takes at most 5 GiB in one PUT).
MULTIPART_ABOVE = 512 * 2**20
#: The part size of such an upload (or server-side copy); one part is in memory at a time.
UPLOAD_PART_BYTES = 64 * 2**20
#: S3's limit for one CopyObject.
COPY_OBJECT_MAX = 5 * 2**30


def upload_file(client: Any, path: Path, bucket: str, key: str, **condition: str) -> str:
    """Upload a local file (one PUT, or in parts when large); return the ETag S3 gave the object.

    The ETag comes from S3's own response, not a HEAD afterwards, which another writer's
    PUT could have overtaken.

    :param condition: ``IfMatch`` or ``IfNoneMatch`` (on the PUT, or on completing the parts).
    """
    if path.stat().st_size <= MULTIPART_ABOVE:
        with open(path, "rb") as body:
            return bare_etag(client.put_object(Bucket=bucket, Key=key, Body=body, **condition)["ETag"])
    writer = ObjectWriter(client, bucket, key, condition=condition)
    with writer.aborted_on_error(), open(path, "rb") as body:
        while chunk := body.read(UPLOAD_PART_BYTES):
            writer.write_part(chunk)
        return writer.finish()


def file_md5(path: Path) -> str | None:
    """The MD5 ETag S3 gives a file :func:`upload_file` uploads in one PUT; None for one uploaded in parts (its ETag is not an MD5)."""
    if path.stat().st_size > MULTIPART_ABOVE:
        return None
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


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
    writer = ObjectWriter(client, bucket, key, condition=condition)
    with writer.aborted_on_error():
        for start in range(0, size, 8 * UPLOAD_PART_BYTES):
            writer.copy_part(source, start, min(start + 8 * UPLOAD_PART_BYTES, size) - 1)
        return writer.finish()


class ObjectWriter:
    """Write one object from parts as they come: one PUT when it all fits in the first part, else a multipart upload.

    The run's uploads (:func:`upload_file`, :func:`copy_object`) and the OpenAI API's file uploads
    both write through it. Only the part being sent is in memory; every part but the last must be
    at least 5 MiB (S3's minimum). A multipart upload left open keeps its parts (and their cost):
    whoever writes calls :meth:`abort` when it fails (:meth:`aborted_on_error` does).

    :param client: a boto3 S3 client.
    :param bucket: the bucket.
    :param key: the object's key.
    :param content_type: the object's ``Content-Type``. Default: S3's.
    :param condition: ``IfMatch`` or ``IfNoneMatch`` on the PUT, or on completing the parts.
    """

    def __init__(
        self,
        client: Any,
        bucket: str,
        key: str,
        *,
        content_type: str | None = None,
        condition: Mapping[str, str] | None = None,
    ) -> None:
        self.client, self.bucket, self.key = client, bucket, key
        self._extra = {"ContentType": content_type} if content_type else {}
        self._condition = dict(condition or {})
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    def write_part(self, data: bytes) -> None:
        """Upload one part (at least 5 MiB, but the last), beginning the multipart upload at the first."""
        upload_id, number = self._next_part()
        etag = self.client.upload_part(
            Bucket=self.bucket, Key=self.key, UploadId=upload_id, PartNumber=number, Body=data
        )["ETag"]
        self._parts.append({"ETag": etag, "PartNumber": number})

    def copy_part(self, source: Mapping[str, str], first: int, last: int) -> None:
        """Copy bytes ``first`` to ``last`` (inclusive) of the object ``source`` (``Bucket``, ``Key``) as the next part, server side."""
        upload_id, number = self._next_part()
        result = self.client.upload_part_copy(
            Bucket=self.bucket,
            Key=self.key,
            UploadId=upload_id,
            PartNumber=number,
            CopySource=dict(source),
            CopySourceRange=f"bytes={first}-{last}",
        )
        self._parts.append({"ETag": result["CopyPartResult"]["ETag"], "PartNumber": number})

    def finish(self, rest: bytes = b"") -> str:
        """Write ``rest`` and complete the object (one PUT when no part was written); return the ETag S3 gave it."""
        if self._upload_id is None:
            response = self.client.put_object(
                Bucket=self.bucket, Key=self.key, Body=rest, **self._extra, **self._condition
            )
            return bare_etag(response["ETag"])
        if rest:
            self.write_part(rest)
        done = self.client.complete_multipart_upload(
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self._upload_id,
            MultipartUpload={"Parts": self._parts},
            **self._condition,
        )
        return bare_etag(done["ETag"])

    def abort(self) -> None:
        """Drop the parts uploaded so far; an abort S3 refuses is left to the bucket's lifecycle rule (the error that
        led here matters more)."""
        if self._upload_id is not None:
            with contextlib.suppress(ClientError, BotoCoreError):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id)

    @contextlib.contextmanager
    def aborted_on_error(self) -> Iterator[None]:
        """Abort the upload when the block raises (a failed part, a refused condition, an interrupt), then re-raise."""
        try:
            yield
        except BaseException:
            self.abort()
            raise

    def _next_part(self) -> tuple[str, int]:
        """The upload's id (begun here at the first part) and the next part's number."""
        if self._upload_id is None:
            self._upload_id = self.client.create_multipart_upload(
                Bucket=self.bucket, Key=self.key, **self._extra
            )["UploadId"]
        return self._upload_id, len(self._parts) + 1


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
def open_uri_lines(hook: S3Hook, uri: str) -> Iterator[Iterator[bytes]]:
    """Stream the lines of ``s3://bucket/key`` through ``hook``, or of anything else :func:`~airflow_vllm_batch.batchfile.open_lines` reads."""
    if not uri.startswith("s3://"):
        with open_lines(uri) as lines:
            yield lines
        return
    bucket, key = split_s3_uri(uri, "source")
    with s3_lines(hook, bucket, key) as lines:
        yield lines


#: S3 error codes that say the location itself is wrong: the same call fails the same way on a retry.
_LOCATION_CODES = frozenset(
    {"NoSuchBucket", "404", "AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
)


def location_error(parameter: str, bucket: str, err: ClientError, conn_id: str | None) -> VLLMBatchError:
    """The error of a refused S3 call: a :class:`LocationError` (not retried) when the bucket is missing or
    denied, else :class:`StorageUnavailableError` (retried: S3 slowing down or failing for a moment)."""
    if error_code(err) in _LOCATION_CODES:
        return LocationError(location_message(parameter, bucket, err, conn_id))
    return StorageUnavailableError(
        f"{parameter}: S3 failed on bucket {bucket!r} ({err}). The task is retried."
    )


def location_message(parameter: str, bucket: str, err: ClientError, conn_id: str | None) -> str:
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectHead:
    """What a HEAD of an object says of it.

    :param etag: its ETag, without quotes.
    :param version_id: its VersionId, when the bucket is versioned.
    :param size: its size in bytes, when S3 said.
    """

    etag: str
    version_id: str | None = None
    size: int | None = None


def head_input(hook: S3Hook, uri: str) -> ObjectHead:
    """HEAD the input object; raise :class:`InputNotFoundError` naming ``input_uri`` and the fix.

    Note that ``S3Hook.head_object`` returns None on a 404 instead of raising.
    """
    bucket, key = split_s3_uri(uri, "input_uri")
    try:
        head: dict[str, Any] | None = hook.head_object(key, bucket_name=bucket)
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
    return ObjectHead(
        etag=bare_etag(head["ETag"]), version_id=head.get("VersionId"), size=head.get("ContentLength")
    )
