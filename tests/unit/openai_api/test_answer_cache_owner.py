"""An API batch's answer cache is its owner's: another user's identical request is not answered from it.

Real S3 (SeaweedFS) and the engine stand-in, as :mod:`tests.unit.openai_api.test_batch_task`.
"""

from __future__ import annotations

import json
import time
import uuid
from types import SimpleNamespace

import pytest

from airflow_vllm_batch.openai_api.access import owner_key
from airflow_vllm_batch.openai_api.batch_dag import OpenAIBatchOperator, owner_cache_uri
from airflow_vllm_batch.openai_api.batch_spec import BatchSpec
from airflow_vllm_batch.openai_api.files import result_file_ids
from airflow_vllm_batch.run import AnswerCacheOptions
from tests.unit.openai_api import step_engine
from tests.unit.openai_api.conftest import KEY
from tests.unit.openai_api.step_engine import StepEngine
from tests.unit.openai_api.test_batch_task import requests
from tests.unit.operators.test_vllm_batch_runs import FakeTI


def run_batch(s3, bucket, tmp_path, owner: str, batch_id: str) -> tuple[dict, list[dict]]:
    """Create ``owner``'s batch of the same four requests, as POST /batches does, run it with the DAG's cache; its manifest and results."""
    client = s3.client()
    version = client.put_object(
        Bucket=bucket, Key=f"batches/{batch_id}.input.jsonl", Body=requests(["a", "b", "c", "d"])
    )["ETag"].strip('"')
    spec = BatchSpec(
        batch_id=batch_id,
        dag_id="vllm_batch_openai",
        owner=owner,
        input_file_id="file-0123456789in",
        input_version=version,
        endpoint="/v1/chat/completions",
        route="",
        created_at=int(time.time()),
        window_s=86400,
    )
    operator = OpenAIBatchOperator(
        task_id="vllm_batch",
        model="m",
        engine=StepEngine(),
        results_dir=str(tmp_path / "results"),
        # Sampled requests too: the worst case of the review (another user's sampled output).
        answer_cache=AnswerCacheOptions(uri=f"s3://{bucket}/cache/", sampled=True),
    )
    context = {
        "ti": FakeTI(try_number=1, run_id=batch_id),
        "outlet_events": {},
        "dag_run": SimpleNamespace(run_id=batch_id, dag_id="vllm_batch_openai", conf=spec.sign(KEY)),
    }
    manifest = operator.execute(context)
    key = f"files/{owner_key(owner)}/{result_file_ids(batch_id)[0]}.jsonl"
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return manifest, [json.loads(line) for line in body.splitlines()]


def body_ids(lines: list[dict]) -> set[str]:
    return {line["response"]["body"]["id"] for line in lines}


@pytest.fixture
def api_files(bucket, monkeypatch):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_FILES_URI", f"s3://{bucket}/")
    monkeypatch.setattr(step_engine, "AFTER_ANSWER", None)
    step_engine.PRODUCED.clear()
    answer = step_engine._answer

    def unique_answer(custom_id: str, status: int) -> bytes:
        # Each answer the engine makes has an id of its own (as vLLM's chatcmpl-<uuid>): a cached line shows its origin.
        line = json.loads(answer(custom_id, status))
        line["response"]["body"]["id"] = f"chatcmpl-{uuid.uuid4().hex}"
        return json.dumps(line).encode()

    monkeypatch.setattr(step_engine, "_answer", unique_answer)


def test_another_users_identical_request_is_not_answered_from_the_cache(s3, bucket, tmp_path, api_files):
    first, a_lines = run_batch(s3, bucket, tmp_path, "alice", "batch_00000000000000a1")
    assert first["from_cache"] == 0
    # Alice's own identical batch is answered from her cache: the cache works, and is hers.
    again, again_lines = run_batch(s3, bucket, tmp_path, "alice", "batch_00000000000000a2")
    assert again["from_cache"] == 4
    # A hit is the stored line (its id included): what would tell Bob that Alice asked.
    assert body_ids(again_lines) == body_ids(a_lines)
    assert len(step_engine.PRODUCED) == 1
    # Bob's is not: the engine answers him, and no line of Alice's (its ids, its created time) reaches him.
    bobs, b_lines = run_batch(s3, bucket, tmp_path, "bob", "batch_00000000000000b1")
    assert bobs["from_cache"] == 0
    assert len(step_engine.PRODUCED) == 2
    assert not body_ids(a_lines) & body_ids(b_lines)
    cached = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket, Prefix="cache/")["Contents"])
    assert cached
    assert all(
        k.startswith((f"cache/owners/{owner_key('alice')}/", f"cache/owners/{owner_key('bob')}/"))
        for k in cached
    )


def test_the_owners_namespace_is_derived_from_the_signed_owner_and_never_nests():
    assert owner_cache_uri("s3://b/cache/", "alice") == f"s3://b/cache/owners/{owner_key('alice')}/"
    assert owner_cache_uri("s3://b/cache", "alice") == owner_cache_uri("s3://b/cache/", "alice")
    assert owner_cache_uri("s3://b/cache/", "alice") != owner_cache_uri("s3://b/cache/", "bob")
