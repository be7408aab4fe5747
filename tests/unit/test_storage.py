"""The storage module on a real S3: pinned reads, location checks, what counts as complete."""

from __future__ import annotations

import json

import pytest
from airflow.providers.amazon.aws.hooks.s3 import S3Hook

from airflow_vllm_batch.batchfile import Failed, Text
from airflow_vllm_batch.exceptions import (
    InputChangedError,
    InputNotFoundError,
    LocationError,
    ResultsCheckError,
)
from airflow_vllm_batch.identity import RunIdentity
from airflow_vllm_batch.manifest import Manifest, RequestCounts, Usage
from airflow_vllm_batch.storage import OutputStore, head_input, read_answers, s3_lines, split_s3_uri


@pytest.fixture
def hook(s3) -> S3Hook:
    return S3Hook(aws_conn_id="aws_default")


def test_a_read_of_a_pinned_input_that_changed_fails_naming_it(s3, bucket, hook):
    s3.client().put_object(Bucket=bucket, Key="in.jsonl", Body=b"a\n")
    etag = head_input(hook, f"s3://{bucket}/in.jsonl")["ETag"].strip('"')
    s3.client().put_object(Bucket=bucket, Key="in.jsonl", Body=b"b\n")
    with pytest.raises(InputChangedError, match=rf"s3://{bucket}/in.jsonl was overwritten while this task ran"):
        with s3_lines(hook, bucket, "in.jsonl", if_match=etag) as lines:
            list(lines)


def test_a_missing_input_names_input_uri_and_the_fix(bucket, hook):
    with pytest.raises(InputNotFoundError, match=r"input_uri: s3://.*/typo.jsonl does not exist .* Nothing was run"):
        head_input(hook, f"s3://{bucket}/typo.jsonl")


@pytest.mark.parametrize("uri", ["/tmp/x.jsonl", "s3://", "s3://bucket-only", "s3://b/folder/"])
def test_a_malformed_location_names_the_parameter(uri):
    with pytest.raises(LocationError, match="error_uri must"):
        split_s3_uri(uri, "error_uri")


def test_a_missing_error_bucket_is_found_before_the_run(bucket, hook):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl", "s3://no-such-bucket-xyz/e.jsonl")
    with pytest.raises(LocationError, match="error_uri: bucket 'no-such-bucket-xyz' does not exist"):
        store.check_writable()
    assert [b["Name"] for b in hook.get_conn().list_buckets()["Buckets"]].count("no-such-bucket-xyz") == 0


def _manifest(store: OutputStore, fingerprint: str, error_uri: str | None = None) -> Manifest:
    return Manifest(
        output_uri=store.output_uri, error_uri=error_uri, input_uri="s3://b/in", model="m",
        request_counts=RequestCounts(1, 1, 0), usage=Usage(), duration_s=0.0, vllm_version=None,
        fingerprint=fingerprint, manifest_uri=store.manifest_uri, identity={"model": "m"},
    )


def test_a_manifest_whose_files_are_gone_is_not_complete(s3, bucket, hook):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    identity = RunIdentity({"model": "m"})
    store.write_manifest(_manifest(store, identity.fingerprint, error_uri=store.error_uri))
    s3.client().put_object(Bucket=bucket, Key="r.jsonl", Body=b"{}\n")
    manifest, why = store.completed(identity)
    assert manifest is None and why == f"the manifest names {store.error_uri}, which is gone"
    s3.client().put_object(Bucket=bucket, Key="r.errors.jsonl", Body=b"{}\n")
    assert store.completed(identity)[0] is not None


def test_removing_a_runs_staging_leaves_other_runs_staging(s3, bucket, hook):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    mine, theirs = store.staging(RunIdentity({"a": 1})), store.staging(RunIdentity({"a": 2}))
    for staging in (mine, theirs):
        s3.client().put_object(Bucket=bucket, Key=staging.results_key, Body=b"x\n")
    mine.remove()
    assert not mine.has_results() and theirs.has_results()


def test_the_writable_check_probes_a_bucket_once_when_the_error_file_sits_beside_the_output(s3, bucket, hook, monkeypatch):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    client = hook.get_conn()
    puts = []
    real_put = client.put_object
    monkeypatch.setattr(client, "put_object", lambda **kw: puts.append(kw["Bucket"]) or real_put(**kw))
    store.check_writable()
    assert puts == [bucket]


def _chat(custom_id: str, text: str) -> bytes:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
    return json.dumps({"id": "v", "custom_id": custom_id, "response": {"status_code": 200, "body": body}, "error": None}).encode()


def _published(s3, bucket: str, completed: int) -> dict:
    failed = json.dumps({"id": "v", "custom_id": "b", "response": None, "error": {"message": "too long"}}).encode()
    s3.client().put_object(Bucket=bucket, Key="out/r.jsonl", Body=_chat("a", "yes"))  # no final newline, as vLLM writes it
    s3.client().put_object(Bucket=bucket, Key="out/r.errors.jsonl", Body=failed + b"\n")
    return {
        "output_uri": f"s3://{bucket}/out/r.jsonl",
        "error_uri": f"s3://{bucket}/out/r.errors.jsonl",
        "request_counts": {"total": completed + 1, "completed": completed, "failed": 1},
    }


def test_read_answers_streams_a_published_manifest_from_s3(s3, bucket):
    assert list(read_answers(_published(s3, bucket, completed=1))) == [Text("a", "yes"), Failed("b", "too long")]


def test_read_answers_from_s3_still_checks_the_counts_of_the_manifest(s3, bucket):
    with pytest.raises(ResultsCheckError, match="does not match its manifest"):
        list(read_answers(_published(s3, bucket, completed=2)))
