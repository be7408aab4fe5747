"""Split a batch file into shards, merge the shards' results back, sum their manifests.

Plain Python (no Airflow), so the operators, a CLI and the tests share one
implementation. Everything streams: a shard is written line by line to a file the
caller opens, and a merge copies line by line, so neither the input nor the output
is ever held in memory whole.

Why shards: one vLLM run holds its whole input and output in memory, uploads the
output in one PUT (S3 takes at most 5 GB per PUT), and a run that dies at 95% is
redone from the start. Shards are mapped over with Airflow's dynamic task mapping
(``VLLMBatchOperator.partial(...).expand_kwargs(...)``), one engine run each, so
several GPU workers share a batch and a retry redoes only the unfinished shards.

Byte-exactness, by design:

* every request line is written with its bytes exactly as read, plus one ``\\n``
  (a missing final newline in the input is added; ``\\r`` before it is kept);
* blank (whitespace-only) lines are dropped: they carry no request, and vLLM skips
  them too;
* the same input and limits always give the same shards, byte for byte, so a
  retry can recognise (and reuse) the shards an earlier try uploaded;
* a merge writes each result line's bytes exactly, newline-terminated (vLLM
  uploads its output without a final newline), shard after shard, so the merged
  output is in input order.

A single line larger than ``max_bytes`` goes into a shard of its own (the only
case where a shard exceeds ``max_bytes``): splitting is not validation, and the
operator's preflight refuses a line that is too long with a message naming it.
Only a line longer than ``max_line_bytes`` (64 MiB: not a batch file, or one
without newlines) stops the split, because the reader cuts such lines.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import IO, Any

from airflow_vllm_batch.batchfile import open_lines
from airflow_vllm_batch.docs_links import doc_ref
from airflow_vllm_batch.exceptions import ShardingError

#: Requests per shard by default. What bounds a shard is its *output*, which must
#: stay well under S3's 5 GB single-PUT limit (vLLM uploads it in one PUT) and fit
#: in the engine's memory. Output lines are bigger than input lines: a chat result
#: is ~1 KB plus the completion (~4 bytes a token, so ~17 KB at 4096 tokens); an
#: embedding result is the vector as JSON floats, ~21 bytes a dimension: ~8 KB for
#: 384 dimensions (all-MiniLM), ~22 KB for 1024, ~86 KB for 4096 (e5-mistral,
#: Qwen3-Embedding-8B). 20,000 requests x 86 KB = 1.7 GB, a third of the limit for
#: the largest common embedding; 20,000 x 17 KB = 0.35 GB for long chat answers.
#: It also bounds what a retry redoes: minutes, not hours, of GPU time.
DEFAULT_MAX_REQUESTS = 20_000
#: Input bytes per shard by default. vLLM reads its whole input into memory; 256 MiB
#: keeps that modest even with long prompts (at ~2 KB a request, 20,000 requests are
#: ~40 MB, so for ordinary files the request count is what cuts).
DEFAULT_MAX_BYTES = 256 << 20
#: Lines longer than this are cut by the reader, so they cannot be copied exactly.
MAX_LINE_BYTES = 64 << 20

#: A shard's input file at the end of a key or URI (not its ``.results.jsonl``).
_SHARD_FILE = re.compile(r"(?:^|/)shard-(\d{5,})\.jsonl$")

#: Opens the file that shard ``index`` is written to (``open(path, "wb")`` or a BytesIO).
OpenShard = Callable[[int], AbstractContextManager[IO[bytes]]]


@dataclass(frozen=True)
class Shard:
    """One shard written by :func:`split_lines`.

    :param index: 0-based position in the input; shards are numbered without gaps.
    :param requests: request lines in the shard.
    :param size: bytes written, newlines included.
    :param first_line: physical line number (1-based) of its first request in the input.
    :param sha256: hex SHA-256 of the bytes written; equal for equal content, so a
        shard uploaded by an earlier try can be recognised.
    """

    index: int
    requests: int
    size: int
    first_line: int
    sha256: str


def split_lines(
    lines: Iterable[bytes],
    open_shard: OpenShard,
    *,
    max_requests: int = DEFAULT_MAX_REQUESTS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> Iterator[Shard]:
    """Write the request lines into consecutive shards; yield each shard once it is complete.

    A shard ends before the line that would take it past ``max_requests`` lines or
    ``max_bytes`` bytes. The file of shard ``i`` is opened with ``open_shard(i)`` and
    closed before the shard is yielded, so the caller can upload it and reuse one
    temporary file for every shard. An input with no request line yields no shard.

    :param lines: the input's lines without ``\\n``, as from
        :func:`~airflow_vllm_batch.batchfile.open_lines` (open it with
        ``max_line_bytes`` at least ``max_line_bytes + 1`` so a cut line is seen).
    :param open_shard: returns a context manager giving a binary file for shard ``index``.
    :param max_requests: the most request lines in a shard. Default 20,000.
    :param max_bytes: the most bytes in a shard, newlines included; a longer single
        line gets a shard of its own. Default 256 MiB.
    :param max_line_bytes: a longer line stops the split with :class:`ShardingError`.
    """
    max_requests, max_bytes = _check_limits(max_requests, max_bytes)
    index = 0
    writer: _ShardWriter | None = None
    try:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if len(line) > max_line_bytes:
                raise ShardingError(
                    f"Line {number} is longer than {max_line_bytes} bytes: it cannot be copied into a "
                    "shard exactly. Is this a JSONL file with one request per line?"
                )
            size = len(line) + 1
            if writer is not None and (writer.requests >= max_requests or writer.size + size > max_bytes):
                yield writer.close()
                writer = None
                index += 1
            if writer is None:
                writer = _ShardWriter(index, number, open_shard(index))
            writer.write(line)
        if writer is not None:
            yield writer.close()
            writer = None
    finally:
        if writer is not None:
            writer.abandon()


def merge_results(
    sources: Iterable[Any], out: IO[bytes], *, max_line_bytes: int = MAX_LINE_BYTES
) -> list[int]:
    """Concatenate result files into ``out`` in the order given; return the lines written from each.

    Each line's bytes are copied exactly and newline-terminated (vLLM's uploaded
    output has no final newline, which would otherwise glue the last result of one
    shard to the first of the next). Blank lines are dropped. The counts are per
    source so that :func:`check_merged_counts` can name the shard whose file
    disagrees with its manifest.

    :param sources: the shards' result files, in shard order: anything
        :func:`~airflow_vllm_batch.batchfile.open_lines` opens (a local path, a
        binary file-like object such as a botocore ``StreamingBody``).
    :param out: a binary file open for writing.
    :param max_line_bytes: a longer line stops the merge with :class:`ShardingError`
        (the reader would cut it).
    """
    written = []
    for position, source in enumerate(sources):
        count = 0
        with open_lines(source, max_line_bytes=max_line_bytes) as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                if len(line) > max_line_bytes:
                    raise ShardingError(
                        f"Line {number} of shard result {position} is longer than {max_line_bytes} bytes "
                        "and cannot be merged exactly."
                    )
                out.write(line)
                out.write(b"\n")
                count += 1
        written.append(count)
    return written


def check_merged_counts(
    manifests: Sequence[Mapping[str, Any]], result_lines: Sequence[int], error_lines: Sequence[int]
) -> None:
    """Fail unless every shard's files hold the lines its manifest counts.

    ``VLLMBatchOperator`` writes one line per completed request to its results and one
    per failed request (invalid lines it skipped included) to its error file, and counts
    both in ``request_counts``. A shard whose files say otherwise was overwritten after
    its manifest (another run over the same output) or lost its error file; merging it
    would publish a batch that is not the sum of its shards.

    :param manifests: the shards' manifests, in shard order.
    :param result_lines: the result lines merged from each shard, in shard order.
    :param error_lines: the error lines merged from each shard (0 for a shard without an
        error file), in shard order.
    :raises ShardingError: naming each shard that disagrees, and the totals.
    """
    if not len(manifests) == len(result_lines) == len(error_lines):
        raise ValueError("one count of result lines and of error lines per manifest")
    expected = _sum_fields(manifests, "request_counts", ("completed", "failed"))
    disagreeing = []
    for index, (manifest, results, errors) in enumerate(zip(manifests, result_lines, error_lines)):
        counts = manifest.get("request_counts") or {}
        completed, failed = int(counts.get("completed") or 0), int(counts.get("failed") or 0)
        if (results, errors) != (completed, failed):
            disagreeing.append(
                f"shard {index} ({manifest.get('output_uri')}): {results} result line(s) for {completed} "
                f"completed, {errors} error line(s) for {failed} failed"
            )
    if disagreeing:
        raise ShardingError(
            f"The shards' files hold {sum(result_lines)} result and {sum(error_lines)} error line(s), their "
            f"manifests count {expected['completed']} completed and {expected['failed']} failed requests: "
            + "; ".join(disagreeing)
            + ". Nothing was published: clear those shards' inference tasks "
            f"({doc_ref('Troubleshooting', 'A shard changed after its manifest')})."
        )


def missing_shards(input_uris: Sequence[str | None], split_inputs: Iterable[str]) -> list[int]:
    """The numbers of the split's shards that no manifest answers.

    A mapped shard that did not publish (failed, skipped, or upstream failed, with a
    ``trigger_rule`` that runs the merge anyway) pushes no XCom, so its manifest is not
    in the mapped task's ``.output`` at all: the others close ranks. The split's shard
    files are what say how many there should be (the split removes those of an earlier
    split into more shards). Shard ``i`` is map index ``i`` of the mapped task.

    :param input_uris: the manifests' ``input_uri``, in the order given.
    :param split_inputs: the names (or keys, or URIs) of the shard files the split left,
        ``shard-00000.jsonl`` ...; other names are ignored.
    :return: the missing shard numbers, ascending; empty when every shard is answered, or
        when a manifest's input is not a shard file (shards mapped by other means).
    """
    if not input_uris or any(shard_index(uri) is None for uri in input_uris):
        return []
    present = {index for uri in input_uris if (index := shard_index(uri)) is not None}
    made = {index for name in split_inputs if (index := shard_index(name)) is not None}
    # A gap below the highest answered shard is missing too, even when its file is gone.
    return sorted((made | set(range(max(present) + 1))) - present)


def sum_manifests(manifests: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Add up the manifests of the shards of one batch.

    Returns ``model``, ``vllm_version`` (each the shards' common value, or None when
    they differ), ``request_counts`` and ``usage`` summed, ``shards`` (how many),
    ``engine_duration_s`` and ``shard_duration_s`` (summed: the compute spent),
    ``max_shard_duration_s`` (the longest shard: the floor of the wall time however
    many workers run them), ``shard_manifest_uris`` in shard order, ``failed_by_reason``
    summed (None when no request failed), ``invalid_output`` summed (None when no answer
    missed ``output_type``) and ``from_cache`` summed over the shards that used the answer
    cache (None when none did).

    :param manifests: the shards' manifests as returned by ``VLLMBatchOperator``, in shard order.
    """
    if not manifests:
        raise ShardingError(
            "No shard manifests to merge: the split produced no shard, or the mapped task returned nothing."
        )
    counts = _sum_fields(manifests, "request_counts", ("total", "completed", "failed"))
    usage = _sum_fields(manifests, "usage", ("prompt_tokens", "completion_tokens", "total_tokens"))
    durations = [float(m.get("duration_s") or 0.0) for m in manifests]
    return {
        "model": _common(manifests, "model"),
        "vllm_version": _common(manifests, "vllm_version"),
        "request_counts": counts,
        "usage": usage,
        "shards": len(manifests),
        "engine_duration_s": round(sum(float(m.get("engine_duration_s") or 0.0) for m in manifests), 3),
        "shard_duration_s": round(sum(durations), 3),
        "max_shard_duration_s": round(max(durations), 3),
        "shard_manifest_uris": [m.get("manifest_uri") for m in manifests],
        "failed_by_reason": _sum_reasons(manifests),
        "invalid_output": sum(int(m.get("invalid_output") or 0) for m in manifests) or None,
        # Summed over the shards that used the cache; None when none did (as each shard's manifest omits it).
        "from_cache": _sum_present(manifests, "from_cache"),
    }


def merged_shards_key(manifests: Sequence[Mapping[str, Any]]) -> str:
    """What a merge is made of, as one hash: the shards' manifests, whole, in shard order.

    Each shard manifest names its input (under the split's prefix), its run (``fingerprint``)
    and its files with the ETags they were published with, and holds the counts, usage and cost
    the merged manifest adds up. Two merges with the same key therefore concatenate the very
    same shard files in the same order into the same sums: a merged output whose manifest
    records this key is complete for this merge. A shard published again (new ETags or
    figures), another split or another order gives another key. The merged manifest keeps it in
    ``identity["merged_shards"]``.

    :param manifests: the shards' manifests as returned by ``VLLMBatchOperator``, in shard order.
    """
    canonical = json.dumps(list(manifests), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _sum_present(manifests: Sequence[Mapping[str, Any]], key: str) -> int | None:
    """``key`` added up over the shards whose manifest has it; None when none has."""
    present = [int(m[key]) for m in manifests if m.get(key) is not None]
    return sum(present) if present else None


def _sum_reasons(manifests: Sequence[Mapping[str, Any]]) -> dict[str, int] | None:
    """The shards' ``failed_by_reason`` added up (None when no shard failed a request)."""
    total: dict[str, int] = {}
    for manifest in manifests:
        for reason, count in (manifest.get("failed_by_reason") or {}).items():
            total[reason] = total.get(reason, 0) + int(count)
    return dict(sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))) or None


def shard_name(index: int) -> str:
    """The file name of shard ``index``: ``shard-00000.jsonl``; sorts in shard order up to 100,000 shards."""
    return f"shard-{index:05d}.jsonl"


def shard_index(uri: str | None) -> int | None:
    """The number of the shard file ``uri`` names (``s3://b/p/shard-00003.jsonl`` -> 3), or None for any other name."""
    match = _SHARD_FILE.search(uri or "")
    return int(match.group(1)) if match else None


# -- helpers -------------------------------------------------------------------------


class _ShardWriter:
    """Writes one shard's lines, counting and hashing as it goes."""

    def __init__(self, index: int, first_line: int, context: AbstractContextManager[IO[bytes]]) -> None:
        self.index = index
        self.first_line = first_line
        self.requests = 0
        self.size = 0
        self._context = context
        self._file = context.__enter__()
        self._hash = hashlib.sha256()

    def write(self, line: bytes) -> None:
        data = line + b"\n"
        self._file.write(data)
        self._hash.update(data)
        self.requests += 1
        self.size += len(data)

    def close(self) -> Shard:
        self._context.__exit__(None, None, None)
        return Shard(
            index=self.index,
            requests=self.requests,
            size=self.size,
            first_line=self.first_line,
            sha256=self._hash.hexdigest(),
        )

    def abandon(self) -> None:
        self._context.__exit__(None, None, None)


def _check_limits(max_requests: Any, max_bytes: Any) -> tuple[int, int]:
    # Rendered templates and Params arrive as strings: "20000".
    return _positive_int("max_requests", max_requests), _positive_int("max_bytes", max_bytes)


def _positive_int(name: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or (isinstance(value, float) and not value.is_integer()):
        raise ShardingError(f"{name} must be a whole number of at least 1, got {value!r}.")
    return number


def _sum_fields(manifests: Sequence[Mapping[str, Any]], section: str, keys: Sequence[str]) -> dict[str, int]:
    return {key: sum(int((m.get(section) or {}).get(key) or 0) for m in manifests) for key in keys}


def _common(manifests: Sequence[Mapping[str, Any]], key: str) -> Any:
    values = {m.get(key) for m in manifests}
    return values.pop() if len(values) == 1 else None
