"""Split a big batch into shards for dynamic task mapping, and merge the shards' results.

A batch of millions of requests runs as many ``VLLMBatchOperator`` tasks, one per
shard, spread by Airflow over the GPU workers, each retried on its own::

    split = VLLMBatchSplitOperator(task_id="split", input_uri=..., shard_prefix=PREFIX + "/shards/")
    inference = VLLMBatchOperator.partial(task_id="vllm_batch", model=M, queue="gpu").expand_kwargs(split.output)
    merge = VLLMBatchMergeOperator(task_id="merge", shard_manifests=inference.output, output_uri=PREFIX + "/results.jsonl")

A retry redoes only what is missing: the split finds the shards an earlier try
uploaded (same content, same SHA-256) and leaves them untouched, so their ETags stay
the same, and ``VLLMBatchOperator`` (``resume=True``) returns the manifest of a shard
that is already complete instead of starting the engine again; the merge returns a merged
output already complete for the same shard manifests without writing it again.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from airflow.providers.amazon.aws.operators.base_aws import AwsBaseOperator
from airflow.providers.amazon.aws.utils.mixins import aws_template_fields
from botocore.exceptions import ClientError

from airflow_vllm_batch.batchfile import open_lines, redact_url
from airflow_vllm_batch.exceptions import InputChangedError, VLLMBatchError
from airflow_vllm_batch.lease import LeaseHolder
from airflow_vllm_batch.manifest import Manifest, RequestCounts, Usage, schema_version
from airflow_vllm_batch.operators.task_try import task_try
from airflow_vllm_batch.run.cost import sum_costs
from airflow_vllm_batch.sharding import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_REQUESTS,
    MAX_LINE_BYTES,
    Shard,
    ShardingError,
    check_merged_counts,
    merge_results,
    merged_shards_key,
    missing_shards,
    shard_index,
    shard_name,
    split_lines,
    sum_manifests,
)
from airflow_vllm_batch.storage.merged_output import (
    AlreadyMerged,
    MergedOutputStore,
    MergeIdentity,
    merged_fingerprint,
)
from airflow_vllm_batch.storage.s3 import error_code, s3_body, split_s3_uri
from airflow_vllm_batch.version_compat import AirflowFailException

if TYPE_CHECKING:
    from airflow.sdk import Context

#: User metadata key holding a shard's SHA-256, how a retry recognises its shards.
SHA256_METADATA = "sha256"
#: A shard's results sit beside it: ``shard-00000.jsonl`` -> ``shard-00000.results.jsonl``.
RESULTS_SUFFIX = ".results.jsonl"

_SHARD_KEY = re.compile(r"^shard-(\d{5,})\.")


class VLLMBatchSplitOperator(AwsBaseOperator[S3Hook]):
    """Split a batch file into shards in S3 and return one ``VLLMBatchOperator`` kwargs dict per shard.

    Streams the input (never whole in memory), writes each shard to a temporary
    file and uploads it as ``<shard_prefix>shard-00000.jsonl``, ``shard-00001.jsonl``,
    ... (multipart for large shards). The return value feeds
    ``VLLMBatchOperator.partial(...).expand_kwargs(...)``::

        [{"input_uri": "s3://b/p/shards/shard-00000.jsonl",
          "output_uri": "s3://b/p/shards/shard-00000.results.jsonl"}, ...]

    The split is deterministic: the same input and limits give the same shards,
    byte for byte. A shard already in S3 with the same content (SHA-256 in its
    metadata) is not uploaded again, so its ETag, which the inference task's resume
    check compares, stays the same across retries. Shard objects left by an earlier
    split into more shards are removed. Blank lines are dropped; every request line
    keeps its bytes; a line larger than ``max_bytes`` gets a shard of its own.

    :param input_uri: the batch file: ``s3://bucket/key``, or a local path or http(s)
        URL readable by the worker. (templated)
    :param shard_prefix: ``s3://bucket/prefix/`` for the shards and their results;
        make it specific to the run, e.g. ``s3://b/batches/{{ run_id }}/shards/`` (the ``:``
        and ``+`` of a run id are fine in an S3 key). (templated)
    :param max_requests: the most requests in a shard. Default 20,000 (see
        :data:`airflow_vllm_batch.sharding.DEFAULT_MAX_REQUESTS` for why). (templated)
    :param max_bytes: the most input bytes in a shard. Default 256 MiB. (templated)
    :param aws_conn_id: the Airflow AWS connection (``AwsBaseOperator``'s, with ``region_name``,
        ``verify`` and ``botocore_config``). Default ``aws_default``.
    """

    aws_hook_class = S3Hook
    template_fields: Sequence[str] = aws_template_fields(
        "input_uri", "shard_prefix", "max_requests", "max_bytes"
    )
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        input_uri: str,
        shard_prefix: str,
        max_requests: int | str = DEFAULT_MAX_REQUESTS,
        max_bytes: int | str = DEFAULT_MAX_BYTES,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.input_uri = input_uri
        self.shard_prefix = shard_prefix
        self.max_requests = max_requests
        self.max_bytes = max_bytes

    def execute(self, context: Context) -> list[dict[str, str]]:
        with _fail_without_retry_on_mistakes():
            bucket, prefix = _parse_prefix(self.shard_prefix)
            with tempfile.TemporaryDirectory(prefix="vllm-batch-split-") as tmp:
                shards = self.split_and_upload(Path(tmp) / "shard.jsonl", bucket, prefix)
            if not shards:
                raise ShardingError(f"{self.input_uri} has no request line: nothing to split.")
            self.remove_stale_shards(bucket, prefix, len(shards))
        requests = sum(s.requests for s in shards)
        self.log.info(
            "Split %s into %d shard(s), %d requests, under s3://%s/%s",
            self.input_uri,
            len(shards),
            requests,
            bucket,
            prefix,
        )
        return [self.shard_kwargs(bucket, prefix, shard) for shard in shards]

    def split_and_upload(self, scratch: Path, bucket: str, prefix: str) -> list[Shard]:
        """Write each shard to ``scratch`` and upload it before the next one is written."""

        def open_shard(index: int):
            return open(scratch, "wb")

        shards = []
        with self._open_input() as lines:
            for shard in split_lines(
                lines, open_shard, max_requests=int(self.max_requests), max_bytes=int(self.max_bytes)
            ):
                self.upload_shard(scratch, bucket, prefix + shard_name(shard.index), shard)
                shards.append(shard)
        return shards

    def upload_shard(self, path: Path, bucket: str, key: str, shard: Shard) -> None:
        """Upload one shard, unless the same content is already there (keeping its ETag)."""
        head = self.hook.head_object(key, bucket_name=bucket)
        if (
            head
            and head.get("ContentLength") == shard.size
            and head.get("Metadata", {}).get(SHA256_METADATA) == shard.sha256
        ):
            self.log.info(
                "Shard %d (%d requests, lines %d...) already in s3://%s/%s: kept",
                shard.index,
                shard.requests,
                shard.first_line,
                bucket,
                key,
            )
            return
        # S3Hook.load_file takes no per-object metadata; this is its own call with it added.
        self.hook.get_conn().upload_file(
            str(path),
            bucket,
            key,
            ExtraArgs={**self.hook.extra_args, "Metadata": {SHA256_METADATA: shard.sha256}},
            Config=self.hook.transfer_config,
        )
        self.log.info(
            "Shard %d (%d requests, %d bytes, lines %d...) uploaded to s3://%s/%s",
            shard.index,
            shard.requests,
            shard.size,
            shard.first_line,
            bucket,
            key,
        )

    def remove_stale_shards(self, bucket: str, prefix: str, count: int) -> None:
        """Delete shards (and their results) numbered ``count`` or more, left by a split into more shards."""
        keys = self.hook.list_keys(bucket_name=bucket, prefix=prefix) or []
        stale = [k for k in keys if (m := _SHARD_KEY.match(k[len(prefix) :])) and int(m.group(1)) >= count]
        if stale:
            self.log.info("Removing %d object(s) of shards beyond the %d of this split", len(stale), count)
            self.hook.delete_objects(bucket=bucket, keys=stale)

    @staticmethod
    def shard_kwargs(bucket: str, prefix: str, shard: Shard) -> dict[str, str]:
        """The ``VLLMBatchOperator`` arguments of one shard."""
        key = prefix + shard_name(shard.index)
        return {
            "input_uri": f"s3://{bucket}/{key}",
            "output_uri": f"s3://{bucket}/{key.removesuffix('.jsonl')}{RESULTS_SUFFIX}",
        }

    @contextlib.contextmanager
    def _open_input(self) -> Iterator[Iterator[bytes]]:
        if self.input_uri.startswith("s3://"):
            bucket, key = S3Hook.parse_s3_url(self.input_uri)
            with (
                s3_body(self.hook, bucket, key) as body,
                open_lines(body, max_line_bytes=MAX_LINE_BYTES) as lines,
            ):
                yield lines
        else:
            with open_lines(self.input_uri, max_line_bytes=MAX_LINE_BYTES) as lines:
                yield lines


class VLLMBatchMergeOperator(AwsBaseOperator[S3Hook]):
    """Concatenate the shards' results and error files in shard order; write the batch's manifest.

    Streams each shard's result file from S3 into a temporary file (each line's bytes
    kept, newline-terminated) and publishes it to ``output_uri`` with the same protocol as
    ``VLLMBatchOperator`` (:meth:`airflow_vllm_batch.storage.publishing.OutputStore.publish`): a
    tombstone replaces the old manifest first, the results and the error file follow, the manifest
    (``<output stem>.manifest.json``) comes last, so its presence means the merged files
    are complete. Returns it::

        {"output_uri", "error_uri", "input_uri", "input_etag", "model",
         "request_counts", "usage", "duration_s", "engine_duration_s", "vllm_version",
         "fingerprint", "manifest_uri", "shards", "shard_duration_s",
         "max_shard_duration_s", "merge_duration_s", "shard_manifest_uris", "cost", "identity"}

    ``duration_s`` is the compute spent (the shards' durations plus the merge), not
    the wall time, which depends on how many workers ran the shards at once.
    ``fingerprint`` is a hash of the shards' fingerprints, in shard order. ``cost`` adds up
    the shards' costs (:func:`~airflow_vllm_batch.run.cost.sum_costs`; absent when a shard has none).
    ``identity`` holds ``merged_shards``, a hash of the shard manifests
    (:func:`~airflow_vllm_batch.sharding.merged_shards_key`), and ``publish_id``, random per try.

    A merge whose output is already complete for these very shard manifests (same
    ``fingerprint`` and ``merged_shards``, its files at the ETags it names) returns that
    manifest and writes nothing, as ``VLLMBatchOperator`` returns a complete output of its run:
    checked before merging and again under the lease, on the manifest the publish pins
    (:class:`MergedOutputStore`; see docs/protocol.md). A shard published again is another
    merge: it publishes.

    Nothing is published unless the merge is the whole batch: a shard without a manifest
    (its mapped task failed or was skipped and the merge ran anyway, through a
    ``trigger_rule``) and a shard whose files hold other line counts than its manifest's
    ``request_counts`` fail the task, naming the shards, without retries (every try would
    fail the same way). The output's lease is held while publishing, as
    ``VLLMBatchOperator`` holds it, and checked again before the manifest is written.

    :param shard_manifests: the shards' manifests in shard order, normally the mapped
        ``VLLMBatchOperator``'s ``.output``. (templated)
    :param output_uri: ``s3://bucket/key`` of the merged results. (templated)
    :param error_uri: where the merged error lines go. Default: the output key with
        ``.jsonl`` replaced by ``.errors.jsonl``. (templated)
    :param input_uri: the unsplit input, recorded in the manifest (with its ETag when
        in S3). Default: none. (templated)
    :param aws_conn_id: the Airflow AWS connection (``AwsBaseOperator``'s, with ``region_name``,
        ``verify`` and ``botocore_config``). Default ``aws_default``.
    """

    aws_hook_class = S3Hook
    template_fields: Sequence[str] = aws_template_fields(
        "shard_manifests", "output_uri", "error_uri", "input_uri"
    )
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        shard_manifests: Any,
        output_uri: str,
        error_uri: str | None = None,
        input_uri: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.shard_manifests = shard_manifests
        self.output_uri = output_uri
        self.error_uri = error_uri
        self.input_uri = input_uri

    @cached_property
    def store(self) -> MergedOutputStore:
        """The merged output's objects in S3, named and published as a single run's are."""
        return MergedOutputStore(self.hook, self.output_uri, self.error_uri)

    def execute(self, context: Context) -> dict[str, Any]:
        with _fail_without_retry_on_mistakes():
            started = time.monotonic()
            manifests = self.collect_manifests()
            self.check_no_shard_missing(manifests)
            summary = sum_manifests(manifests)
            self.store.merge = MergeIdentity(merged_fingerprint(manifests), merged_shards_key(manifests))
            manifest = self.published()
            if manifest is None:
                with tempfile.TemporaryDirectory(prefix="vllm-batch-merge-") as tmp:
                    results, errors = self.merge_files(manifests, Path(tmp))
                    merged = self.build_manifest(
                        manifests, summary, errors is not None, time.monotonic() - started
                    )
                    manifest = self.publish(merged, results, errors, context)
                if manifest is merged:
                    self.log.info("Merged %d shard(s) into %s", len(manifests), self.output_uri)
        context["ti"].xcom_push(key="output_uri", value=self.output_uri)
        return manifest.to_dict()

    def published(self) -> Manifest | None:
        """The manifest of a merged output of these very shard files, complete, if there is one (checked before the lease).

        Saves a retry after a merge whose success was lost the whole merge; the same check runs
        again under the lease, on the manifest the publish pins (:class:`MergedOutputStore`).
        """
        manifest, why = self.store.completed_merge()
        if manifest is None:
            self.log.info("Merging: %s.", why)
            return None
        self._not_again(why)
        return manifest

    def _not_again(self, why: str) -> None:
        self.log.info(
            "Not merging again: %s (%s). Delete that manifest to merge the shards anew.",
            why,
            self.store.manifest_uri,
        )

    def collect_manifests(self) -> list[dict[str, Any]]:
        """The shards' manifests as a list, in shard (map index) order; every one must be a published manifest."""
        given = _by_index(self.shard_manifests or [])
        if not given:
            raise ShardingError("No shard manifests to merge: did the mapped inference task run?")
        absent = [i for i, m in enumerate(given) if m is None]
        if absent:
            raise ShardingError(
                f"The shard(s) at map index {absent} have no manifest: their inference task did not publish "
                "(failed, skipped or upstream failed). Nothing was merged; clear those tasks, then the merge."
            )
        incomplete = [i for i, m in enumerate(given) if not isinstance(m, dict) or not m.get("output_uri")]
        if incomplete:
            raise ShardingError(
                f"The shard manifest(s) at map index {incomplete} have no output_uri: the inference task of "
                "those shards did not publish. Nothing was merged."
            )
        uncounted = [i for i, m in enumerate(given) if not isinstance(m.get("request_counts"), dict)]
        if uncounted:
            raise ShardingError(
                f"The shard manifest(s) at map index {uncounted} have no request_counts: they are not "
                "VLLMBatchOperator manifests, and the merged files could not be checked against them."
            )
        for index, shard_manifest in enumerate(given):
            schema_version(shard_manifest, f"the shard manifest at map index {index}")
        return given

    def check_no_shard_missing(self, manifests: Sequence[dict[str, Any]]) -> None:
        """Fail when a shard the split made has no manifest (its mapped task pushed none, so it is not even None)."""
        inputs = [str(m.get("input_uri")) for m in manifests]
        folders = {uri.rsplit("/", 1)[0] + "/" for uri in inputs}
        if len(folders) != 1 or any(
            shard_index(uri) is None or not uri.startswith("s3://") for uri in inputs
        ):
            return  # not one split's shards: only the manifests given can be checked
        prefix = folders.pop()
        bucket, key_prefix = _parse_prefix(prefix)
        split_files = self.hook.list_keys(bucket_name=bucket, prefix=key_prefix, delimiter="/") or []
        missing = missing_shards(inputs, split_files)
        if missing:
            raise ShardingError(
                f"The shard(s) at map index {missing} (of the split under {prefix}) have no manifest: their "
                "inference task did not publish (failed, skipped or upstream failed). Nothing was merged; clear "
                "those tasks, then the merge."
            )

    def merge_files(self, manifests: Sequence[dict[str, Any]], tmp: Path) -> tuple[Path, Path | None]:
        """Concatenate the shards' results and error files into ``tmp``; check their lines against the manifests.

        :return: the merged results, and the merged error lines (None when no shard has an error file).
        :raises ShardingError: a shard's files hold other counts than its manifest: nothing is published.
        """
        outputs = [_ShardFile(i, m["output_uri"], m.get("output_etag")) for i, m in enumerate(manifests)]
        results, result_lines = self.concatenate(outputs, tmp / "results.jsonl")
        with_errors = [i for i, m in enumerate(manifests) if m.get("error_uri")]
        error_lines = [0] * len(manifests)
        errors = None
        if with_errors:
            error_files = [
                _ShardFile(i, manifests[i]["error_uri"], manifests[i].get("error_etag")) for i in with_errors
            ]
            errors, merged = self.concatenate(error_files, tmp / "errors.jsonl")
            for shard, lines in zip(with_errors, merged):
                error_lines[shard] = lines
        check_merged_counts(manifests, result_lines, error_lines)
        return results, errors

    def publish(self, manifest: Manifest, results: Path, errors: Path | None, context: Context) -> Manifest:
        """Publish the merged files and the manifest while holding the output's lease (one writer per output).

        The store checks the lease before each of its writes and deletes (Fencing): a merge whose
        lease another run took over changes nothing more. Under the lease, the manifest the publish
        reads first (and pins for its tombstone's ``If-Match``) may already be a complete merge of
        these very shard files: another try of this merge published it since :meth:`published`
        looked. Then nothing is written and that manifest is returned.

        :return: ``manifest``, published; or the complete merged manifest already there.
        """
        assert manifest.fingerprint is not None  # the merge's manifest always has one (merge_manifests)
        with self.store.lease(LeaseHolder.of_try(task_try(context, self.retries), manifest.fingerprint)):
            try:
                self.store.publish(
                    manifest,
                    results_path=results,
                    errors_path=errors,
                )
            except AlreadyMerged as done:
                self._not_again(done.why)
                return done.manifest
        return manifest

    def concatenate(self, files: Sequence[_ShardFile], scratch: Path) -> tuple[Path, list[int]]:
        """Merge the shards' ``files`` (in order) into the local file ``scratch``; return it and each file's line count."""
        with open(scratch, "wb") as out:
            lines = merge_results(self._bodies(files), out)
        self.log.info("Merged %d file(s) into %d lines (%s)", len(files), sum(lines), scratch.name)
        return scratch, lines

    def build_manifest(
        self, manifests: Sequence[dict[str, Any]], summary: dict[str, Any], has_errors: bool, merge_s: float
    ) -> Manifest:
        """The batch's manifest: the shards' sums, in the shape of ``VLLMBatchOperator``'s.

        Its ``identity`` says what it was merged from (``merged_shards``,
        :func:`~airflow_vllm_batch.sharding.merged_shards_key`) and which publish wrote it
        (``publish_id``, random per try): no two tries' manifests are the same bytes, so a write
        conditional on a manifest's ETag read before another try published can never match that
        try's manifest by coincidence (an ABA of the ETag).
        """
        assert self.store.merge is not None  # set by execute before anything is merged
        return Manifest(
            output_uri=self.output_uri,
            error_uri=self.store.error_uri if has_errors else None,
            input_uri=redact_url(self.input_uri)
            if self.input_uri and self.input_uri.startswith("http")
            else self.input_uri,
            input_etag=self._input_etag(),
            model=summary["model"],
            request_counts=RequestCounts(**summary["request_counts"]),
            usage=Usage(**summary["usage"]),
            duration_s=round(summary["shard_duration_s"] + merge_s, 3),
            engine_duration_s=summary["engine_duration_s"],
            vllm_version=summary["vllm_version"],
            fingerprint=self.store.merge.fingerprint,
            identity={"merged_shards": self.store.merge.shards, "publish_id": uuid.uuid4().hex},
            manifest_uri=self.store.manifest_uri,
            shards=summary["shards"],
            shard_duration_s=summary["shard_duration_s"],
            max_shard_duration_s=summary["max_shard_duration_s"],
            merge_duration_s=round(merge_s, 3),
            shard_manifest_uris=summary["shard_manifest_uris"],
            failed_by_reason=summary["failed_by_reason"],
            cost=sum_costs([m.get("cost") for m in manifests], summary["usage"]["total_tokens"]),
            invalid_output=summary["invalid_output"],
            from_cache=summary["from_cache"],
        )

    @property
    def resolved_error_uri(self) -> str:
        """``error_uri``, or the output URI with ``.jsonl`` replaced by ``.errors.jsonl``."""
        return self.store.error_uri

    @property
    def resolved_manifest_uri(self) -> str:
        """``<output stem>.manifest.json``, as ``VLLMBatchOperator`` names it."""
        return self.store.manifest_uri

    def _bodies(self, files: Sequence[_ShardFile]) -> Iterator[Any]:
        """Open each shard file's body in turn, at the ETag its manifest published, closing it before the next one opens.

        Counts alone cannot tell a shard's published file from one another run wrote over it
        with as many lines: the ETag can (as :func:`~airflow_vllm_batch.storage.read_answers` reads).
        """
        for shard in files:
            bucket, key = split_s3_uri(shard.uri, "shard_manifests[].output_uri")
            try:
                with s3_body(self.hook, bucket, key, if_match=shard.etag) as body:
                    yield body
            except InputChangedError:
                raise ShardingError(
                    f"The shard at map index {shard.index} published {shard.uri} with ETag {shard.etag}, but the file "
                    "has changed since. Nothing was merged; clear that shard's inference task, then the merge."
                ) from None
            except ClientError as err:
                if error_code(err) not in ("NoSuchKey", "404"):
                    raise  # throttling, 5xx, access: Airflow's retry may get through
                # Gone for every retry alike (a lifecycle rule, a user's clean-up): no try would find it.
                raise ShardingError(
                    f"The shard at map index {shard.index} published {shard.uri}, which is gone. Nothing was "
                    "merged; clear that shard's inference task, then the merge."
                ) from None

    def _input_etag(self) -> str | None:
        if not self.input_uri or not self.input_uri.startswith("s3://"):
            return None
        bucket, key = split_s3_uri(self.input_uri, "input_uri")
        head = self.hook.head_object(key, bucket_name=bucket)
        # Unquoted, as VLLMBatchOperator records it.
        return head["ETag"].strip('"') if head else None


@dataclass(frozen=True)
class _ShardFile:
    """One shard's published results or error file, and the ETag its manifest recorded (None: an older manifest)."""

    index: int
    uri: str
    etag: str | None


@contextlib.contextmanager
def _fail_without_retry_on_mistakes() -> Iterator[None]:
    """Turn a non-retryable :class:`VLLMBatchError` into ``AirflowFailException``, as ``VLLMBatchOperator`` does."""
    try:
        yield
    except VLLMBatchError as err:
        if not err.retryable:
            # Bad input, a missing shard, counts that disagree: every try fails the same way.
            raise AirflowFailException(str(err)) from err
        raise


def _parse_prefix(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ShardingError(f"shard_prefix must be an s3:// URI, got {uri!r}.")
    bucket, key = S3Hook.parse_s3_url(uri)
    # A prefix is a folder: "…/shards" and "…/shards/" mean the same.
    return bucket, (key.rstrip("/") + "/") if key else ""


def _by_index(values: Sequence[Any]) -> list[Any]:
    """The items of ``values`` read by index up to its length.

    A mapped task's output arrives as Airflow's lazy XCom sequence, whose iterator asks for
    one item past the end to stop, and the Task SDK logs that 404 at error level
    ("XCom not found ... offset=N") on every successful merge.
    """
    return [values[i] for i in range(len(values))]
