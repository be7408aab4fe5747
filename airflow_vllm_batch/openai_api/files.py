"""The OpenAI API's files in S3, streamed both ways: an upload never sits whole in the API server's memory.

Layout under ``[vllm_batch] openai_files_uri`` (``<root>``)::

    <root>files/<owner key>/<file id>.jsonl     the file's bytes (uploads and batch results)
    <root>files/<owner key>/<file id>.json      an upload's record: name, purpose, bytes, lines
    <root>batches/<batch id>.json               the API's record of a batch: its metadata (read by the API only)
    <root>batches/<batch id>.input.jsonl        the batch's copy of its input file, made at create (the file it runs)
    <root>batches/<batch id>.failure.json       why a batch failed (written by its task)
    <root>batches/<batch id>.cancel.json        a cancel was asked, and when
    <root>batches/<batch id>.progress.json      the live counts of a running batch (written by its task)

The batch task derives these from its signed spec (:meth:`.batch_spec.BatchSpec.locations`).

A user's files are under their own key (:func:`~airflow_vllm_batch.openai_api.access.owner_key`):
a file id is only ever looked up under the caller's key, so another user's file is not found.
"""

from __future__ import annotations

import builtins
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from python_multipart.multipart import MultipartParser, parse_options_header

#: The size of each part of an upload's S3 multipart upload
#: (:class:`~airflow_vllm_batch.storage.s3.ObjectWriter`): the most an upload holds in memory
#: (S3's minimum part is 5 MiB).
PART_BYTES = 8 * 1024 * 1024
#: The longest form field other than the file (``purpose``) accepted.
MAX_FIELD_BYTES = 1024
#: The chunk size of a content download.
CHUNK_BYTES = 1024 * 1024
FILE_ID = re.compile(r"^file-[0-9a-z]{8,64}$")
BATCH_ID = re.compile(r"^batch_[0-9a-f]{8,64}$")


class UploadError(ValueError):
    """The upload is not acceptable; the message says why and what to send instead.

    :param status: the HTTP status to answer with.
    :param param: the request parameter at fault, if one is.
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def result_file_ids(batch_id: str) -> tuple[str, str]:
    """The ids of a batch's output and error files (fixed by the batch id, so the run can write them)."""
    hex_id = batch_id.removeprefix("batch_")
    return f"file-{hex_id}out", f"file-{hex_id}err"


class FormReader:
    """Parse a ``multipart/form-data`` body as it arrives; hand out the ``file`` part's bytes, keep the small fields.

    :param content_type: the request's Content-Type header.
    """

    def __init__(self, content_type: str) -> None:
        kind, params = parse_options_header(content_type)
        if kind != b"multipart/form-data" or b"boundary" not in params:
            raise UploadError("POST /files takes multipart/form-data with the fields 'purpose' and 'file'")
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_parts = 0
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._headers: dict[str, bytes] = {}
        self._name: str | None = None
        self._field = bytearray()
        self._out: list[bytes] = []
        self._ended = False
        self._parser = MultipartParser(
            params[b"boundary"],
            {
                "on_part_begin": self._part_begin,
                "on_header_field": lambda d, s, e: self._header_field.extend(d[s:e]),
                "on_header_value": lambda d, s, e: self._header_value.extend(d[s:e]),
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
                "on_end": self._end,
            },
        )

    def feed(self, chunk: bytes) -> bytes:
        """Parse one chunk of the body; return the bytes of the ``file`` part it held."""
        self._parser.write(chunk)
        out, self._out = self._out, []
        return b"".join(out)

    def finish(self) -> None:
        """Check that the body ended with its closing boundary and had one ``file`` part.

        :raises UploadError: it did not.
        """
        self._parser.finalize()
        if not self._ended:
            raise UploadError("the multipart body ended before its closing boundary: send the whole file")
        if self.file_parts != 1:
            raise UploadError(f"the form has {self.file_parts} 'file' parts: send exactly one")

    def _part_begin(self) -> None:
        self._headers, self._name = {}, None

    def _header_end(self) -> None:
        self._headers[bytes(self._header_field).decode("latin-1").lower()] = bytes(self._header_value)
        self._header_field.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get("content-disposition", b""))
        self._name = params.get(b"name", b"").decode("utf-8", "replace")
        if self._name == "file":
            self.file_parts += 1
            self.filename = params.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")
        self._field.clear()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name == "file":
            if self.file_parts == 1:
                self._out.append(bytes(data[start:end]))
            return
        self._field.extend(data[start:end])
        if len(self._field) > MAX_FIELD_BYTES:
            raise UploadError(f"form field {self._name!r} is longer than {MAX_FIELD_BYTES} bytes")

    def _part_end(self) -> None:
        if self._name and self._name != "file":
            self.fields[self._name] = self._field.decode("utf-8", "replace")

    def _end(self) -> None:
        self._ended = True


@dataclass
class LineCounter:
    """Counts bytes and lines of a stream (a last line without a newline counts)."""

    bytes: int = 0
    newlines: int = 0
    last: int = 10

    def add(self, data: builtins.bytes) -> None:  # `bytes` is the count's field in this class
        if data:
            self.bytes += len(data)
            self.newlines += data.count(b"\n")
            self.last = data[-1]

    @property
    def lines(self) -> int:
        return self.newlines + (0 if self.last == 10 else 1)


def split_files_uri(files_uri: str) -> tuple[str, str]:
    """The bucket and the key prefix (empty or ending with ``/``) of ``openai_files_uri``."""
    bucket, _, key = files_uri.removeprefix("s3://").partition("/")
    return bucket, key if not key or key.endswith("/") else key + "/"


class FileStore:
    """The OpenAI API's objects in S3.

    :param client: a boto3 S3 client.
    :param bucket: the bucket of ``openai_files_uri``.
    :param prefix: its key prefix (empty or ending with ``/``).
    """

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix

    @classmethod
    def layout(cls, files_uri: str, client: Any = None) -> FileStore:
        """The store of ``openai_files_uri`` (``s3://bucket/prefix``); without ``client``, its key layout only.

        The one definition of where the API's objects are: :meth:`BatchSpec.locations
        <airflow_vllm_batch.openai_api.batch_spec.BatchSpec.locations>` derives a batch's
        locations from it.
        """
        return cls(client, *split_files_uri(files_uri))

    # -- keys ------------------------------------------------------------------------

    def user_prefix(self, owner: str) -> str:
        return f"{self.prefix}files/{owner}/"

    def content_key(self, owner: str, file_id: str) -> str:
        return f"{self.user_prefix(owner)}{file_id}.jsonl"

    def record_key(self, owner: str, file_id: str) -> str:
        return f"{self.user_prefix(owner)}{file_id}.json"

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def failure_key(self, batch_id: str) -> str:
        return f"{self.prefix}batches/{batch_id}.failure.json"

    def cancel_key(self, batch_id: str) -> str:
        return f"{self.prefix}batches/{batch_id}.cancel.json"

    def progress_key(self, batch_id: str) -> str:
        """The live counts the batch task writes at each checkpoint."""
        return f"{self.prefix}batches/{batch_id}.progress.json"

    def batch_record_key(self, batch_id: str) -> str:
        return f"{self.prefix}batches/{batch_id}.json"

    def batch_input_key(self, batch_id: str) -> str:
        return f"{self.prefix}batches/{batch_id}.input.jsonl"

    def pin_input(self, owner: str, file_id: str, batch_id: str) -> str | None:
        """Copy one of ``owner``'s files to the batch's own key, server-side; return the copy's ETag (None: no such file).

        The batch runs this copy: deleting or replacing the file afterwards changes nothing of it.
        """
        try:
            answer = self.client.copy_object(
                Bucket=self.bucket,
                Key=self.batch_input_key(batch_id),
                CopySource={"Bucket": self.bucket, "Key": self.content_key(owner, file_id)},
                ContentType="application/jsonl",
                MetadataDirective="REPLACE",
            )
        except self.client.exceptions.ClientError as err:
            if _not_found(err):
                return None
            raise
        return str(answer["CopyObjectResult"]["ETag"]).strip('"')

    # -- files -----------------------------------------------------------------------

    def save_record(self, owner: str, record: dict[str, Any]) -> None:
        self.put_json(self.record_key(owner, record["id"]), record)

    def file_object(self, owner: str, file_id: str) -> dict[str, Any] | None:
        """The OpenAI File object of one of ``owner``'s files, or None when they have none by that id."""
        if not FILE_ID.match(file_id):
            return None
        record = self.get_json(self.record_key(owner, file_id))
        if record is not None:
            return file_object_from_record(record)
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.content_key(owner, file_id))
        except self.client.exceptions.ClientError as err:
            if _not_found(err):
                return None
            raise
        return _output_file_object(file_id, head["ContentLength"], head["LastModified"])

    def list_files(self, owner: str, purpose: str | None = None) -> list[dict[str, Any]]:
        """Every file of ``owner``, newest first."""
        found: dict[str, dict[str, Any]] = {}
        records: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.user_prefix(owner), Delimiter="/"):
            for obj in page.get("Contents", []):
                name = obj["Key"].rsplit("/", 1)[-1]
                stem, _, ext = name.partition(".")
                if not FILE_ID.match(stem):
                    continue
                if ext == "jsonl":
                    found[stem] = _output_file_object(stem, obj["Size"], obj["LastModified"])
                elif ext == "json":
                    records.append(stem)
        for file_id in records:
            if file_id in found and (record := self.get_json(self.record_key(owner, file_id))) is not None:
                found[file_id] = file_object_from_record(record)
        files = [f for f in found.values() if purpose is None or f["purpose"] == purpose]
        return sorted(files, key=lambda f: (f["created_at"], f["id"]), reverse=True)

    def upload_usage(self, owner: str) -> tuple[int, int]:
        """How many files ``owner`` uploaded and keeps, and their bytes: one listing, no object read.

        An upload is a content object with its record beside it; the batches' output and error
        files (no record) are not counted.
        """
        sizes: dict[str, int] = {}
        records: set[str] = set()
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.user_prefix(owner), Delimiter="/"):
            for obj in page.get("Contents", []):
                stem, _, ext = obj["Key"].rsplit("/", 1)[-1].partition(".")
                if ext == "jsonl":
                    sizes[stem] = int(obj["Size"])
                elif ext == "json":
                    records.add(stem)
        uploads = [size for stem, size in sizes.items() if stem in records and FILE_ID.match(stem)]
        return len(uploads), sum(uploads)

    def content(self, owner: str, file_id: str) -> Iterator[bytes] | None:
        """The bytes of one of ``owner``'s files, in chunks; None when there is no such file."""
        if not FILE_ID.match(file_id):
            return None
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.content_key(owner, file_id))["Body"]
        except self.client.exceptions.ClientError as err:
            if _not_found(err):
                return None
            raise
        return _chunks(body)

    def delete_file(self, owner: str, file_id: str) -> bool:
        """Delete one of ``owner``'s files; return whether there was one."""
        if self.file_object(owner, file_id) is None:
            return False
        self.client.delete_object(Bucket=self.bucket, Key=self.content_key(owner, file_id))
        self.client.delete_object(Bucket=self.bucket, Key=self.record_key(owner, file_id))
        return True

    # -- small JSON objects ----------------------------------------------------------

    def put_json(self, key: str, value: Any) -> None:
        self.client.put_object(
            Bucket=self.bucket, Key=key, Body=json.dumps(value).encode(), ContentType="application/json"
        )

    def get_json(self, key: str) -> Any:
        """The JSON object at ``key``, or None when there is none."""
        try:
            return json.loads(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        except self.client.exceptions.ClientError as err:
            if _not_found(err):
                return None
            raise


def _chunks(body: Any) -> Iterator[bytes]:
    try:
        yield from body.iter_chunks(CHUNK_BYTES)
    finally:
        body.close()


def _not_found(err: Any) -> bool:
    return str(err.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey", "NotFound")


def file_object_from_record(record: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI File object of an upload's record."""
    return {
        "id": record["id"],
        "object": "file",
        "bytes": int(record["bytes"]),
        "created_at": int(record["created_at"]),
        "filename": record["filename"],
        "purpose": record.get("purpose", "batch"),
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def _output_file_object(file_id: str, size: int, modified: Any) -> dict[str, Any]:
    created = int(modified.timestamp()) if hasattr(modified, "timestamp") else int(time.time())
    return file_object_from_record(
        {
            "id": file_id,
            "bytes": size,
            "created_at": created,
            "filename": f"{file_id}.jsonl",
            "purpose": "batch_output",
        }
    )
