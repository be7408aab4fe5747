"""Where the engine writes its results before the operator publishes them.

vLLM's batch runner writes its whole output once, at the very end. Two places are
supported, chosen with the operator's ``output_mode``:

``local`` (default)
    The engine writes a file on the worker; the operator checks it there and uploads
    it with S3Hook (multipart, retried by botocore). If S3 is unreachable when the
    upload is due, the file stays in the results directory, and a retry of the task
    on the same worker publishes it *without running the engine again*. This is what
    makes an upload failure lose nothing.

``presigned``
    The engine PUTs its output to a presigned URL of a staging key beside the output,
    for engines that run where the worker's disk is not (another container) and that
    hold no AWS credentials. vLLM tries that PUT five times and then loses the
    results: a retry re-runs inference.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from airflow.providers.amazon.aws.hooks.s3 import S3Hook

from airflow_vllm_batch.batchfile import open_lines
from airflow_vllm_batch.output_files import s3_lines

#: Default parent of the local results directories (one per output, input and model).
DEFAULT_RESULTS_DIR = os.path.join(tempfile.gettempdir(), "airflow-vllm-batch")


class LocalEngineOutput:
    """Results written by the engine to a file on this worker, kept until published.

    The directory is named after what determines the results (output URI, input
    fingerprint, model), so a retry of the same task finds what an earlier try left.

    :param results_dir: parent directory for results kept across tries.
    :param identity: the output URI, the input fingerprint and the model.
    """

    def __init__(self, results_dir: str, *identity: str) -> None:
        digest = hashlib.sha256("\n".join(identity).encode()).hexdigest()[:24]
        self.directory = Path(results_dir) / digest
        self.path = self.directory / "results.jsonl"
        self._partial = self.directory / "results.partial.jsonl"

    @property
    def engine_location(self) -> str:
        """What the engine gets as ``-o``: a path beside the final one, renamed on success."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return str(self._partial)

    def recovered(self) -> bool:
        """True when an earlier try's engine finished and its results were never published."""
        return self.path.exists()

    def engine_finished(self) -> bool:
        """Mark the engine's file complete (it exited 0); False when it wrote nothing."""
        if not self._partial.exists():
            return False
        os.replace(self._partial, self.path)
        return True

    def open_lines(self) -> contextlib.AbstractContextManager[Iterator[bytes]]:
        """Open the results for reading."""
        return open_lines(str(self.path))

    def publish(self, hook: S3Hook, bucket: str, key: str) -> None:
        """Upload the results to ``s3://bucket/key``; the object appears only when complete."""
        hook.load_file(str(self.path), key=key, bucket_name=bucket, replace=True)

    def discard(self) -> None:
        """Remove the local results (after publishing, or when they are not to be trusted)."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def describe(self) -> str:
        return f"{self.path} on {os.uname().nodename}"


class StagedEngineOutput:
    """Results PUT by the engine to a staging key through a presigned URL.

    :param hook: the S3 hook.
    :param bucket: the output's bucket.
    :param key: the staging key the engine writes.
    """

    def __init__(self, hook: S3Hook, bucket: str, key: str) -> None:
        self.hook = hook
        self.bucket = bucket
        self.key = key

    def recovered(self) -> bool:
        return False

    def engine_finished(self) -> bool:
        return self.hook.check_for_key(self.key, bucket_name=self.bucket)

    def open_lines(self) -> contextlib.AbstractContextManager[Iterator[bytes]]:
        return s3_lines(self.hook, self.bucket, self.key)

    def publish(self, hook: S3Hook, bucket: str, key: str) -> None:
        """Server-side copy (managed: multipart above 5 GB) from staging to the final key."""
        hook.get_conn().copy({"Bucket": self.bucket, "Key": self.key}, bucket, key)

    def discard(self) -> None:
        # The staging prefix as a whole is removed by the operator.
        pass

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

