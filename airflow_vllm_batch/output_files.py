"""The files a batch publishes beside its output, and streaming reads of S3 objects.

One output ``s3://b/k/results.jsonl`` comes with ``s3://b/k/results.errors.jsonl``
(failed lines) and ``s3://b/k/results.manifest.json`` (written last). The single
operator and the shard merge both name them here, so they always agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from airflow.providers.amazon.aws.hooks.s3 import S3Hook

from airflow_vllm_batch.batchfile import open_lines


def output_stem(output_uri: str) -> str:
    """The output URI without its ``.jsonl`` ending."""
    return output_uri.removesuffix(".jsonl")


def default_error_uri(output_uri: str) -> str:
    """Where failed lines go when no ``error_uri`` is given: ``<stem>.errors.jsonl``."""
    return f"{output_stem(output_uri)}.errors.jsonl"


def manifest_uri(output_uri: str) -> str:
    """Where the manifest is written, last: ``<stem>.manifest.json``."""
    return f"{output_stem(output_uri)}.manifest.json"


@contextlib.contextmanager
def s3_body(hook: S3Hook, bucket: str, key: str) -> Iterator[Any]:
    """Open an object's streaming body; close it on exit."""
    body = hook.get_key(key, bucket_name=bucket).get()["Body"]
    try:
        yield body
    finally:
        body.close()


@contextlib.contextmanager
def s3_lines(hook: S3Hook, bucket: str, key: str) -> Iterator[Iterator[bytes]]:
    """Stream an object's lines (bytes, no newline) without holding it in memory."""
    with s3_body(hook, bucket, key) as body, open_lines(body) as lines:
        yield lines
