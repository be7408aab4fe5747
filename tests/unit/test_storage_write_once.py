"""A write-once output (an OpenAI API batch) on a real S3: when it has ended, and the answers a new identity adopts."""

from __future__ import annotations

import pytest
from airflow.providers.amazon.aws.hooks.s3 import S3Hook

from airflow_vllm_batch.identity import RunIdentity
from airflow_vllm_batch.manifest import Manifest, RequestCounts, Usage
from airflow_vllm_batch.storage.publishing import OutputStore
from airflow_vllm_batch.storage.s3 import head_etag


@pytest.fixture
def hook(s3) -> S3Hook:
    return S3Hook(aws_conn_id="aws_default")


@pytest.fixture
def ended(s3, bucket, hook, tmp_path) -> OutputStore:
    """An output published by the identity ``{"engine": "old"}`` for the input of ETag ``in-etag``, with an error file."""
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    old = RunIdentity({"engine": "old"})
    results, errors = tmp_path / "r.jsonl", tmp_path / "e.jsonl"
    results.write_bytes(b'{"custom_id": "a"}\n')
    errors.write_bytes(b'{"custom_id": "b"}\n')
    manifest = Manifest(
        output_uri=store.output_uri,
        error_uri=store.error_uri,
        input_uri="s3://b/in",
        input_etag="in-etag",
        model="m",
        request_counts=RequestCounts(2, 1, 1),
        usage=Usage(),
        duration_s=0.0,
        vllm_version=None,
        fingerprint=old.fingerprint,
        manifest_uri=store.manifest_uri,
        identity=dict(old.components),
    )
    store.publish(manifest, results_path=results, errors_path=errors)
    return store


def test_an_ended_output_is_returned_to_any_identity_of_its_input_and_to_no_other_input(ended):
    manifest, why = ended.ended('"in-etag"')
    assert manifest is not None
    assert manifest.fingerprint == RunIdentity({"engine": "old"}).fingerprint
    assert "never changes" in why
    # The protocol's own check, for another identity, says it is not complete: the write-once one is what ends it.
    assert ended.completed(RunIdentity({"engine": "new"}))[0] is None
    assert ended.ended("another-input")[0] is None
    assert ended.ended(None)[0] is None


def test_an_ended_output_stays_ended_when_its_owner_deletes_a_file_not_when_one_is_overwritten(
    s3, bucket, ended
):
    s3.client().delete_object(Bucket=bucket, Key="r.errors.jsonl")
    assert ended.ended("in-etag")[0] is not None
    s3.client().put_object(Bucket=bucket, Key="r.jsonl", Body=b"a stray writer's\n")
    manifest, why = ended.ended("in-etag")
    assert manifest is None
    assert "was overwritten after its manifest was written" in why


def test_an_output_whose_publish_began_has_not_ended(s3, bucket, ended):
    ended.mark_publishing(head_etag(s3.client(), bucket, "r.manifest.json"), "f")
    manifest, why = ended.ended("in-etag")
    assert manifest is None
    assert "a try began publishing it" in why


def test_a_new_identity_adopts_another_runs_parts_and_results_as_parts_and_leaves_them(s3, bucket, hook):
    store = OutputStore(hook, f"s3://{bucket}/w.jsonl")
    old, new = RunIdentity({"engine": "old"}), RunIdentity({"engine": "new"})
    theirs, mine = store.staging(old), store.staging(new)
    client = s3.client()
    client.put_object(
        Bucket=bucket, Key=theirs.part_key("part-000000-t1.jsonl"), Body=b'{"custom_id": "a"}\n'
    )
    client.put_object(
        Bucket=bucket, Key=theirs.part_key("part-000001-t1.jsonl"), Body=b'{"custom_id": "b"}\n'
    )
    client.put_object(Bucket=bucket, Key=theirs.results_key, Body=b'{"custom_id": "c"}\n')
    client.put_object(Bucket=bucket, Key=mine.part_key("part-000000-t2.jsonl"), Body=b'{"custom_id": "d"}\n')
    (other,) = store.other_stagings(new)
    assert other.prefix == theirs.prefix
    assert mine.adopt(other) == 3
    assert mine.adopt(other) == 3  # a retry copies onto the same keys
    with mine.open_parts() as lines:
        assert sorted(lines) == [b'{"custom_id": "%s"}' % c.encode() for c in "abcd"]
    assert len(mine.list_parts()) == 4
    assert len(theirs.list_parts()) == 2
    assert theirs.has_results()
    assert [s.prefix for s in store.other_stagings(old)] == [mine.prefix]
