"""A stopped batch's files answer each request once; OpenAI's line shape, line by line."""

from __future__ import annotations

import io
import json

import pytest

from airflow_vllm_batch.batchfile.openai_lines import (
    answer_outcome,
    request_ids,
    split_stopped,
    stopped_line,
    to_openai_line,
)


def ok(cid: str) -> bytes:
    return json.dumps(
        {
            "id": f"vllm-{cid}",
            "custom_id": cid,
            "response": {"status_code": 200, "request_id": "r", "body": {"usage": {"total_tokens": 3}}},
            "error": None,
        }
    ).encode()


def refused(cid: str, status: int = 400) -> bytes:
    error = {
        "object": "error",
        "message": f"{cid} is too long",
        "type": "BadRequestError",
        "param": None,
        "code": status,
    }
    return json.dumps(
        {
            "id": f"vllm-{cid}",
            "custom_id": cid,
            "response": {"status_code": status, "request_id": "r", "body": None},
            "error": error,
        }
    ).encode()


def request(cid: str) -> bytes:
    return json.dumps(
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {}}
    ).encode()


@pytest.mark.parametrize("reason", ["expired", "cancelled"])
def test_a_stopped_batch_writes_each_request_once_its_first_answer_or_batch_reason(reason):
    results, errors = io.BytesIO(), io.BytesIO()
    answers = [ok("a"), refused("b"), ok("a"), refused("a"), ok("stranger"), b"", b"not json"]
    counts = split_stopped(
        answers,
        request_ids([request("a"), request("b"), request("c"), b"", b"{}", request("c")]),
        results,
        errors,
        reason,
    )
    assert counts == {"total": 3, "completed": 1, "failed": 2}
    assert [json.loads(r)["custom_id"] for r in results.getvalue().splitlines()] == ["a"]
    failed = {json.loads(r)["custom_id"]: json.loads(r) for r in errors.getvalue().splitlines()}
    assert set(failed) == {"b", "c"}
    assert failed["b"]["error"]["code"] == "invalid_request"
    assert failed["b"]["response"]["status_code"] == 400
    assert failed["c"] == json.loads(stopped_line("c", reason))
    assert failed["c"]["error"]["code"] == f"batch_{reason}"


def test_a_stopped_batch_keeps_a_success_over_an_earlier_failure_and_a_4xx_over_an_earlier_5xx():
    # Two tries' checkpoints answering one request (Durability: a zombie's engine_crash listed first).
    results, errors = io.BytesIO(), io.BytesIO()
    answers = [refused("a", 500), refused("b", 500), refused("a", 400), ok("a"), refused("b", 400)]
    counts = split_stopped(answers, request_ids([request("a"), request("b")]), results, errors, "expired")
    assert counts == {"total": 2, "completed": 1, "failed": 1}
    assert [json.loads(r)["custom_id"] for r in results.getvalue().splitlines()] == ["a"]
    assert [json.loads(r)["response"]["status_code"] for r in errors.getvalue().splitlines()] == [400]


def test_a_stopped_line_is_the_same_bytes_on_every_try():
    assert stopped_line("c", "expired") == stopped_line("c", "expired") != stopped_line("c", "cancelled")
    assert json.loads(stopped_line("c", "expired"))["id"].startswith("batch_req_")


def test_an_http_failure_takes_openais_shape_body_error_and_null_error():
    line = json.loads(to_openai_line(refused("b", 400)))
    assert line["id"] == "batch_req_b"
    assert line["error"] is None
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"] == {
        "message": "b is too long",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert (
        json.loads(to_openai_line(refused("b", 503)))["response"]["body"]["error"]["type"] == "server_error"
    )


def test_an_error_already_in_the_error_files_shape_keeps_its_code():
    raw = json.dumps(
        {
            "id": "vllm-x",
            "custom_id": "x",
            "response": {"status_code": 404, "body": None},
            "error": {"code": "not_found", "message": "no route", "line": 3},
        }
    ).encode()
    body = json.loads(to_openai_line(raw))["response"]["body"]["error"]
    assert body["code"] == "not_found"
    assert body["message"] == "no route"


def test_a_failure_without_a_response_keeps_error_only():
    crash = json.dumps(
        {
            "id": None,
            "custom_id": "x",
            "response": None,
            "error": {"code": "engine_crash", "message": "died twice", "line": 2},
        }
    ).encode()
    line = json.loads(to_openai_line(crash))
    assert line["response"] is None
    assert line["error"] == {"code": "engine_crash", "message": "died twice"}
    assert line["id"].startswith("batch_req_")
    assert line["id"] == json.loads(to_openai_line(crash))["id"]


def test_a_completed_answer_keeps_its_body_and_gets_a_batch_req_id():
    line = json.loads(to_openai_line(ok("a")))
    assert line["id"] == "batch_req_a"
    assert line["response"]["body"] == {"usage": {"total_tokens": 3}}
    assert line["error"] is None
    assert to_openai_line(to_openai_line(ok("a"))) == to_openai_line(ok("a"))


@pytest.mark.parametrize(
    ("raw", "outcome"),
    [(ok("a"), ("a", True)), (refused("b"), ("b", False)), (b"{}", None), (b"x", None), (b" ", None)],
)
def test_an_answers_outcome(raw, outcome):
    assert answer_outcome(raw) == outcome
