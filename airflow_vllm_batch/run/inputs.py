"""The run's input: written from ``requests=``, pinned, read and presigned at its pin, confirmed unchanged."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from airflow.sdk.log import mask_secret
from botocore.exceptions import BotoCoreError, ClientError

from airflow_vllm_batch.batchfile import open_lines, url_secrets
from airflow_vllm_batch.batchfile.requests import batch_file_name, build_batch_file
from airflow_vllm_batch.exceptions import (
    InputChangedError,
    InputNotFoundError,
    PresignError,
    StorageUnavailableError,
)
from airflow_vllm_batch.identity import PinnedInput, local_file_tag
from airflow_vllm_batch.storage.layout import requests_uri
from airflow_vllm_batch.storage.s3 import head_input, location_error, s3_lines, split_s3_uri

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from airflow_vllm_batch.run.settings import BatchSettings

log = logging.getLogger(__name__)


def write_requests(hook: S3Hook, settings: BatchSettings, model_name: str) -> str:
    """Write ``requests`` as a batch file beside the output; return its URI, the run's input.

    The key is the content's hash: a retry with the same requests finds the same object
    (same ETag, same run identity) and does not write it again.

    :raises LocationError: S3 refused the write (AccessDenied, no bucket): retrying cannot help.
    """
    assert settings.requests is not None  # called only for a batch given as requests=
    data = build_batch_file(
        settings.requests,
        model=model_name,
        url=settings.requests_url,
        custom_id=settings.requests_custom_id,
        default_body=settings.default_body,
    )
    uri = requests_uri(settings.output_uri, batch_file_name(data))
    bucket, key = split_s3_uri(uri, "output_uri")
    try:
        if hook.check_for_key(key, bucket):
            log.info("The %d requests are already at %s (an earlier try wrote them).", data.count(b"\n"), uri)
            return uri
        hook.load_bytes(data, key=key, bucket_name=bucket, replace=True)
    except ClientError as err:
        raise location_error("output_uri", bucket, err, hook.aws_conn_id) from None
    log.info("Wrote the %d requests (%d bytes) to %s", data.count(b"\n"), len(data), uri)
    return uri


class BatchInput:
    """One pinned input file: S3 (at its ETag and VersionId), a local file, or an http(s) URL.

    :param hook: the S3 hook.
    :param settings: the run's settings (the connection and the presigned URLs' life).
    :param pinned: what identifies this exact content.
    """

    def __init__(self, hook: S3Hook, settings: BatchSettings, pinned: PinnedInput) -> None:
        self.hook = hook
        self.settings = settings
        self.pinned = pinned

    @classmethod
    def pin(cls, hook: S3Hook, settings: BatchSettings, uri: str) -> BatchInput:
        """Pin ``uri``: its S3 ETag/VersionId, or a local file's size, mtime and hash."""
        if uri.startswith("s3://"):
            head = head_input(hook, uri)
            pinned = PinnedInput(uri, etag=head.etag, version_id=head.version_id, size=head.size)
        elif uri.startswith(("http://", "https://")):
            pinned = PinnedInput(uri)
        elif not os.path.isfile(uri):
            raise InputNotFoundError(
                f"input_uri: no file {uri!r} on worker {os.uname().nodename}. A local input must be on the worker "
                "that runs the task; use an s3:// URI for files written by other tasks. Nothing was run."
            )
        else:
            pinned = PinnedInput(uri, local_file_tag(uri), size=os.path.getsize(uri))
        return cls(hook, settings, pinned)

    @property
    def uri(self) -> str:
        return self.pinned.uri

    @property
    def display_uri(self) -> str:
        """The URI without a query string (an http(s) input's may hold a signature)."""
        return self.pinned.display_uri

    @property
    def in_s3(self) -> bool:
        return self.pinned.uri.startswith("s3://")

    @property
    def withheld(self) -> bool:
        """Whether no engine may be given this input's location: an http(s) URL with user info or a query.

        Such a URL is a credential (*No secrets*): an engine would carry it on its command line and print
        it (vLLM's ``args: Namespace(...)`` and ``Reading batch from ...`` lines). The task reads it
        itself; every engine reads the task's copy (``PreflightReport.location_withheld``).
        """
        return bool(url_secrets(self.uri))

    @contextlib.contextmanager
    def open(self) -> Iterator[Any]:
        """Stream the input's lines; an S3 input is read at its pinned ETag (and VersionId)."""
        if self.in_s3:
            bucket, key = split_s3_uri(self.uri, "input_uri")
            with s3_lines(
                self.hook, bucket, key, if_match=self.pinned.etag, version_id=self.pinned.version_id
            ) as lines:
                yield lines
        else:
            with open_lines(self.uri) as lines:
                yield lines

    def presign(
        self, method: str, bucket: str, key: str, version_id: str | None = None, *, expires_in: int
    ) -> str:
        """A presigned URL for the engine, registered with the secrets masker before anything can log it.

        :param expires_in: seconds it stays valid (:meth:`~airflow_vllm_batch.run.BatchSettings.presign_seconds`).
        """
        params = {"Bucket": bucket, "Key": key}
        if version_id:
            params["VersionId"] = version_id
        url = self.hook.generate_presigned_url(client_method=method, params=params, expires_in=expires_in)
        if not url:
            raise PresignError(
                f"S3Hook could not presign {method} for s3://{bucket}/{key} (connection "
                f"{self.settings.aws_conn_id!r}); see the error above. Check the connection's credentials and region."
            )
        mask_secret(url)
        return url

    def presigned_get(self, *, expires_in: int) -> str:
        """A presigned GET of the pinned input (its VersionId, when the bucket versions), valid ``expires_in`` seconds."""
        bucket, key = split_s3_uri(self.uri, "input_uri")
        return self.presign(
            "get_object", bucket, key, version_id=self.pinned.version_id, expires_in=expires_in
        )

    def confirm_unchanged(self) -> None:
        """Fail when an unversioned S3 input was overwritten while the engine read it by key.

        :raises InputChangedError: its ETag changed (retryable: the next try checks the new content).
        """
        try:
            head = head_input(self.hook, self.uri)
        except (BotoCoreError, ClientError) as err:
            raise StorageUnavailableError(
                f"S3 failed while checking that {self.uri} is unchanged ({err})."
            ) from err
        etag = head.etag
        if etag != self.pinned.etag:
            raise InputChangedError(
                f"{self.uri} was overwritten while the engine ran (ETag {self.pinned.etag} -> {etag}). "
                "Nothing was published; the next try checks and runs the new content."
            )
