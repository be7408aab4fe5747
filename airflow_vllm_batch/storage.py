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

1. the old manifest is deleted first: from here until step 4 a reader (or a later
   resume) sees *no* complete output rather than an old manifest beside new data;
2. the results go to the output key; 3. the error file is written, or an old one deleted;
4. the manifest is written, last; 5. this run's staging prefix is removed (and nobody
   else's: other runs' staging lives under other prefixes).

The runner engine's finished results reach ``<run>/results.jsonl`` before they are checked
or published, so a retry on any worker (or pod) finds them there and publishes them without
running the engine again. The server engine checkpoints as it goes instead: each sealed
part of its journal goes to ``<run>/parts/``, a retry on any worker skips the requests
those parts answer, and the results check reads the parts in order (no assembled file). ``VLLMBatchOperator`` and ``VLLMBatchMergeOperator`` both use
this module; the object names are made here only.
"""

from __future__ import annotations

import contextlib
import functools
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from airflow.providers.amazon.aws.exceptions import S3HookUriParseFailure
from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from botocore.exceptions import ClientError

from airflow_vllm_batch.batchfile import answers, open_lines
from airflow_vllm_batch.exceptions import (
    InputChangedError,
    InputNotFoundError,
    LocationError,
    StorageUnavailableError,
    VLLMBatchError,
)
from airflow_vllm_batch.identity import RunIdentity
from airflow_vllm_batch.lease import LeaseHolder, OutputLease
from airflow_vllm_batch.manifest import Manifest


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


def error_code(err: ClientError) -> str:
    """The S3 error code of a botocore ``ClientError`` (``NoSuchBucket``, ``AccessDenied``, ...)."""
    return str(err.response.get("Error", {}).get("Code", ""))


@contextlib.contextmanager
def s3_body(hook: S3Hook, bucket: str, key: str, *, if_match: str | None = None, version_id: str | None = None) -> Iterator[Any]:
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
    yield from answers.read_answers(
        source, open_uri=functools.partial(open_uri_lines, hook), errors=errors, output_type=output_type
    )


#: ``part-000123-<try token>.jsonl``: the journal's part number (:func:`airflow_vllm_batch.serving.part_name`)
#: and the token of the try that wrote it, so that two tries never write the same key (a zombie try
#: that lost its lease cannot overwrite its successor's parts). Parts without a token are read too.
_PART_NAME = re.compile(r"part-(\d{6,})(?:-([0-9a-z]+))?\.jsonl$")


class RunStaging:
    """The staging prefix of one run: shared by its tries, removed when it publishes.

    :param hook: the S3 hook.
    :param bucket: the output's bucket.
    :param prefix: ``<output key>.staging/<run>/``.
    """

    def __init__(self, hook: S3Hook, bucket: str, prefix: str) -> None:
        self.hook = hook
        self.bucket = bucket
        self.prefix = prefix

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
        self.hook.load_file(str(path), key=self.results_key, bucket_name=self.bucket, replace=True)

    def open_results(self) -> contextlib.AbstractContextManager[Iterator[bytes]]:
        """Stream the staged results."""
        return s3_lines(self.hook, self.bucket, self.results_key)

    def drop_results(self) -> None:
        """Forget staged results and checkpoint parts that failed the check, so that the next try runs the engine."""
        self.hook.delete_objects(bucket=self.bucket, keys=[self.results_key, *self.list_parts()])

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
        with open(path, "rb") as body:
            name = path.name if not token else path.name.replace(".jsonl", f"-{token}.jsonl")
            self.hook.get_conn().put_object(Bucket=self.bucket, Key=self.part_key(name), Body=body)

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

    # -- the runner engine's deaths (see airflow_vllm_batch.engines.runner_deaths) ---------

    @property
    def deaths_prefix(self) -> str:
        """Where the runner engine records its deaths and their suspects: ``<run>/deaths/``."""
        return f"{self.prefix}deaths/"

    def put_death(self, number: int, token: str, record: bytes) -> None:
        """Record one engine death (JSON) as ``death-<number>-<token>.json``: two tries never write the same key."""
        key = f"{self.deaths_prefix}death-{number:06d}-{token}.json"
        self.hook.get_conn().put_object(Bucket=self.bucket, Key=key, Body=record)

    def read_deaths(self) -> list[bytes]:
        """The recorded deaths, in order."""
        keys = sorted(self.hook.list_keys(bucket_name=self.bucket, prefix=self.deaths_prefix) or [])
        client = self.hook.get_conn()
        return [client.get_object(Bucket=self.bucket, Key=key)["Body"].read() for key in keys]

    def drop_staged_output(self) -> None:
        """Forget the results file a dying runner uploaded (its answers went into a part)."""
        self.hook.delete_objects(bucket=self.bucket, keys=[self.results_key])

    def put_input(self, path: Path) -> str:
        """Upload the cleaned input for the engine; return its URI."""
        self.hook.load_file(str(path), key=self.input_key, bucket_name=self.bucket, replace=True)
        return self.uri(self.input_key)

    def remove(self) -> None:
        """Delete everything under this run's prefix (and nothing under anyone else's)."""
        keys = self.hook.list_keys(bucket_name=self.bucket, prefix=self.prefix) or []
        if keys:
            self.hook.delete_objects(bucket=self.bucket, keys=keys)


class OutputStore:
    """The S3 objects of one batch output: results, error file, manifest, lease and staging.

    :param hook: the S3 hook.
    :param output_uri: ``s3://bucket/key`` of the results.
    :param error_uri: where failed requests go. Default ``<output stem>.errors.jsonl``.
    """

    def __init__(self, hook: S3Hook, output_uri: str, error_uri: str | None = None) -> None:
        self.hook = hook
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
                raise LocationError(_location_message(parameter, bucket, err, self.hook.aws_conn_id)) from None

    def read_manifest(self) -> Manifest | None:
        """The manifest beside the output, or None when there is none (or it is unreadable)."""
        try:
            data = self.hook.get_conn().get_object(Bucket=self.manifest_bucket, Key=self.manifest_key)["Body"].read()
        except ClientError as err:
            code = error_code(err)
            if code in ("NoSuchKey", "404"):
                return None
            if code in ("NoSuchBucket", "AccessDenied", "403"):
                raise LocationError(_location_message("output_uri", self.manifest_bucket, err, self.hook.aws_conn_id)) from None
            raise
        try:
            return Manifest.from_json(data)
        except msgspec.DecodeError:
            return None

    def completed(self, identity: RunIdentity) -> tuple[Manifest | None, str]:
        """Return the published manifest of a run with this identity, if its files are all there.

        :return: the manifest (or None) and one line that says why it was (not) taken.
        """
        manifest = self.read_manifest()
        if manifest is None:
            return None, f"no complete output at {self.output_uri} yet"
        if manifest.fingerprint != identity.fingerprint:
            changed = ", ".join(identity.changes_from(manifest.identity)) or "the fingerprint"
            return None, f"the output at {self.output_uri} was made by a different run (changed: {changed})"
        for uri in filter(None, (manifest.output_uri, manifest.error_uri)):
            bucket, key = split_s3_uri(uri, "output_uri")
            if self.hook.head_object(key, bucket_name=bucket) is None:
                return None, f"the manifest names {uri}, which is gone"
        return manifest, f"the output at {self.output_uri} is complete for this very run"

    def lease(self, holder: LeaseHolder, **kwargs: Any) -> OutputLease:
        """The lease of this output (a context manager); see :mod:`airflow_vllm_batch.lease`."""
        return OutputLease(self.hook.get_conn(), self.bucket, f"{output_stem(self.key)}.lease.json", holder, **kwargs)

    def staging(self, identity: RunIdentity) -> RunStaging:
        """The staging prefix of the run with this identity."""
        return RunStaging(self.hook, self.bucket, f"{self.key}.staging/{identity.short}/")

    # -- publishing --------------------------------------------------------------------

    def publish(
        self,
        manifest: Manifest,
        *,
        staging: RunStaging | None = None,
        results_path: Path | None = None,
        errors_path: Path | None = None,
        before_manifest: Callable[[], None] | None = None,
    ) -> None:
        """Publish results, error file and manifest, in the order the module docstring gives.

        :param manifest: written last.
        :param staging: the run's staging; its results are copied to the output (server side)
            when ``results_path`` is None, and the whole prefix is removed at the end.
        :param results_path: a local results file to upload instead.
        :param errors_path: the failed lines; None deletes an earlier error file.
        :param before_manifest: called right before the manifest is written (the lease check:
            a try that lost the output must not declare it complete).
        """
        self.invalidate_manifest()
        if results_path is not None:
            self.hook.load_file(str(results_path), key=self.key, bucket_name=self.bucket, replace=True)
        elif staging is not None:
            # Managed copy: server side, multipart above 5 GB; no byte passes through the worker.
            self.hook.get_conn().copy({"Bucket": staging.bucket, "Key": staging.results_key}, self.bucket, self.key)
        else:
            raise ValueError("publish needs staging or results_path")
        if errors_path is not None:
            self.hook.load_file(str(errors_path), key=self.error_key, bucket_name=self.error_bucket, replace=True)
        elif self.hook.head_object(self.error_key, bucket_name=self.error_bucket) is not None:
            # A re-run with no failures must not leave an earlier run's error file behind.
            self.hook.delete_objects(bucket=self.error_bucket, keys=[self.error_key])
        if before_manifest is not None:
            before_manifest()
        self.write_manifest(manifest)
        if staging is not None:
            staging.remove()

    def invalidate_manifest(self) -> None:
        """Delete the manifest, first thing before anything beside it changes."""
        self.hook.delete_objects(bucket=self.manifest_bucket, keys=[self.manifest_key])

    def write_manifest(self, manifest: Manifest) -> None:
        """Write the manifest, last."""
        self.hook.load_bytes(manifest.to_json(), key=self.manifest_key, bucket_name=self.manifest_bucket, replace=True)


#: S3 error codes that say the location itself is wrong: the same call fails the same way on a retry.
_LOCATION_CODES = frozenset({"NoSuchBucket", "404", "AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"})


def location_error(parameter: str, bucket: str, err: ClientError, conn_id: str | None) -> VLLMBatchError:
    """The error of a refused S3 call: a :class:`LocationError` (not retried) when the bucket is missing or
    denied, else :class:`StorageUnavailableError` (retried: S3 slowing down or failing for a moment)."""
    if error_code(err) in _LOCATION_CODES:
        return LocationError(_location_message(parameter, bucket, err, conn_id))
    return StorageUnavailableError(f"{parameter}: S3 failed on bucket {bucket!r} ({err}). The task is retried.")


def _location_message(parameter: str, bucket: str, err: ClientError, conn_id: str | None) -> str:
    code = error_code(err)
    if code in ("NoSuchBucket", "404"):
        return f"{parameter}: bucket {bucket!r} does not exist. Create it, or fix {parameter}. Nothing was run."
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
