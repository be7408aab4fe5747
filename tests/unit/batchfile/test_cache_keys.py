"""The answer cache's keys: what changes an answer changes the key, and nothing else does."""

from __future__ import annotations

import json

import pytest

from airflow_vllm_batch.batchfile.cache_keys import (
    cacheable,
    line_key,
    model_identity,
    output_args,
    request_key,
)

CHAT = "/v1/chat/completions"


def identity(**changes) -> str:
    parts = {"model": "m", "vllm_version": "0.32.0", "engine_args": ["--max-model-len", "512"]}
    return model_identity(**{**parts, **changes})


def key(body: dict | str, url: str = CHAT, model: str | None = None) -> str:
    raw = body if isinstance(body, str) else json.dumps(body)
    return request_key(model or identity(), url, raw.encode())


BODY = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def test_key_order_and_whitespace_of_the_body_do_not_change_the_key():
    spaced = '{ "max_tokens" : 8,\n "messages": [ {"content": "hi", "role": "user"} ], "temperature": 0, "model": "m" }'
    assert key(spaced) == key(BODY)


@pytest.mark.parametrize(
    "change",
    [
        {"messages": [{"role": "user", "content": "hi!"}]},
        {"max_tokens": 9},
        {"model": "adapter-1"},
        {"seed": 1},
    ],
)
def test_a_change_to_the_body_changes_the_key(change):
    assert key({**BODY, **change}) != key(BODY)


def test_the_url_is_in_the_key():
    assert key(BODY, url="/v1/completions") != key(BODY)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"vllm_version": "0.33.0"},
        {"engine_args": ["--max-model-len", "1024"]},
        {"engine_args": ["--max-model-len", "512", "--quantization", "fp8"]},
        {"engine_args": None},
        {"engine_command": ["docker", "run", "vllm:0.32"]},
        {"served_names": ["m", "adapter-1"]},
    ],
)
def test_what_shapes_the_answers_changes_the_model_identity(change):
    assert identity(**change) != identity()
    assert key(BODY, model=identity(**change)) != key(BODY)


@pytest.mark.parametrize(
    "extra",
    [
        ["--max-num-seqs", "4"],
        ["--max-num-batched-tokens=2048"],
        ["--max_num_seqs", "8"],
        ["--gpu-memory-utilization", "0.5"],
        ["--port", "8001", "--host", "0.0.0.0"],
        ["--disable-log-stats"],
        ["--data-parallel-size", "2"],
        ["--max-inflight", "64"],  # vLLM 0.33's runner: how many requests it queues
        ["--enable-prefix-caching"],
        ["--disable-prefix-caching"],  # vLLM 0.33's spelling of --no-enable-prefix-caching
    ],
)
def test_scheduling_and_serving_flags_do_not_change_the_model_identity(extra):
    assert identity(engine_args=["--max-model-len", "512", *extra]) == identity()
    assert identity(engine_args=[*extra, "--max-model-len", "512"]) == identity()


def test_output_args_drops_a_flag_and_its_value_only():
    args = [
        "--max-num-seqs",
        "4",
        "--enforce-eager",
        "--port=9",
        "--tensor-parallel-size",
        "2",
        "--disable-log-stats",
        "--seed",
        "3",
    ]
    assert output_args(args) == ["--enforce-eager", "--tensor-parallel-size", "2", "--seed", "3"]


@pytest.mark.parametrize(
    ("url", "fields", "expected"),
    [
        (CHAT, {"temperature": 0}, True),
        (CHAT, {"temperature": 0.0}, True),
        (CHAT, {"seed": 7}, True),
        (CHAT, {"temperature": 0.8, "seed": 7}, True),
        (CHAT, {}, False),  # the model's default temperature samples
        (CHAT, {"temperature": 0.7}, False),
        (CHAT, {"temperature": False}, False),
        (CHAT, {"seed": None}, False),
        (CHAT, {"seed": "7"}, False),
        ("/v1/completions", {"temperature": 0}, True),
        ("/v1/completions", {"temperature": 1}, False),
        ("/v1/embeddings", {}, True),
        ("/v1/score", {}, True),
        ("/v1/rerank", {}, True),
        ("/v1/audio/transcriptions", {"temperature": 0}, False),
    ],
)
def test_only_deterministic_requests_are_cacheable(url, fields, expected):
    assert cacheable(url, json.dumps({"model": "m", **fields}).encode()) is expected


@pytest.mark.parametrize("url", [CHAT, "/v1/completions"])
def test_sampled_opts_generation_that_samples_in(url):
    assert cacheable(url, b'{"model": "m", "temperature": 0.9}', sampled=True)


def test_sampled_never_caches_an_endpoint_of_unknown_kind():
    assert not cacheable("/v1/audio/transcriptions", b'{"file_url": "https://x/a.wav"}', sampled=True)


def test_line_key_gives_the_custom_id_and_none_for_a_request_that_samples():
    line = {"custom_id": "a", "method": "POST", "url": CHAT, "body": BODY}
    assert line_key(identity(), json.dumps(line).encode()) == ("a", key(BODY))
    sampling = {**line, "body": {**BODY, "temperature": 1}}
    assert line_key(identity(), json.dumps(sampling).encode()) == ("a", None)
    assert line_key(identity(), json.dumps(sampling).encode(), sampled=True)[1] is not None


def test_a_warm_servers_reported_weights_path_or_length_changes_the_model_identity_but_its_listing_time_does_not():
    from airflow_vllm_batch.batchfile.cache_keys import reported_models

    card = {
        "id": "m",
        "object": "model",
        "created": 1,
        "root": "/models/m",
        "max_model_len": 2048,
        "permission": [],
    }

    def served(**changes) -> str:
        return identity(engine_args=None, reported={"models": reported_models([{**card, **changes}])})

    assert served(created=2, permission=[{"id": "p"}]) == served()
    assert served(root="/models/m-v2") != served()
    assert served(max_model_len=4096) != served()
    assert identity(engine_args=None) != served()
