"""Where each object of a batch output lives in S3; the object names are made here only.

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

The staging prefix and what is under it are named by :class:`~airflow_vllm_batch.storage.staging.RunStaging`,
the lease's key by :meth:`~airflow_vllm_batch.storage.publishing.OutputStore.lease`.
"""

from __future__ import annotations


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
