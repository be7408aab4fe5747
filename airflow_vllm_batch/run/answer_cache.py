"""The answer cache in S3: requests answered before are answered again without the engine.

With ``answer_cache_uri="s3://bucket/prefix/"`` a run splits its requests before the engine
starts (:meth:`AnswerCache.split`): a request whose key (:mod:`airflow_vllm_batch.batchfile.cache_keys`)
has a stored answer is answered from the cache, with the request's own ``custom_id``; only
the misses reach the engine. After the run published, the engine's new successful answers
go into the cache (:meth:`AnswerCache.store`). The layout::

    <answer_cache_uri><model identity digest>/<p>/<run>-<token>.tsv

``<p>`` is the key's first hex digit (16 partitions), ``<run>`` the run identity's short form;
each line is ``<key>\\t<result line>``, the result line byte for byte as it was published
(only HTTP 200 answers, never errors).

Memory stays flat for millions of keys: the requests' keys, the hits and the misses' keys
live in a SQLite file in the try's scratch directory, the cache objects are streamed line
by line, and only the lines whose key a request wants are kept.

A retry of the same run (after an engine crash) must give the engine the same misses as
the first try, whose staged answers it resumes: the hits are staged with the run
(``<run staging>/cached-results.jsonl``, also when empty) before the engine starts, and a
retry takes them from there instead of looking the cache up again.

Failures: a cache that cannot be read fails the try before any engine starts
(:class:`~airflow_vllm_batch.exceptions.LocationError` naming ``answer_cache_uri`` when the
bucket is missing or denied, not retried; :class:`~airflow_vllm_batch.exceptions.StorageUnavailableError`
when S3 cannot be reached, retried). A write to the cache that fails after publishing is
logged as a warning: the published run stands, its answers are only not cached. A stored
line that cannot be read is a miss, with a warning, never an answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from botocore.exceptions import BotoCoreError, ClientError

from airflow_vllm_batch.batchfile import CustomIdIndex, open_lines
from airflow_vllm_batch.batchfile.cache_keys import KEY_HEX, line_key
from airflow_vllm_batch.batchfile.models import decode_custom_id
from airflow_vllm_batch.exceptions import ConfigurationError, StorageUnavailableError
from airflow_vllm_batch.storage.s3 import error_code, location_error, s3_lines

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from airflow_vllm_batch.batchfile import ResultsReport
    from airflow_vllm_batch.engines.base import EngineJob
    from airflow_vllm_batch.log_groups import TaskLog

_HEX = frozenset(b"0123456789abcdef")


#: The cache's hits staged under the run's staging prefix before the engine starts.
CACHED_RESULTS = "cached-results.jsonl"


def split_cache_uri(uri: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://bucket/prefix/`` (the prefix ends with ``/``, or is empty).

    :raises ConfigurationError: naming ``answer_cache_uri`` and the fix.
    """
    bucket, _, prefix = uri.removeprefix("s3://").partition("/") if isinstance(uri, str) else ("", "", "")
    if not isinstance(uri, str) or not uri.startswith("s3://") or not bucket:
        raise ConfigurationError(
            f"answer_cache_uri must be an S3 prefix such as 's3://bucket/answer-cache/', got {uri!r}. "
            "Give an s3:// URI, or None to run without the cache."
        )
    return bucket, prefix if not prefix or prefix.endswith("/") else prefix + "/"


# A near-copy of serving.wire.Usage, left on purpose: the cache sums all three counts of
# answers it stored, and a count that is not a number fails the decode (see that one's note).
class _Usage(msgspec.Struct, gc=False):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _Body(msgspec.Struct, gc=False):
    usage: _Usage | None = None


class _Response(msgspec.Struct, gc=False):
    status_code: int
    body: _Body | None = None


class _Answer(msgspec.Struct, gc=False):
    """What is read of a stored result line: its custom_id, status and usage."""

    custom_id: str
    response: _Response
    error: Any = None


_decode_answer = msgspec.json.Decoder(_Answer).decode


@dataclasses.dataclass(kw_only=True)
class CacheSplit:
    """The requests answered from the cache, and the engine's job for the others.

    :param job: the engine's job: the original one when nothing hit, else one over the misses.
    :param hits: requests answered from the cache.
    :param misses: requests left to the engine.
    :param cached_path: the cached answers (result lines), one per hit.
    :param usage: the tokens the cached answers report.
    """

    job: EngineJob
    hits: int
    misses: int
    cached_path: Path
    usage: dict[str, int]

    def add_to(self, results: ResultsReport, results_path: Path) -> None:
        """Append the cached answers to the checked results and count them as completed.

        The checked results end as the engine's file did, which may be without a final
        newline: one is added first, so that the first cached answer starts a line of its
        own (two answers on one line would be one unreadable line, and counts off by one).
        """
        if not self.hits:
            return
        with open(results_path, "ab") as out, open(self.cached_path, "rb") as cached:
            if _lacks_final_newline(results_path):
                out.write(b"\n")
            while chunk := cached.read(1 << 20):
                out.write(chunk)
        results.total += self.hits
        results.completed += self.hits
        results.prompt_tokens += self.usage["prompt_tokens"]
        results.completion_tokens += self.usage["completion_tokens"]
        results.total_tokens += self.usage["total_tokens"]


class AnswerCache:
    """One run's use of the answer cache: look up before the engine, store after publishing.

    :param hook: the S3 hook of ``aws_conn_id``.
    :param uri: ``answer_cache_uri``.
    :param model_digest: :func:`~airflow_vllm_batch.batchfile.cache_keys.model_identity` of the engine.
    :param sampled: ``answer_cache_sampled``: also cache requests that sample.
    :param resume: take the hits an earlier try of this run staged.
    :param log: the task's logger.
    """

    def __init__(
        self, hook: S3Hook, uri: str, *, model_digest: str, sampled: bool, resume: bool, log: TaskLog
    ) -> None:
        self.hook = hook
        self.uri = uri
        self.bucket, prefix = split_cache_uri(uri)
        self.model_prefix = f"{prefix}{model_digest}/"
        self.model_digest = model_digest
        self.sampled = sampled
        self.resume = resume
        self.log = log
        self.db: sqlite3.Connection | None = None
        self.spills: dict[str, Path] = {}
        self.run_short = ""

    # -- before the engine ----------------------------------------------------------------

    def split(self, job: EngineJob) -> CacheSplit:
        """Answer what the cache holds; return the engine's job over the rest.

        :raises LocationError: the cache's bucket is missing or denied (not retried).
        :raises StorageUnavailableError: S3 failed or could not be reached (retried).
        """
        self.run_short = job.identity.short
        db = self.db = _open_db(job.work / "answer-cache.sqlite")
        cacheable = self.index_requests(job, db)
        cached_path = job.work / CACHED_RESULTS
        hits_key = f"{job.staging.prefix}{CACHED_RESULTS}"
        staging = job.staging
        if self.resume and staging.hook.head_object(hits_key, bucket_name=staging.bucket) is not None:
            self.log.info(
                "Answer cache: taking the hits an earlier try of this run staged at %s.",
                staging.uri(hits_key),
            )
            with s3_lines(staging.hook, staging.bucket, hits_key) as lines:
                db.executemany(
                    "INSERT OR IGNORE INTO hit VALUES (?, ?)",
                    ((decode_custom_id(raw).custom_id, bytes(raw)) for raw in lines if raw.strip()),
                )
        elif cacheable:
            try:
                self.look_up(db)
            except ClientError as err:
                raise location_error("answer_cache_uri", self.bucket, err, self.hook.aws_conn_id) from None
            except BotoCoreError as err:
                raise StorageUnavailableError(
                    f"answer_cache_uri: cannot reach S3 ({err}). Nothing was run; the task is retried."
                ) from err
        usage = _write_hits(db, cached_path)
        # Staged even when empty: a retry must split the same way as the try whose answers it resumes.
        staging.put_file(cached_path, hits_key)
        hits = db.execute("SELECT count(*) FROM hit").fetchone()[0]
        total = job.report.valid_lines
        self.log.info(
            "Answer cache %s: %d of %d requests answered from the cache (%d cacheable), %d left to the engine.",
            self.uri,
            hits,
            total,
            cacheable,
            total - hits,
        )
        if not hits:
            return CacheSplit(job=job, hits=0, misses=total, cached_path=cached_path, usage=usage)
        return CacheSplit(
            job=self.misses_job(job, db, hits),
            hits=hits,
            misses=total - hits,
            cached_path=cached_path,
            usage=usage,
        )

    def index_requests(self, job: EngineJob, db: sqlite3.Connection) -> int:
        """Key every cacheable request (the lines the engine would read); return how many are cacheable."""
        digest, sampled = self.model_digest, self.sampled

        def keyed() -> Iterator[tuple[str, str]]:
            for raw in lines:
                if raw.strip():
                    custom_id, key = line_key(digest, raw, sampled=sampled)
                    if key is not None:
                        yield custom_id, key

        with job.request_lines() as lines:
            db.executemany("INSERT INTO req VALUES (?, ?)", keyed())
        # Indexed once filled: sorting once is cheaper than keeping two B-trees ordered on every insert.
        db.execute("CREATE INDEX req_custom_id ON req (custom_id)")
        db.execute("CREATE INDEX req_key ON req (key)")
        count: int = db.execute("SELECT count(*) FROM req").fetchone()[0]
        return count

    def look_up(self, db: sqlite3.Connection) -> None:
        """Stream the wanted partitions' objects; keep the answers whose key a request has."""
        wanted = {row[0] for row in db.execute("SELECT DISTINCT substr(key, 1, 1) FROM req")}
        paginator = self.hook.get_conn().get_paginator("list_objects_v2")
        objects = [
            item["Key"]
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.model_prefix)
            for item in page.get("Contents", [])
        ]
        unreadable = 0
        for key in objects:
            if key[len(self.model_prefix) : len(self.model_prefix) + 1] not in wanted:
                continue
            try:
                with s3_lines(self.hook, self.bucket, key) as lines:
                    unreadable += self.take_answers(db, lines)
            except ClientError as err:
                if error_code(err) not in ("NoSuchKey", "404"):  # gone since the listing: nothing to take
                    raise
        if unreadable:
            self.log.warning(
                "Answer cache: %d stored line(s) under %s could not be read; their requests go to the engine.",
                unreadable,
                f"s3://{self.bucket}/{self.model_prefix}",
            )

    @staticmethod
    def take_answers(db: sqlite3.Connection, lines: Iterator[bytes]) -> int:
        """Keep the lines of one cache object that answer a request; return how many lines were unreadable."""
        unreadable = 0
        for raw in lines:
            key, tab, line = raw.partition(b"\t")
            if not tab or len(key) != KEY_HEX or not _HEX.issuperset(key):
                unreadable += bool(raw.strip())
                continue
            wanted = db.execute("SELECT custom_id FROM req WHERE key = ?", (key.decode(),)).fetchall()
            if not wanted:
                continue
            try:
                answer = _decode_answer(line)
            except (msgspec.DecodeError, msgspec.ValidationError):
                answer = None
            if answer is None or answer.response.status_code != 200 or answer.error is not None:
                unreadable += 1
                continue
            for (custom_id,) in wanted:
                db.execute(
                    "INSERT OR IGNORE INTO hit VALUES (?, ?)",
                    (custom_id, _with_custom_id(line, answer.custom_id, custom_id)),
                )
        return unreadable

    def misses_job(self, job: EngineJob, db: sqlite3.Connection, hits: int) -> EngineJob:
        """The engine's job over the requests the cache did not answer (``work/input.jsonl``, replaced)."""
        misses = CustomIdIndex()
        path = job.work / "misses.jsonl"
        count = 0
        with job.request_lines() as lines, open(path, "wb") as out:
            for raw in lines:
                if not raw.strip():
                    continue
                custom_id = decode_custom_id(raw).custom_id
                if db.execute("SELECT 1 FROM hit WHERE custom_id = ?", (custom_id,)).fetchone():
                    continue
                count += 1
                out.write(raw)
                out.write(b"\n")
                misses.add(custom_id, count)
        os.replace(path, job.work / "input.jsonl")
        report = dataclasses.replace(
            job.report,
            total_lines=count,
            valid_lines=count,
            blank_lines=0,
            custom_ids=misses,
            answered_from_cache=hits,
        )
        return dataclasses.replace(job, report=report)

    # -- after publishing -----------------------------------------------------------------

    def collect(self, results_path: Path) -> int:
        """Sort the engine's successful answers of cacheable requests into one local file per partition; return how many.

        :param results_path: the checked results (HTTP 200 lines only), before the cached answers are added.
        """
        assert self.db is not None
        spill_dir = results_path.parent / "answer-cache-new"
        spill_dir.mkdir(exist_ok=True)
        count = 0
        with contextlib.ExitStack() as stack, open_lines(str(results_path)) as lines:
            files: dict[str, Any] = {}
            for raw in lines:
                if not raw.strip():
                    continue
                row = self.db.execute(
                    "SELECT key FROM req WHERE custom_id = ?", (decode_custom_id(raw).custom_id,)
                ).fetchone()
                if row is None:
                    continue
                key = row[0]
                out = files.get(key[0])
                if out is None:
                    self.spills[key[0]] = spill_dir / key[0]
                    out = files[key[0]] = stack.enter_context(open(spill_dir / key[0], "wb"))
                out.write(key.encode() + b"\t" + raw + b"\n")
                count += 1
        return count

    def store(self) -> None:
        """Upload the collected answers, one object per partition; a failure is a warning (the run is published)."""
        token = uuid.uuid4().hex[:8]
        try:
            for part, path in sorted(self.spills.items()):
                with open(path, "rb") as body:
                    key = f"{self.model_prefix}{part}/{self.run_short}-{token}.tsv"
                    self.hook.get_conn().put_object(Bucket=self.bucket, Key=key, Body=body)
        except (BotoCoreError, ClientError, OSError) as err:
            self.log.warning(
                "Answer cache: the new answers could not be stored under %s (%s). The run is published; a later run "
                "sends these requests to the engine again.",
                self.uri,
                err,
            )
        finally:
            if self.db is not None:
                self.db.close()


def _open_db(path: Path) -> sqlite3.Connection:
    """A scratch SQLite file: no journal, no fsync (it dies with the try's scratch directory)."""
    # The default isolation level opens one transaction for a run of inserts (autocommit would commit each).
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode = OFF")
    db.execute("PRAGMA synchronous = OFF")
    # custom_ids are unique (preflight refuses repeats).
    db.execute("CREATE TABLE req (custom_id TEXT NOT NULL, key TEXT NOT NULL)")
    db.execute("CREATE TABLE hit (custom_id TEXT PRIMARY KEY, line BLOB NOT NULL) WITHOUT ROWID")
    return db


def _with_custom_id(line: bytes, stored: str, custom_id: str) -> bytes:
    """The stored line with the request's custom_id: its bytes unchanged when the custom_id is the same."""
    if stored == custom_id:
        return bytes(line)
    decoded = msgspec.json.decode(line)
    decoded["custom_id"] = custom_id
    return msgspec.json.encode(decoded)


def _lacks_final_newline(path: Path) -> bool:
    """Whether the file at ``path`` is not empty and its last byte is not a newline."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _write_hits(db: sqlite3.Connection, path: Path) -> dict[str, int]:
    """Write the hits' answers to ``path``; return the tokens they report."""
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    with open(path, "wb") as out:
        for (line,) in db.execute("SELECT line FROM hit"):
            out.write(line)
            out.write(b"\n")
            body = _decode_answer(line).response.body
            if body is not None and body.usage is not None:
                usage["prompt_tokens"] += body.usage.prompt_tokens
                usage["completion_tokens"] += body.usage.completion_tokens
                usage["total_tokens"] += body.usage.total_tokens
    return usage
