"""A running batch's live request_counts come from its newest run's checkpoint parts, counted as the results check counts."""

from __future__ import annotations

import io
import json
from datetime import datetime, timedelta, timezone

from airflow_vllm_batch.openai_api.progress import count_answers, newest_run_parts, staged_progress

OUT = "p/files/u/file-out.jsonl"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


class Body(io.BytesIO):
    def iter_lines(self):
        yield from self.getvalue().splitlines()


class StagingS3:
    """A bucket's objects (key -> (bytes, last modified)), listed and read as boto3 does."""

    def __init__(self, objects: dict[str, tuple[bytes, datetime]]):
        self.objects = objects
        self.read: list[str] = []

    def get_paginator(self, name):
        assert name == "list_objects_v2"
        return self

    def paginate(self, *, Bucket, Prefix):
        contents = [{"Key": k, "Size": len(v), "LastModified": t} for k, (v, t) in sorted(self.objects.items()) if k.startswith(Prefix)]
        yield {"Contents": contents}

    def get_object(self, *, Bucket, Key):
        self.read.append(Key)
        return {"Body": Body(self.objects[Key][0])}


def ok(cid: str) -> bytes:
    return json.dumps({"id": "x", "custom_id": cid, "response": {"status_code": 200, "request_id": "r", "body": {"choices": []}}, "error": None}).encode()


def bad(cid: str) -> bytes:
    return json.dumps({"id": "x", "custom_id": cid, "response": {"status_code": 400, "request_id": "r", "body": None}, "error": None}).encode()


def errored(cid: str) -> bytes:
    return json.dumps({"id": "x", "custom_id": cid, "response": None, "error": {"message": "engine died"}}).encode()


def test_answers_are_counted_once_per_custom_id_and_split_by_status_and_error():
    progress = count_answers([ok("a"), bad("b"), errored("c"), ok("a"), b"", b"not json", b'{"custom_id": "d"}'])
    assert (progress.completed, progress.failed) == (1, 2)


def test_only_the_newest_runs_parts_are_read_in_part_order():
    s3 = StagingS3(
        {
            f"{OUT}.staging/oldrun/parts/part-000000.jsonl": (ok("old"), T0),
            f"{OUT}.staging/newrun/parts/part-000001-t2.jsonl": (ok("b") + b"\n" + bad("c"), T0 + timedelta(minutes=2)),
            f"{OUT}.staging/newrun/parts/part-000000-t1.jsonl": (ok("a"), T0 + timedelta(minutes=1)),
            f"{OUT}.staging/newrun/results.jsonl": (ok("z"), T0 + timedelta(minutes=3)),
            f"{OUT}.staging/newrun/deaths/death-000000.json": (b"{}", T0 + timedelta(minutes=3)),
        }
    )
    assert [k.rsplit("/", 1)[1] for k, _ in newest_run_parts(s3, "b", OUT)] == ["part-000000-t1.jsonl", "part-000001-t2.jsonl"]
    progress = staged_progress(s3, "b", OUT, max_bytes=10**6)
    assert (progress.completed, progress.failed, progress.partial) == (2, 1, False)


def test_a_batch_without_parts_has_no_progress():
    assert staged_progress(StagingS3({f"{OUT}.jsonl": (ok("a"), T0)}), "b", OUT, max_bytes=10**6) is None


def test_parts_beyond_the_byte_budget_are_not_read_and_the_count_is_marked_partial():
    first, second = ok("a"), ok("b")
    s3 = StagingS3(
        {
            f"{OUT}.staging/r/parts/part-000000.jsonl": (first, T0),
            f"{OUT}.staging/r/parts/part-000001.jsonl": (second, T0),
        }
    )
    progress = staged_progress(s3, "b", OUT, max_bytes=len(first) + 1)
    assert (progress.completed, progress.partial) == (1, True)
    assert s3.read == [f"{OUT}.staging/r/parts/part-000000.jsonl"]
