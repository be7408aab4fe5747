"""The answer cache of VLLMBatchOperator, every branch in seconds: real S3 (SeaweedFS) and the stand-in server.

The stand-in counts the requests it received (keyed by the message, here the custom_id of
the line that first had it), which is what shows that a second run sends only its misses.
"""

from __future__ import annotations

import json
import re

import pytest
from botocore.exceptions import ClientError

from airflow_vllm_batch.exceptions import ConfigurationError, StorageUnavailableError
from airflow_vllm_batch.run import AnswerCacheOptions, BatchSettings
from airflow_vllm_batch.run.answer_cache import AnswerCache
from airflow_vllm_batch.storage.staging import RunStaging
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.operators.test_vllm_batch_runs import FakeTI

pytestmark = pytest.mark.usefixtures("quick_retries")

N = 12


def line(custom_id: str, content: str | None = None, **body) -> dict:
    fields = {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "user", "content": content or custom_id}],
        **body,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": fields}


def put_input(batch, key: str, lines: list[dict]) -> str:
    batch.client.put_object(
        Bucket=batch.bucket, Key=key, Body=b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    )
    return f"s3://{batch.bucket}/{key}"


def raw_lines(batch, key: str) -> dict[str, bytes]:
    body = batch.client.get_object(Bucket=batch.bucket, Key=key)["Body"].read()
    return {json.loads(raw)["custom_id"]: raw for raw in body.splitlines() if raw.strip()}


def run(batch, input_uri: str, output: str, ti: FakeTI | None = None, **kwargs) -> dict:
    kwargs.setdefault("answer_cache", AnswerCacheOptions(uri=f"s3://{batch.bucket}/cache/"))
    return batch.run(
        ti or FakeTI(run_id=output),
        input_uri=input_uri,
        output_uri=f"s3://{batch.bucket}/{output}/results.jsonl",
        **kwargs,
    )


@pytest.fixture
def night1(batch, server) -> dict:
    """A first run over N deterministic requests, which fills the cache."""
    manifest = run(batch, put_input(batch, "in/night1.jsonl", [line(f"r{i}") for i in range(N)]), "night1")
    assert manifest["from_cache"] == 0
    assert server.requests == N
    return manifest


def test_a_second_run_sends_only_the_changed_requests_and_answers_the_rest_byte_equal(
    batch, server, night1, capfd
):
    changed = [line(f"r{i}") if i >= 2 else line(f"r{i}", content=f"changed {i}") for i in range(N)]
    manifest = run(batch, put_input(batch, "in/night2.jsonl", changed), "night2")
    assert server.requests == N + 2
    assert server.attempts["changed 0"] == server.attempts["changed 1"] == 1
    assert manifest["from_cache"] == N - 2
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    assert manifest["usage"]["total_tokens"] == N * 8  # the cached answers' tokens are counted too
    first, second = raw_lines(batch, "night1/results.jsonl"), raw_lines(batch, "night2/results.jsonl")
    assert sorted(second) == sorted(first)
    assert all(second[f"r{i}"] == first[f"r{i}"] for i in range(2, N))
    assert all(second[f"r{i}"] != first[f"r{i}"] for i in range(2))
    assert re.search(
        rf"\| from cache +\| {N - 2} of {N} requests answered from the answer cache", capfd.readouterr().out
    )


def test_the_changed_requests_answers_go_into_the_cache_for_the_next_run(batch, server, night1):
    changed = [line(f"r{i}") if i >= 2 else line(f"r{i}", content=f"changed {i}") for i in range(N)]
    uri = put_input(batch, "in/night2.jsonl", changed)
    run(batch, uri, "night2")
    manifest = run(batch, uri, "night3")
    assert manifest["from_cache"] == N
    assert server.requests == N + 2


def test_every_request_answered_from_the_cache_starts_no_engine_and_uses_each_requests_custom_id(
    batch, server, night1, capfd
):
    # The same bodies under other custom_ids, one of them twice.
    lines = [line(f"again-{i}", content=f"r{i}") for i in range(N)] + [line("twin", content="r0")]
    manifest = run(batch, put_input(batch, "in/again.jsonl", lines), "again")
    assert server.requests == N
    assert manifest["from_cache"] == N + 1
    assert manifest["request_counts"] == {
        "total": N + 1,
        "completed": N + 1,
        "failed": 0,
    }
    answers = raw_lines(batch, "again/results.jsonl")
    assert sorted(answers) == sorted([f"again-{i}" for i in range(N)] + ["twin"])
    first = raw_lines(batch, "night1/results.jsonl")
    assert json.loads(answers["twin"])["response"] == json.loads(first["r0"])["response"]
    assert "Every request was answered from the answer cache: no engine runs." in capfd.readouterr().out
    assert batch.keys("again/") == ["again/results.jsonl", "again/results.manifest.json"]  # staging removed


def test_requests_that_sample_are_cached_only_when_opted_in(batch, server):
    lines = [line(f"s{i}", temperature=0.7) for i in range(4)]
    uri = put_input(batch, "in/sampled.jsonl", lines)
    run(batch, uri, "sampled1")
    assert run(batch, uri, "sampled2")["from_cache"] == 0
    assert server.requests == 8
    run(
        batch,
        uri,
        "sampled3",
        answer_cache=AnswerCacheOptions(uri=f"s3://{batch.bucket}/cache/", sampled=True),
    )
    assert (
        run(
            batch,
            uri,
            "sampled4",
            answer_cache=AnswerCacheOptions(uri=f"s3://{batch.bucket}/cache/", sampled=True),
        )["from_cache"]
        == 4
    )
    assert server.requests == 12


def test_a_run_without_the_cache_has_no_from_cache_and_its_identity_is_unchanged(batch, server):
    uri = put_input(batch, "in/plain.jsonl", [line("p0")])
    plain = run(batch, uri, "plain", answer_cache=None)
    cached = run(batch, uri, "cached")
    assert "from_cache" not in plain
    assert "answer_cache" not in plain["identity"]
    assert cached["identity"]["answer_cache"] == {"uri": f"s3://{batch.bucket}/cache/", "sampled": False}
    assert cached["fingerprint"] != plain["fingerprint"]


@pytest.mark.parametrize("bad", ["bucket/prefix/", "s3://", "https://bucket/x", 7])
def test_an_answer_cache_uri_that_is_not_an_s3_prefix_is_refused_naming_it(bad):
    with pytest.raises(ConfigurationError, match="answer_cache_uri must be an S3 prefix"):
        BatchSettings.from_rendered(
            input_uri="s3://b/in.jsonl", output_uri="s3://b/out.jsonl", model="m", answer_cache_uri=bad
        )


def test_the_answer_cache_uri_gets_its_trailing_slash():
    settings = BatchSettings.from_rendered(
        input_uri="s3://b/in.jsonl", output_uri="s3://b/o.jsonl", model="m", answer_cache_uri="s3://b/c"
    )
    assert settings.answer_cache_uri == "s3://b/c/"


def test_a_cache_bucket_that_does_not_exist_fails_before_any_request_is_sent(batch, server):
    uri = put_input(batch, "in/x.jsonl", [line("x0")])
    with pytest.raises(
        AirflowFailException, match="answer_cache_uri: bucket 'no-such-cache-bucket' does not exist"
    ):
        run(batch, uri, "x", answer_cache=AnswerCacheOptions(uri="s3://no-such-cache-bucket/cache/"))
    assert server.requests == 0
    assert [k for k in batch.keys("x/") if not k.startswith("x/results.jsonl.staging/")] == []


def test_a_corrupt_cache_line_is_a_miss_with_a_warning(batch, server, night1, capfd):
    objects = batch.keys("cache/")
    assert objects
    assert all(k.endswith(".tsv") for k in objects)
    first = objects[0]
    stored = batch.client.get_object(Bucket=batch.bucket, Key=first)["Body"].read().splitlines()
    key = stored[0].split(b"\t", 1)[0]
    # One answer's line damaged, one line with no key at all.
    damaged = [key + b"\t{not json", b"garbage", *stored[1:]]
    batch.client.put_object(Bucket=batch.bucket, Key=first, Body=b"\n".join(damaged) + b"\n")
    manifest = run(batch, f"s3://{batch.bucket}/in/night1.jsonl", "after-damage")
    assert manifest["from_cache"] == N - 1
    assert server.requests == N + 1
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    assert "2 stored line(s) under" in capfd.readouterr().out


def test_a_failed_cache_write_after_publishing_is_a_warning_and_the_run_stands(
    batch, server, monkeypatch, capfd
):
    real_store = AnswerCache.store

    def store_to_a_bad_bucket(self):
        self.bucket = "Not A Bucket!"  # botocore refuses the name before sending anything
        real_store(self)

    monkeypatch.setattr(AnswerCache, "store", store_to_a_bad_bucket)
    uri = put_input(batch, "in/w.jsonl", [line("w0"), line("w1")])
    manifest = run(batch, uri, "w")
    assert manifest["request_counts"]["completed"] == 2
    assert "out/results.manifest.json" not in batch.keys()
    assert "w/results.manifest.json" in batch.keys("w/")
    assert "the new answers could not be stored" in capfd.readouterr().out
    assert batch.keys("cache/") == []


def test_a_retry_takes_the_hits_its_first_try_staged_even_when_the_cache_changed(
    batch, server, night1, monkeypatch
):
    changed = [line(f"r{i}") if i >= 2 else line(f"r{i}", content=f"changed {i}") for i in range(N)]
    uri = put_input(batch, "in/night2.jsonl", changed)
    real_put = RunStaging.put_part

    def s3_fails(self, path, token=""):
        raise ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "down"}}, "PutObject")

    monkeypatch.setattr(RunStaging, "put_part", s3_fails)
    with pytest.raises(StorageUnavailableError):
        run(batch, uri, "night2")
    monkeypatch.setattr(RunStaging, "put_part", real_put)
    batch.client.delete_objects(
        Bucket=batch.bucket, Delete={"Objects": [{"Key": k} for k in batch.keys("cache/")]}
    )
    manifest = run(batch, uri, "night2", ti=FakeTI(run_id="night2", try_number=2))
    assert manifest["from_cache"] == N - 2
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    assert server.attempts["changed 0"] == 2
    assert server.requests == N + 4


@pytest.mark.parametrize(
    "restarted",
    [
        {"card": {"root": "/models/llama-3-8b-v2"}},
        {"card": {"max_model_len": 512}},
        {"vllm_version": "0.33.0"},
    ],
    ids=["root", "max_model_len", "vllm_version"],
)
def test_a_warm_server_restarted_with_other_weights_length_or_version_misses_the_cache(
    batch, server, restarted
):
    server.card = {"root": "/models/llama-3-8b", "max_model_len": 2048}
    uri = put_input(batch, "in/night1.jsonl", [line(f"r{i}") for i in range(N)])
    assert run(batch, uri, "night1")["from_cache"] == 0
    for name, value in restarted.items():
        setattr(server, name, {**server.card, **value} if name == "card" else value)
    manifest = run(batch, uri, "night2")
    assert manifest["from_cache"] == 0
    assert server.requests == 2 * N


def test_a_warm_server_that_reports_itself_the_same_keeps_hitting_the_cache(batch, server):
    server.card = {"root": "/models/llama-3-8b", "max_model_len": 2048}
    uri = put_input(batch, "in/night1.jsonl", [line(f"r{i}") for i in range(N)])
    run(batch, uri, "night1")
    assert run(batch, uri, "night2")["from_cache"] == N
    assert server.requests == N
