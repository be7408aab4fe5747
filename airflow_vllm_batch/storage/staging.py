"""One run's staging prefix in S3: the finished results, checkpoint parts, engine deaths and the cleaned input its tries share.

The runner engine's finished results reach ``<run>/results.jsonl`` before they are checked
or published, so a retry on any worker (or pod) finds them there and publishes them without
running the engine again. The server engine checkpoints as it goes instead: each sealed
part of its journal goes to ``<run>/parts/``, a retry on any worker skips the requests
those parts answer, and the results check reads the parts in order (no assembled file).
The layout is :mod:`~airflow_vllm_batch.storage.layout`'s; every write and delete here is
fenced by the output's lease (:mod:`~airflow_vllm_batch.storage.publishing`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_vllm_batch.storage.s3 import copy_object, delete_keys, s3_lines, upload_file

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

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

        def lines() -> Generator[bytes, None, None]:
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

    def adopt(self, other: RunStaging) -> int:
        """Copy another run's durable answers (its parts and staged results) here as parts of this run; return how many.

        For a write-once output whose run identity changed between tries (an OpenAI API batch
        retried on a worker with another vLLM): the answers earlier tries made durable stay
        answers of the batch, so this run resumes from them and publishes them. Server side,
        fenced, idempotent (each copy's key is named after its source: a retry copies onto the
        same keys); the other run's objects are left as they are.

        :param other: the staging of another identity of the same output.
        """
        short = other.prefix.rstrip("/").rsplit("/", 1)[-1]
        copies = [
            (key, f"part-{int(m.group(1)):06d}-{m.group(2) or ''}r{short}.jsonl")
            for key in other.list_parts()
            if (m := _PART_NAME.search(key))
        ]
        if other.has_results():
            copies.append((other.results_key, f"part-000000-r{short}.jsonl"))
        for source, name in copies:
            copy_object(self._fenced(), other.bucket, source, self.bucket, self.part_key(name))
        return len(copies)

    def remove(self) -> None:
        """Delete everything under this run's prefix (and nothing under anyone else's)."""
        keys = self.hook.list_keys(bucket_name=self.bucket, prefix=self.prefix) or []
        if keys:
            delete_keys(self._fenced(), self.bucket, keys)
