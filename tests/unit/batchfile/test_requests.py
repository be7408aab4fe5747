from __future__ import annotations

import io
import json

import pytest

from airflow_vllm_batch.batchfile import PreflightOptions, open_lines, preflight
from airflow_vllm_batch.batchfile.requests import (
    MAX_REQUESTS,
    MAX_REQUESTS_BYTES,
    batch_file_name,
    build_batch_file,
)
from airflow_vllm_batch.exceptions import ConfigurationError


def lines(data: bytes) -> list[dict]:
    return [json.loads(x) for x in data.splitlines()]


def test_prompts_become_chat_lines_numbered_by_index_with_the_model_and_defaults():
    data = build_batch_file(
        ["hi", "bye"], model="m", default_body={"temperature": 0, "max_completion_tokens": 8}
    )
    assert lines(data) == [
        {"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": text}], "model": "m", "temperature": 0, "max_completion_tokens": 8}}
        for i, text in enumerate(["hi", "bye"])
    ]  # fmt: skip


def test_the_file_passes_preflight():
    data = build_batch_file(
        ["a", [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]], model="m"
    )
    with open_lines(io.BytesIO(data)) as source:
        assert preflight(source, PreflightOptions(model="m")).ok


def test_message_lists_and_bodies_are_kept_and_a_body_keeps_its_own_model():
    conversation = [{"role": "user", "content": "u"}]
    body = {"model": "sql-lora", "messages": conversation, "temperature": 1.0}
    data = build_batch_file([conversation, body], model="m", default_body={"temperature": 0})
    assert [x["body"] for x in lines(data)] == [
        {"messages": conversation, "model": "m", "temperature": 0},
        {"model": "sql-lora", "messages": conversation, "temperature": 1.0},
    ]


def test_strings_become_embedding_inputs():
    assert lines(build_batch_file(["x"], model="e", url="/v1/embeddings"))[0]["body"] == {
        "input": "x",
        "model": "e",
    }


def test_strings_become_completion_prompts():
    data = build_batch_file(
        ["Once upon a time"], model="m", url="/v1/completions", default_body={"max_tokens": 8}
    )
    assert lines(data)[0]["body"] == {"prompt": "Once upon a time", "model": "m", "max_tokens": 8}
    assert lines(data)[0]["url"] == "/v1/completions"


def test_custom_id_from_a_key_leaves_the_body():
    data = build_batch_file(
        [
            {"id": "row-7", "messages": [{"role": "user", "content": "u"}]},
            {"id": 8, "messages": [{"role": "user"}]},
        ],
        model="m",
        custom_id="id",
    )
    assert [(x["custom_id"], "id" in x["body"]) for x in lines(data)] == [("row-7", False), ("8", False)]


def test_the_same_requests_give_the_same_bytes_and_name():
    make = lambda: build_batch_file(
        [{"messages": [{"role": "user", "content": "é"}], "b": 1, "a": 2}], model="m"
    )
    assert make() == make()
    assert batch_file_name(make()) == batch_file_name(make())
    assert batch_file_name(make()) != batch_file_name(build_batch_file(["other"], model="m"))


@pytest.mark.parametrize(
    ("requests", "options", "message"),
    [
        ("just one string", {}, "must be a list"),
        ({"a": 1}, {}, "must be a list"),
        ([], {}, "is empty"),
        ([42], {}, r"requests\[0\] is int 42"),
        (["q"], {"url": "/v1/score"}, "needs a request body"),
        (["a", "b"], {"custom_id": "id"}, "is not an object"),
        ([{"messages": []}], {"custom_id": "id"}, "has no non-empty 'id'"),
        ([{"id": "x"}, {"id": "x"}], {"custom_id": "id"}, "repeats an earlier item's"),
    ],
)
def test_unusable_requests_fail_naming_the_item(requests, options, message):
    with pytest.raises(ConfigurationError, match=message):
        build_batch_file(requests, model="m", **options)


@pytest.mark.parametrize(
    "mapped_output",
    [[["a", "b"], ["c"]], [[{"messages": [{"role": "user", "content": "u"}]}], [{"input": "x"}]]],
    ids=["prompts", "bodies"],
)
def test_the_lists_of_a_mapped_upstream_fail_saying_to_flatten_them(mapped_output):
    with pytest.raises(ConfigurationError, match=r"requests\[0\] is list .*from a mapped task.*flatten"):
        build_batch_file(mapped_output, model="m")


def test_more_requests_than_xcom_takes_fail_pointing_to_input_uri():
    with pytest.raises(ConfigurationError, match=r"10,000 requests.*input_uri"):
        build_batch_file(["x"] * (MAX_REQUESTS + 1), model="m")


def test_more_bytes_than_xcom_takes_fail_pointing_to_input_uri():
    with pytest.raises(ConfigurationError, match=r"MiB of requests.*input_uri"):
        build_batch_file(["x" * (MAX_REQUESTS_BYTES // 4)] * 5, model="m")
