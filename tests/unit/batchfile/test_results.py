from __future__ import annotations

import io
import json
from pathlib import Path

import openai.types
import openai.types.chat
import pytest

from airflow_vllm_batch.batchfile import (
    PreflightOptions,
    check_results,
    error_line,
    open_lines,
    preflight,
)
from airflow_vllm_batch.exceptions import ResultsCheckError

DATA = Path(__file__).parent / "data"


def request(cid: str) -> bytes:
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user"}]},
        }
    ).encode()


def ok_result(cid: str, prompt: int = 3, completion: int = 2) -> bytes:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    return json.dumps(
        {
            "id": "vllm-1",
            "custom_id": cid,
            "response": {"status_code": 200, "request_id": "r", "body": body},
            "error": None,
        }
    ).encode()


def failed_result(cid: str, status: int = 400, error: object = "bad request") -> bytes:
    return json.dumps(
        {
            "id": "vllm-2",
            "custom_id": cid,
            "response": {"status_code": status, "request_id": "r", "body": None},
            "error": error,
        }
    ).encode()


ENGINE_DEAD = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


def check(results: list[bytes], inputs: list[bytes] | None, **kwargs):
    rdata = b"\n".join(results)  # like vLLM's upload: no final newline
    idata = b"\n".join(inputs) + b"\n" if inputs is not None else None
    with open_lines(io.BytesIO(rdata)) as rl:
        il = open_lines(io.BytesIO(idata)) if idata is not None else None
        with il if il is not None else _null() as lines:
            return check_results(
                rl,
                lines,
                reread_input=(lambda: open_lines(io.BytesIO(idata))) if idata is not None else None,
                reread_results=lambda: open_lines(io.BytesIO(rdata)),
                **kwargs,
            )


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", ["chat_results_example.jsonl", "score_results_example.jsonl"])
def test_seed_result_examples_parse(seed_dir, name):
    with open_lines(seed_dir / name) as lines:
        report = check_results(lines, None)
    assert report.ok
    assert report.request_counts == {"total": 2, "completed": 2, "failed": 0}


def test_old_shape_usage_is_summed(seed_dir):
    with open_lines(seed_dir / "chat_results_example.jsonl") as lines:
        report = check_results(lines, None)
    assert report.usage == {"prompt_tokens": 52, "completion_tokens": 36, "total_tokens": 88}
    assert report.endpoint_counts == {"/v1/chat/completions": 2}


def test_current_shape_score_is_counted_per_endpoint(seed_dir):
    with open_lines(seed_dir / "score_results_example.jsonl") as lines:
        report = check_results(lines, None)
    assert report.endpoint_counts == {"/v1/score": 2}
    assert report.usage["prompt_tokens"] == 74


def test_complete_answers_are_ok():
    report = check([ok_result("a"), ok_result("b")], [request("a"), request("b")])
    assert report.ok
    assert report.request_counts == {"total": 2, "completed": 2, "failed": 0}
    assert report.usage == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}


def test_missing_answer_is_named_with_input_line():
    report = check([ok_result("a")], [request("a"), request("b")])
    assert not report.ok
    assert report.missing_count == 1
    assert (report.missing[0].line, report.missing[0].custom_id) == (2, "b")


def test_extra_answer_is_named_with_result_line():
    report = check([ok_result("a"), ok_result("zz")], [request("a")])
    assert report.extra_count == 1
    assert (report.extra[0].line, report.extra[0].custom_id) == (2, "zz")


def test_repeated_answer_is_named_with_both_result_lines():
    report = check([ok_result("a"), ok_result("b"), ok_result("a")], [request("a"), request("b")])
    assert report.duplicate_count == 1
    assert report.duplicates[0].line == 3
    assert "result line 1" in report.duplicates[0].message


def test_with_duplicates_first_a_repeated_answer_keeps_the_first_in_both_files_and_is_not_a_mismatch():
    successes, errors = io.BytesIO(), io.BytesIO()
    first_b = failed_result("b", 400, "bad temperature")
    results = [
        ok_result("a", prompt=1),
        first_b,
        ok_result("a", prompt=100),
        failed_result("b", 422, "other"),
        ok_result("c"),
    ]
    report = check(
        results,
        [request("a"), request("b"), request("c")],
        results_out=successes,
        errors_out=errors,
        duplicates="first",
    )
    assert report.ok
    assert report.dropped_duplicates == 2
    assert report.request_counts == {"total": 3, "completed": 2, "failed": 1}
    assert report.prompt_tokens == 1 + 3  # the later answer of "a" is not counted
    assert successes.getvalue() == ok_result("a", prompt=1) + b"\n" + ok_result("c")
    assert [json.loads(line)["error"]["message"] for line in errors.getvalue().splitlines()] == [
        "bad temperature"
    ]


def engine_crash_result(cid: str) -> bytes:
    """What the runner checkpoints for a request in flight at two engine deaths in a row (runner_deaths.crash_line)."""
    return json.dumps(
        {
            "id": f"vllm-engine-crash-{cid}",
            "custom_id": cid,
            "response": {"status_code": 500, "request_id": None, "body": None},
            "error": {"code": "engine_crash", "message": "died twice", "line": None},
        }
    ).encode()


def test_with_duplicates_first_a_success_beats_an_earlier_failure_of_the_same_request():
    # Simulator seed 10097: a zombie try's part answered r0 engine_crash, listed before its
    # successor's part answering r0 with a 200; keeping the first published the failure and
    # dropped the durable answer.
    successes, errors = io.BytesIO(), io.BytesIO()
    results = [engine_crash_result("a"), failed_result("b", 400), ok_result("a", prompt=7), ok_result("b")]
    report = check(
        results, [request("a"), request("b")], results_out=successes, errors_out=errors, duplicates="first"
    )
    assert report.ok
    assert report.dropped_duplicates == 2
    assert report.request_counts == {"total": 2, "completed": 2, "failed": 0}
    assert report.prompt_tokens == 7 + 3
    assert successes.getvalue() == ok_result("a", prompt=7) + b"\n" + ok_result("b")
    assert errors.getvalue() == b""  # no error line for a request that is in the results


def test_with_duplicates_first_a_4xx_beats_an_earlier_engine_crash_and_a_later_one_of_the_same_request():
    errors = io.BytesIO()
    results = [engine_crash_result("a"), failed_result("a", 400, "too long"), engine_crash_result("a")]
    report = check(results, [request("a")], results_out=io.BytesIO(), errors_out=errors, duplicates="first")
    assert report.ok
    assert report.dropped_duplicates == 2
    assert report.request_counts == {"total": 1, "completed": 0, "failed": 1}
    assert report.status_counts == {"400": 1}
    assert [json.loads(line)["error"]["message"] for line in errors.getvalue().splitlines()] == ["too long"]


def test_with_duplicates_first_a_success_beats_an_answer_that_does_not_fit_the_output_schema():
    import pydantic

    from airflow_vllm_batch.batchfile.structured import OutputSchema

    class Count(pydantic.BaseModel):
        n: int

    def chat(cid: str, text: str) -> bytes:
        body = {"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": text}}]}
        return json.dumps(
            {"id": "x", "custom_id": cid, "response": {"status_code": 200, "body": body}, "error": None}
        ).encode()

    schema = OutputSchema(Count)
    successes, errors = io.BytesIO(), io.BytesIO()
    report = check(
        [chat("a", "not json"), chat("a", '{"n": 1}')],
        [request("a")],
        results_out=successes,
        errors_out=errors,
        duplicates="first",
        output_schema=schema,
    )
    assert report.request_counts == {"total": 1, "completed": 1, "failed": 0}
    assert report.invalid_output == 0
    assert errors.getvalue() == b""


def test_with_duplicates_first_an_answer_to_a_custom_id_not_in_the_input_is_still_a_mismatch():
    report = check(
        [ok_result("a"), ok_result("zz"), ok_result("zz")],
        [request("a")],
        duplicates="first",
        results_out=io.BytesIO(),
    )
    assert not report.ok
    assert report.extra_count == 2


def test_with_duplicates_first_a_missing_answer_is_still_a_mismatch():
    report = check(
        [ok_result("a"), ok_result("a")],
        [request("a"), request("b")],
        duplicates="first",
        results_out=io.BytesIO(),
    )
    assert not report.ok
    assert report.missing_count == 1
    assert report.dropped_duplicates == 1


def test_failed_lines_are_counted_and_written_with_an_error_object():
    errors = io.BytesIO()
    report = check([ok_result("a"), failed_result("b")], [request("a"), request("b")], errors_out=errors)
    assert report.request_counts == {"total": 2, "completed": 1, "failed": 1}
    assert report.status_counts == {"200": 1, "400": 1}
    written = json.loads(errors.getvalue())
    assert written["error"] == {"code": "invalid_request", "message": "bad request", "line": 2}
    assert written["response"] == {"status_code": 400, "request_id": "r", "body": None}
    assert report.sample_errors == ["b: bad request"]


def test_error_object_with_status_200_is_failed():
    report = check([failed_result("a", status=200, error={"message": "boom"})], None)
    assert report.failed == 1
    assert report.sample_errors == ["a: boom"]


def test_engine_death_is_detected():
    report = check([failed_result(c, 500, ENGINE_DEAD) for c in "abc"], [request(c) for c in "abc"])
    assert report.engine_failure
    assert report.answers_ok


def test_plain_server_errors_are_not_an_engine_failure():
    report = check([failed_result("a", 500, "out of memory")], None)
    assert not report.engine_failure


def test_an_error_that_only_mentions_enginecore_is_not_an_engine_failure():
    # Only vLLM's EngineDeadError message, whole, says the engine core died.
    report = check(
        [failed_result("a", 500, {"error": {"message": "EngineCore busy: request rejected", "code": 500}})],
        None,
    )
    assert not report.engine_failure


def test_an_engine_death_after_some_answers_is_still_an_engine_failure():
    # vLLM 0.32 answers what it finished, then every other request with the engine-dead error.
    report = check([ok_result("a"), failed_result("b", 500, ENGINE_DEAD)], None)
    assert report.engine_failure
    assert report.engine_dead_lines == 1


def test_stats_only_without_input():
    report = check([ok_result("a"), ok_result("a")], None)
    assert report.ok
    assert not report.input_checked
    assert report.total == 2


def test_unreadable_result_line_is_reported():
    report = check([ok_result("a"), b"{oops"], None)
    assert not report.ok
    assert report.unparseable[0].line == 2


def test_blank_result_lines_are_skipped():
    report = check([ok_result("a"), b"", ok_result("b"), b""], [request("a"), request("b")])
    assert report.ok
    assert report.total == 2


def test_raise_for_mismatch_lists_what_is_missing():
    report = check([ok_result("a")], [request("a"), request("b")])
    with pytest.raises(ResultsCheckError, match=r"1 input request\(s\) without a result"):
        report.raise_for_mismatch("results.jsonl")


def test_raise_for_mismatch_passes_when_ok():
    check([ok_result("a")], [request("a")]).raise_for_mismatch()


def test_many_missing_are_counted_but_first_listed():
    report = check([], [request(str(i)) for i in range(120)])
    assert report.missing_count == 120
    assert len(report.missing) == 50
    assert [p.line for p in report.missing[:3]] == [1, 2, 3]


def test_preflight_error_lines_read_as_failed_results():
    line = b'{"id":null,"custom_id":null,"response":{"status_code":400,"request_id":null,"body":null},"error":{"code":"invalid_request","message":"x","line":3}}'
    report = check([line], None)
    assert report.failed == 1
    assert report.status_counts == {"400": 1}


def test_to_dict_matches_the_manifest_keys():
    data = check([ok_result("a")], [request("a")]).to_dict()
    assert set(data["request_counts"]) == {"total", "completed", "failed"}
    assert set(data["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    json.dumps(data)


@pytest.mark.parametrize(
    ("status", "error", "expected"),
    [
        (
            400,
            "Request must not be sent in stream mode",
            {"code": "invalid_request", "message": "Request must not be sent in stream mode"},
        ),
        (500, ENGINE_DEAD, {"code": "engine_error", "message": ENGINE_DEAD["error"]["message"]}),
        (500, None, {"code": "engine_error", "message": "the engine answered with HTTP status 500"}),
        (429, None, {"code": "rate_limited", "message": "the engine answered with HTTP status 429"}),
        (418, "teapot", {"code": "http_418", "message": "teapot"}),
        (200, {"message": "boom"}, {"code": "engine_error", "message": "boom"}),
        (
            400,
            {"code": "invalid_request", "message": "from preflight", "line": 9},
            {"code": "invalid_request", "message": "from preflight", "line": 9},
        ),
    ],
    ids=[
        "string",
        "vllm_error_response",
        "null_500",
        "null_429",
        "other_status",
        "message_object",
        "preflight_shape",
    ],
)
def test_every_failed_line_gets_an_error_object_with_code_message_and_line(status, error, expected):
    errors = io.BytesIO()
    check([failed_result("a", status, error)], None, errors_out=errors)
    assert json.loads(errors.getvalue())["error"] == {"line": None, **expected}


def test_results_out_holds_only_the_successful_lines_exactly():
    out = io.BytesIO()
    oks = [ok_result("a"), ok_result("c").replace(b", ", b",  ")]
    check([oks[0], failed_result("b"), oks[1], failed_result("d")], None, results_out=out)
    assert out.getvalue() == oks[0] + b"\n" + oks[1]


@pytest.mark.parametrize(
    "data",
    [
        ok_result("a") + b"\n" + ok_result("b"),
        ok_result("a") + b"\n" + ok_result("b") + b"\n",
        ok_result("a") + b"\r\n" + ok_result("b") + b"\r\n",
    ],
    ids=["no_final_newline", "final_newline", "crlf"],
)
def test_results_out_equals_the_results_file_when_nothing_failed(data):
    out = io.BytesIO()
    with open_lines(io.BytesIO(data), chunk_size=7) as lines:
        check_results(lines, results_out=out)
    assert out.getvalue() == data


def test_engine_and_preflight_error_lines_have_one_shape():
    errors = io.BytesIO()
    check([failed_result("a", 500, "boom")], [request("a")], errors_out=errors)
    engine = json.loads(errors.getvalue())
    skipped = json.loads(error_line(4, "b", "not valid JSON"))
    assert list(engine) == list(skipped) == ["id", "custom_id", "response", "error"]
    assert list(engine["error"]) == list(skipped["error"]) == ["code", "message", "line"]


def preflight_of(data: bytes, **options):
    with open_lines(io.BytesIO(data)) as lines:
        return preflight(
            lines, PreflightOptions(**options), cleaned_out=io.BytesIO(), errors_out=io.BytesIO()
        )


def test_preflight_index_replaces_reading_the_input_again():
    inputs = b"\n".join([request("a"), request("b"), request("c")]) + b"\n"
    results = b"\n".join([ok_result("c"), ok_result("a"), ok_result("x")])
    index = preflight_of(inputs).custom_ids
    with open_lines(io.BytesIO(results)) as rl:
        report = check_results(rl, input_index=index, reread_input=lambda: open_lines(io.BytesIO(inputs)))
    assert (report.input_total, report.missing_count, report.extra_count) == (3, 1, 1)
    assert (report.missing[0].line, report.missing[0].custom_id) == (2, "b")


def test_preflight_index_and_input_lines_give_the_same_report():
    inputs = b"\n".join([request("a"), b"", request("b")]) + b"\n"
    results = [ok_result("b"), failed_result("a"), ok_result("z")]
    by_lines = check(results, [request("a"), b"", request("b")]).to_dict()
    rdata = b"\n".join(results)
    with open_lines(io.BytesIO(rdata)) as rl:
        by_index = check_results(
            rl,
            input_index=preflight_of(inputs).custom_ids,
            reread_results=lambda: open_lines(io.BytesIO(rdata)),
        ).to_dict()
    assert by_index == by_lines


def test_error_line_names_the_line_of_the_file_the_engine_read():
    inputs = request("a") + b"\njunk\n" + request("b") + b"\n"
    index = preflight_of(inputs, invalid_lines="skip").custom_ids  # the engine reads a, b
    errors = io.BytesIO()
    with open_lines(io.BytesIO(ok_result("a") + b"\n" + failed_result("b"))) as rl:
        check_results(rl, input_index=index, errors_out=errors)
    assert json.loads(errors.getvalue())["error"]["line"] == 2


def test_input_lines_and_input_index_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        check_results([], [request("a")], input_index=preflight_of(request("a") + b"\n").custom_ids)


@pytest.mark.parametrize("line", [request("a"), b'{"name": "x"}'], ids=["request_line", "other_object"])
def test_a_line_without_response_or_error_is_not_a_result(line):
    report = check([ok_result("a"), line], None)
    assert not report.ok
    assert report.unparseable[0].line == 2
    assert "not a result line" in report.unparseable[0].message


@pytest.mark.parametrize(
    ("name", "body_type"),
    [
        ("vllm_chat_results.jsonl", openai.types.chat.ChatCompletion),
        ("vllm_embeddings_results.jsonl", openai.types.CreateEmbeddingResponse),
    ],
)
def test_every_published_result_parses_with_the_openai_sdk_types(name, body_type):
    results, errors = io.BytesIO(), io.BytesIO()
    with open_lines(DATA / name) as lines:
        report = check_results(lines, results_out=results, errors_out=errors)
    assert (report.completed, report.failed) == (
        len(results.getvalue().splitlines()),
        len(errors.getvalue().splitlines()),
    )
    assert report.completed >= 2
    assert report.failed >= 1
    for raw in results.getvalue().splitlines():
        body_type.model_validate(json.loads(raw)["response"]["body"])
    for raw in errors.getvalue().splitlines():
        error = json.loads(raw)["error"]
        assert isinstance(error["code"], str)
        assert isinstance(error["message"], str)
        assert error["line"] is None
