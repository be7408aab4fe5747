from __future__ import annotations

import contextlib
import json

import pytest

from airflow_vllm_batch.batchfile import (
    Failed,
    Scores,
    Text,
    Vector,
    iter_answers,
    read_answers,
)
from airflow_vllm_batch.exceptions import ConfigurationError, ResultsCheckError


def ok(custom_id: str, body: dict) -> bytes:
    return json.dumps(
        {
            "id": "v",
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": "r", "body": body},
            "error": None,
        }
    ).encode()


CHAT = ok(
    "c",
    {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}}],
    },
)
EMBEDDING = ok(
    "e", {"object": "list", "data": [{"index": 0, "object": "embedding", "embedding": [0.5, -1.0]}]}
)
TWO_EMBEDDINGS = ok(
    "e2", {"object": "list", "data": [{"index": 1, "embedding": [2.0]}, {"index": 0, "embedding": [1.0]}]}
)
SCORE = ok(
    "s",
    {
        "object": "list",
        "data": [
            {"index": 1, "object": "score", "score": 0.25},
            {"index": 0, "object": "score", "score": 0.75},
        ],
    },
)
RERANK = ok(
    "r", {"id": "x", "results": [{"index": 1, "relevance_score": 0.1}, {"index": 0, "relevance_score": 0.9}]}
)
ENGINE_ERROR = json.dumps(
    {
        "id": "v",
        "custom_id": "x",
        "response": {"status_code": 400, "request_id": "r", "body": None},
        "error": {"error": {"message": "too long"}},
    }
).encode()
OUR_ERROR = json.dumps(
    {
        "id": None,
        "custom_id": None,
        "response": {"status_code": 400, "request_id": None, "body": None},
        "error": {"code": "invalid_request", "message": "not valid JSON", "line": 3},
    }
).encode()
COMPLETION = ok(
    "t",
    {
        "object": "text_completion",
        "choices": [{"index": 1, "text": " second"}, {"index": 0, "text": " upon a time", "logprobs": None}],
    },
)
OLD_SHAPE = json.dumps(
    {
        "id": "v",
        "custom_id": "o",
        "response": {"object": "chat.completion", "choices": [{"message": {"content": "old"}}]},
        "error": None,
    }
).encode()


def test_each_kind_of_result_is_one_typed_pair():
    answers = list(
        iter_answers(
            [
                CHAT,
                b"",
                COMPLETION,
                EMBEDDING,
                TWO_EMBEDDINGS,
                SCORE,
                RERANK,
                ENGINE_ERROR,
                OUR_ERROR,
                OLD_SHAPE,
            ]
        )
    )
    assert answers == [
        Text("c", "hello"),
        Text("t", " upon a time"),
        Vector("e", [0.5, -1.0]),
        Vector("e2", [[1.0], [2.0]]),
        Scores("s", [0.75, 0.25]),
        Scores("r", [0.9, 0.1]),
        Failed("x", "too long"),
        Failed(None, "not valid JSON"),
        Text("o", "old"),
    ]
    custom_id, text = answers[0]
    assert (custom_id, text) == ("c", "hello")


def test_a_line_of_no_known_kind_is_named():
    with pytest.raises(ResultsCheckError, match=r"line 2 .*custom_id 'z'"):
        list(iter_answers([CHAT, ok("z", {"object": "something"})]))


def manifest(tmp_path, results: list[bytes], errors: list[bytes], completed: int, failed: int) -> dict:
    (tmp_path / "results.jsonl").write_bytes(b"".join(x + b"\n" for x in results))
    (tmp_path / "errors.jsonl").write_bytes(b"".join(x + b"\n" for x in errors))
    return {
        "output_uri": str(tmp_path / "results.jsonl"),
        "error_uri": str(tmp_path / "errors.jsonl") if errors else None,
        "request_counts": {"total": completed + failed, "completed": completed, "failed": failed},
    }


def test_a_manifest_gives_its_results_then_its_failures(tmp_path):
    answers = list(read_answers(manifest(tmp_path, [CHAT, EMBEDDING], [ENGINE_ERROR], 2, 1)))
    assert [type(a) for a in answers] == [Text, Vector, Failed]
    assert (
        len(list(read_answers(manifest(tmp_path, [CHAT, EMBEDDING], [ENGINE_ERROR], 2, 1), errors=False)))
        == 2
    )


def test_results_that_no_longer_match_the_manifest_fail(tmp_path):
    with pytest.raises(ResultsCheckError, match="does not match its manifest"):
        list(read_answers(manifest(tmp_path, [CHAT], [], 2, 0)))


def test_a_custom_id_answered_twice_fails(tmp_path):
    with pytest.raises(ResultsCheckError, match="'c' is answered twice"):
        list(read_answers(manifest(tmp_path, [CHAT, CHAT], [], 2, 0)))


def test_one_file_is_read_as_it_is(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(CHAT + b"\n")
    assert list(read_answers(str(path))) == [Text("c", "hello")]


def test_an_s3_uri_without_an_opener_is_refused_naming_the_storage_reader():
    with pytest.raises(
        ConfigurationError, match=r"s3://b/r.jsonl: .*airflow_vllm_batch\.storage\.read_answers"
    ):
        list(read_answers({"output_uri": "s3://b/r.jsonl", "request_counts": {}}))


def test_every_file_a_manifest_names_is_opened_with_open_uri():
    files = {"mem://results": [CHAT], "mem://errors": [ENGINE_ERROR]}
    opened = []

    @contextlib.contextmanager
    def open_uri(uri):
        opened.append(uri)
        yield iter(files[uri])

    source = {
        "output_uri": "mem://results",
        "error_uri": "mem://errors",
        "request_counts": {"completed": 1, "failed": 1},
    }
    assert list(read_answers(source, open_uri=open_uri)) == [Text("c", "hello"), Failed("x", "too long")]
    assert opened == ["mem://results", "mem://errors"]
