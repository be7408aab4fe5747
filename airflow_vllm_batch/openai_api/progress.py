"""What a running batch has answered so far, read from the server engine's checkpoint parts in S3.

The server engine seals its journal into parts under ``<output key>.staging/<run>/parts/``
(:class:`airflow_vllm_batch.storage.RunStaging`); each part line is one answer, with its
custom_id. This module finds the newest run's parts (the API knows the batch's output key,
not the run's fingerprint: the output key is the batch's own, so the newest run under it is
the batch's) and counts the distinct custom_ids answered, completed or failed by the rule of
the results check (an ``error``, or a status other than 200, is a failure). It only reads:
nothing here writes under the output. The same reader gives the batch task the answers to
publish when the completion window passes (:mod:`.batch_dag`).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec

from airflow_vllm_batch.batchfile.models import CustomIdOnly, ResultLine, error_object

#: ``<run>/parts/part-000123[-<try token>].jsonl`` under the staging prefix (the storage layer's part names).
_PART = re.compile(r"^([^/]+)/parts/part-(\d{6,})(?:-([0-9a-z]+))?\.jsonl$")
_decode = msgspec.json.Decoder(ResultLine).decode
_decode_request = msgspec.json.Decoder(CustomIdOnly).decode
#: OpenAI's error of a request its batch's completion window left unanswered.
EXPIRED_ERROR = {"code": "batch_expired", "message": "This request could not be executed before the completion window expired."}


def staging_prefix(output_key: str) -> str:
    """Where the runs of the output ``output_key`` stage: ``<output key>.staging/``."""
    return f"{output_key}.staging/"


def newest_run_parts(client: Any, bucket: str, output_key: str) -> list[tuple[str, int]]:
    """The keys and sizes of the newest run's checkpoint parts, in part order; empty when there are none.

    :param client: a boto3 S3 client.
    :param bucket: the output's bucket.
    :param output_key: the output's key (``openai_files_uri``'s ``files/<user>/<file id>.jsonl``).
    """
    prefix = staging_prefix(output_key)
    runs: dict[str, list[tuple[int, str, str, int]]] = {}
    newest: dict[str, Any] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            found = _PART.match(obj["Key"][len(prefix) :])
            if found is None:
                continue
            run = found.group(1)
            runs.setdefault(run, []).append((int(found.group(2)), found.group(3) or "", obj["Key"], int(obj.get("Size", 0))))
            if run not in newest or obj["LastModified"] > newest[run]:
                newest[run] = obj["LastModified"]
    if not runs:
        return []
    run = max(runs, key=lambda name: newest[name])
    return [(key, size) for _, _, key, size in sorted(runs[run])]


def part_lines(client: Any, bucket: str, keys: Iterable[str]) -> Iterator[bytes]:
    """The lines of the parts ``keys``, one part's body open at a time."""
    for key in keys:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        try:
            yield from body.iter_lines()
        finally:
            body.close()


def answered(raw: bytes) -> tuple[str, bool] | None:
    """The custom_id of a result line and whether it completed; None for a line that is no answer.

    :param raw: one line of a part (vLLM's batch output shape).
    """
    if not raw.strip():
        return None
    try:
        line = _decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    if line.custom_id is None or (line.response is msgspec.UNSET and line.error is msgspec.UNSET):
        return None
    response = None if line.response is msgspec.UNSET else line.response
    error = None if line.error is msgspec.UNSET else line.error
    status = response.status_code if response is not None else None
    return line.custom_id, error is None and response is not None and status in (None, 200)


@dataclass
class Progress:
    """The distinct requests answered so far.

    :param completed: answered with status 200.
    :param failed: answered with an error.
    :param partial: the byte budget ran out before every part was read (the counts are a lower bound).
    """

    completed: int = 0
    failed: int = 0
    partial: bool = False
    outcomes: dict[str, bool] = field(default_factory=dict, repr=False)


def count_answers(lines: Iterable[bytes]) -> Progress:
    """Count the distinct custom_ids of result lines, completed or failed (a later answer of a custom_id wins)."""
    outcomes: dict[str, bool] = {}
    for raw in lines:
        found = answered(raw)
        if found is not None:
            outcomes[found[0]] = found[1]
    completed = sum(outcomes.values())
    return Progress(completed=completed, failed=len(outcomes) - completed, outcomes=outcomes)


def staged_progress(client: Any, bucket: str, output_key: str, max_bytes: int) -> Progress | None:
    """What the newest run of ``output_key`` answered so far, from its checkpoint parts; None when it has none.

    :param client: a boto3 S3 client.
    :param bucket: the output's bucket.
    :param output_key: the output's key.
    :param max_bytes: read parts while their sizes add up to at most this (a status call stays cheap).
    """
    parts = newest_run_parts(client, bucket, output_key)
    if not parts:
        return None
    chosen, budget = [], max_bytes
    for key, size in parts:
        if size > budget:
            break
        chosen.append(key)
        budget -= size
    progress = count_answers(part_lines(client, bucket, chosen))
    progress.partial = len(chosen) < len(parts)
    progress.outcomes = {}
    return progress


def split_expired(part_lines: Iterable[bytes], input_lines: Iterable[bytes], output: IO[bytes], errors: IO[bytes]) -> dict[str, int]:
    """Write what an expired batch answered, as OpenAI publishes it; return its ``request_counts``.

    Each custom_id's first answer counts (a retry skips what the parts answered): a completed
    one goes to ``output`` as it was, a failed one to ``errors`` with its ``error`` in the error
    file's shape; every input request left unanswered goes to ``errors`` as ``batch_expired``.

    :param part_lines: the lines of the run's checkpoint parts, in part order.
    :param input_lines: the lines of the batch's input file.
    :param output: where the completed answers go.
    :param errors: where the failed and unanswered requests go.
    """
    seen: set[str] = set()
    completed = failed = 0
    for raw in part_lines:
        found = answered(raw)
        if found is None or found[0] in seen:
            continue
        seen.add(found[0])
        if found[1]:
            completed += 1
            output.write(raw.rstrip(b"\r\n") + b"\n")
        else:
            failed += 1
            line = msgspec.json.decode(raw)
            response = line.get("response")
            status = response.get("status_code") if isinstance(response, dict) else None
            line["error"] = error_object(line.get("error"), status, None)
            errors.write(msgspec.json.encode(line) + b"\n")
    expired = 0
    for raw in input_lines:
        if not raw.strip():
            continue
        try:
            custom_id = _decode_request(raw).custom_id
        except (msgspec.DecodeError, UnicodeDecodeError):
            continue
        if not isinstance(custom_id, str) or custom_id in seen:
            continue
        seen.add(custom_id)
        expired += 1
        line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None, "error": EXPIRED_ERROR}
        errors.write(msgspec.json.encode(line) + b"\n")
    return {"total": completed + failed + expired, "completed": completed, "failed": failed + expired}
