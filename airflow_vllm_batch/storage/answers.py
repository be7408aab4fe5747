"""Reading a published batch's answers from S3, pinned to the ETags its manifest names."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

from airflow.providers.amazon.aws.hooks.s3 import S3Hook

from airflow_vllm_batch.batchfile import answers
from airflow_vllm_batch.exceptions import InputChangedError, ResultsCheckError
from airflow_vllm_batch.storage.s3 import open_uri_lines, s3_lines, split_s3_uri


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
