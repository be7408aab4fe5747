from __future__ import annotations

import io
import json

import pytest

from airflow_vllm_batch.batchfile import (
    PreflightOptions,
    open_lines,
    preflight,
)
from airflow_vllm_batch.exceptions import PreflightError

CHAT = "/v1/chat/completions"


def line(custom_id="req-1", url=CHAT, body=None, **top) -> bytes:
    """One valid chat request line (override any part)."""
    obj = {"custom_id": custom_id, "method": "POST", "url": url}
    obj["body"] = body if body is not None else {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    obj.update(top)
    return json.dumps(obj).encode()


def good(n: int) -> bytes:
    return b"".join(line(f"ok-{i}") + b"\n" for i in range(n))


def run(data: bytes, **options):
    with open_lines(io.BytesIO(data)) as lines:
        return preflight(lines, PreflightOptions(**options), reread=lambda: open_lines(io.BytesIO(data)))


# (name, file bytes, line number of the first problem, substring of its message)
MALFORMED = [
    ("not_json", good(1) + b"hello\n", 2, "not valid JSON"),
    ("truncated_json", good(2) + line()[:40] + b"\n", 3, "ends before the JSON object does"),
    ("two_objects_one_line", line() + b" " + line("x") + b"\n", 1, "trailing characters"),
    ("json_array", b"[1, 2]\n", 1, "a JSON array, not an object"),
    ("json_string", b'"text"\n', 1, "a JSON string, not an object"),
    ("json_number", good(1) + b"42\n", 2, "a JSON number"),
    ("bom", b"\xef\xbb\xbf" + line() + b"\n", 1, "byte order mark"),
    ("latin1_bytes", good(1) + line(body={"model": "m", "messages": [{"role": "user"}]}).replace(b"user", b"us\xe9r") + b"\n", 2, "not valid UTF-8"),
    ("invalid_utf8_in_skipped_field", good(1) + line().replace(b"hi", b"h\xff") + b"\n", 2, "not valid UTF-8"),
    ("missing_custom_id", good(1) + json.dumps({"method": "POST", "url": CHAT, "body": {}}).encode() + b"\n", 2, 'missing "custom_id"'),
    ("custom_id_number", line(custom_id=7) + b"\n", 1, '"custom_id" is a number'),
    ("custom_id_null", line(custom_id=None) + b"\n", 1, '"custom_id" is a null'),
    ("custom_id_empty", line(custom_id="") + b"\n", 1, '"custom_id" is empty'),
    ("duplicate_custom_id", good(3) + line("ok-1") + b"\n", 4, "repeats the one on line 2"),
    ("method_get", line(method="GET") + b"\n", 1, 'only "POST" is supported'),
    ("method_missing", json.dumps({"custom_id": "a", "url": CHAT, "body": {}}).encode() + b"\n", 1, 'missing "method"'),
    ("url_unsupported", good(1) + line(url="/v1/completions") + b"\n", 2, "is not served by this engine"),
    ("url_missing", json.dumps({"custom_id": "a", "method": "POST", "body": {}}).encode() + b"\n", 1, 'missing "url"'),
    ("url_not_string", line(url=5) + b"\n", 1, '"url" is a number'),
    ("body_missing", json.dumps({"custom_id": "a", "method": "POST", "url": CHAT}).encode() + b"\n", 1, 'missing "body"'),
    ("body_string", line(body="hello") + b"\n", 1, '"body" is a string, not an object'),
    ("chat_no_messages", line(body={"model": "m"}) + b"\n", 1, "missing required field `messages`"),
    ("chat_empty_messages", line(body={"model": "m", "messages": []}) + b"\n", 1, "length >= 1"),
    ("chat_message_not_object", line(body={"model": "m", "messages": ["hi"]}) + b"\n", 1, "body.messages[0]"),
    ("chat_message_no_role", line(body={"model": "m", "messages": [{"content": "hi"}]}) + b"\n", 1, "missing required field `role`"),
    ("stream_true", good(2) + line(body={"model": "m", "stream": True, "messages": [{"role": "user"}]}) + b"\n", 3, '"body.stream" is true'),
    ("stream_not_bool", line(body={"model": "m", "stream": "yes", "messages": [{"role": "user"}]}) + b"\n", 1, '"body.stream" must be a boolean'),
    ("model_missing", line(body={"messages": [{"role": "user"}]}) + b"\n", 1, '"body.model" is missing'),
    ("model_not_string", line(body={"model": 3, "messages": [{"role": "user"}]}) + b"\n", 1, '"body.model" is a number'),
    ("two_models", good(2) + line("x", body={"model": "other", "messages": [{"role": "user"}]}) + b"\n", 3, "but line 1 uses 'm'"),
    ("embeddings_no_input", line(url="/v1/embeddings", body={"model": "m"}) + b"\n", 1, '"input" (a string or a list) or "messages"'),
    ("embeddings_input_number", line(url="/v1/embeddings", body={"model": "m", "input": 5}) + b"\n", 1, "body.input"),
    ("score_half_pair", line(url="/v1/score", body={"model": "m", "text_1": "a"}) + b"\n", 1, '"text_1" and "text_2"'),
    ("rerank_no_documents", line(url="/v1/rerank", body={"model": "m", "query": "q"}) + b"\n", 1, '"query" and "documents"'),
    ("line_too_long", good(1) + line(body={"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}) + b"\n", 2, "over max_line_bytes=1,000"),
    ("crlf_blank_then_bad", good(1).replace(b"\n", b"\r\n") + b"\r\n" + b"{oops}\r\n", 3, "not valid JSON"),
    ("bad_last_line_without_newline", good(2) + b'{"custom_id": "z"', 3, "ends before the JSON object does"),
]


@pytest.mark.parametrize(("name", "data", "lineno", "reason"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_file_reports_line_and_reason(name, data, lineno, reason):
    max_bytes = 1000 if name == "line_too_long" else 1_000_000
    report = run(data, max_line_bytes=max_bytes)
    assert not report.ok
    first = report.problems[0]
    assert first.line == lineno, str(first)
    assert reason in first.message, str(first)


def test_corpus_has_at_least_thirty_cases():
    assert len(MALFORMED) >= 30


@pytest.mark.parametrize("name", ["openai_example_batch.jsonl", "embeddings_batch.jsonl", "score_batch.jsonl"])
def test_seed_example_request_files_pass(seed_dir, name):
    with open_lines(seed_dir / name) as lines:
        report = preflight(lines)
    assert report.ok, report.format()
    assert report.valid_lines == 2


def test_valid_lines_are_copied_byte_for_byte_to_cleaned_copy():
    data = line("a") + b"\n" + line("b").replace(b", ", b",   ") + b"\r\n" + line("c")
    out = io.BytesIO()
    with open_lines(io.BytesIO(data)) as lines:
        report = preflight(lines, cleaned_out=out)
    assert report.ok and not report.needs_rewrite
    assert out.getvalue() == data + b"\n"


def test_blank_lines_are_skipped_and_not_counted():
    report = run(b"\n" + good(2) + b"   \n\n")
    assert (report.ok, report.total_lines, report.blank_lines) == (True, 2, 3)


def test_line_numbers_count_blank_lines():
    report = run(b"\n\n" + b"nope\n")
    assert report.problems[0].line == 3


def test_every_problem_is_counted_but_only_first_are_listed():
    report = run(b"x\n" * 80, max_problems_listed=5)
    assert (report.problem_count, len(report.problems)) == (80, 5)
    assert "... and 75 more" in report.format()


def test_skip_mode_writes_invalid_lines_as_error_lines():
    data = good(1) + line("bad", method="GET") + b"\n" + b"junk\n"
    errors, cleaned = io.BytesIO(), io.BytesIO()
    with open_lines(io.BytesIO(data)) as lines:
        report = preflight(lines, PreflightOptions(invalid_lines="skip"), cleaned_out=cleaned, errors_out=errors)
    assert report.runnable and report.needs_rewrite and not report.ok
    written = [json.loads(x) for x in errors.getvalue().splitlines()]
    assert [(w["custom_id"], w["error"]["line"], w["error"]["code"]) for w in written] == [
        ("bad", 2, "invalid_request"),
        (None, 3, "invalid_request"),
    ]
    assert written[0]["response"]["status_code"] == 400
    assert cleaned.getvalue() == good(1)


def test_fail_mode_writes_nothing_to_errors_out():
    errors = io.BytesIO()
    with open_lines(io.BytesIO(b"junk\n")) as lines:
        preflight(lines, errors_out=errors)
    assert errors.getvalue() == b""


def test_expected_model_mismatch_is_a_problem():
    report = run(good(2), model="tiny")
    assert report.invalid_lines == 2
    assert "expected 'tiny'" in report.problems[0].message


def test_rewrite_model_sets_model_in_cleaned_copy():
    out = io.BytesIO()
    with open_lines(io.BytesIO(good(2))) as lines:
        report = preflight(lines, PreflightOptions(model="tiny", rewrite_model=True), cleaned_out=out)
    assert report.ok and report.needs_rewrite and report.rewritten_lines == 2
    assert [json.loads(x)["body"]["model"] for x in out.getvalue().splitlines()] == ["tiny", "tiny"]


def test_rewrite_model_fills_a_missing_model():
    out = io.BytesIO()
    data = line(body={"messages": [{"role": "user"}]}) + b"\n"
    with open_lines(io.BytesIO(data)) as lines:
        report = preflight(lines, PreflightOptions(model="tiny", rewrite_model=True), cleaned_out=out)
    assert report.ok
    assert json.loads(out.getvalue())["body"]["model"] == "tiny"


def test_default_body_is_added_only_where_missing():
    data = line("a") + b"\n" + line("b", body={"model": "m", "messages": [{"role": "u"}], "max_tokens": 9}) + b"\n"
    out = io.BytesIO()
    with open_lines(io.BytesIO(data)) as lines:
        report = preflight(lines, PreflightOptions(default_body={"max_tokens": 5}), cleaned_out=out)
    bodies = [json.loads(x)["body"] for x in out.getvalue().splitlines()]
    assert [b["max_tokens"] for b in bodies] == [5, 9]
    assert report.rewritten_lines == 1 and report.needs_rewrite


def test_unchanged_lines_keep_their_bytes_when_defaults_apply_elsewhere():
    kept = line("b", body={"model": "m", "messages": [{"role": "u"}], "max_tokens": 9})
    out = io.BytesIO()
    with open_lines(io.BytesIO(line("a") + b"\n" + kept + b"\n")) as lines:
        preflight(lines, PreflightOptions(default_body={"max_tokens": 5}), cleaned_out=out)
    assert out.getvalue().splitlines()[1] == kept


def test_duplicate_reports_repeat_and_first_line_and_custom_id():
    report = run(good(5) + line("ok-0") + b"\n")
    problem = report.problems[0]
    assert (problem.line, problem.custom_id) == (6, "ok-0")
    assert "line 1" in problem.message
    assert report.valid_lines == 5 and report.invalid_lines == 1


def test_duplicates_without_reread_are_counted_as_a_file_problem():
    with open_lines(io.BytesIO(good(3) + line("ok-2") + b"\n")) as lines:
        report = preflight(lines)
    assert report.invalid_lines == 1 and report.valid_lines == 3
    assert "1 request(s) repeat an earlier custom_id" in report.problems[-1].message


def test_duplicates_fail_the_file_even_in_skip_mode():
    report = run(good(2) + line("ok-0") + b"\n", invalid_lines="skip")
    assert not report.runnable


def test_max_lines_stops_reading_with_a_file_problem():
    report = run(good(10), max_lines=4)
    assert report.stopped_early and not report.runnable
    assert report.problems[0].line == 5 and "more than 4 requests" in report.problems[0].message
    assert report.total_lines == 4


def test_max_lines_ignores_blank_lines():
    assert run(b"\n\n" + good(3), max_lines=3).ok


def test_empty_file_is_a_file_problem():
    report = run(b"\n \n")
    assert not report.ok and "no requests" in report.problems[0].message


def test_skip_mode_with_nothing_valid_is_not_runnable():
    report = run(b"junk\n", invalid_lines="skip")
    assert not report.runnable


def test_mixed_urls_are_counted_per_url():
    data = line("a") + b"\n" + line("b", url="/v1/embeddings", body={"model": "m", "input": "x"}) + b"\n" + line("c") + b"\n"
    report = run(data)
    assert report.ok
    assert report.url_counts == {CHAT: 2, "/v1/embeddings": 1}


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "queries": "q", "documents": ["d"]},
        {"model": "m", "queries": "q", "items": ["d"]},
        {"model": "m", "data_1": "q", "data_2": ["d"]},
        {"model": "m", "text_1": "q", "text_2": "d"},
    ],
)
def test_score_accepts_each_vllm_field_pair(body):
    assert run(line(url="/v1/score", body=body) + b"\n").ok


def test_embeddings_accept_chat_style_messages():
    assert run(line(url="/v1/embeddings", body={"model": "m", "messages": [{"role": "user"}]}) + b"\n").ok


def test_url_outside_supported_urls_is_refused():
    report = run(line(url="/v1/embeddings", body={"model": "m", "input": "x"}) + b"\n", supported_urls=frozenset({CHAT}))
    assert "is not served" in report.problems[0].message


def test_non_ascii_utf8_text_is_valid():
    assert run(line(body={"model": "m", "messages": [{"role": "user", "content": "héllo 你好"}]}) + b"\n").ok


def test_raise_for_problems_names_source_counts_and_problems():
    report = run(b"junk\n" * 60)
    with pytest.raises(PreflightError) as excinfo:
        report.raise_for_problems("s3://b/in.jsonl")
    text = str(excinfo.value)
    assert "s3://b/in.jsonl failed preflight" in text and "line 1" in text and "... and 10 more" in text
    assert excinfo.value.report is report


def test_raise_for_problems_passes_in_skip_mode_with_valid_lines():
    run(good(1) + b"junk\n", invalid_lines="skip").raise_for_problems("x")


def test_report_to_dict_is_json_serialisable():
    assert json.loads(json.dumps(run(good(1) + b"junk\n").to_dict()))["invalid_lines"] == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"invalid_lines": "ignore"},
        {"rewrite_model": True},
        {"default_body": {"model": "x"}},
        {"supported_urls": frozenset()},
    ],
)
def test_bad_options_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        PreflightOptions(**kwargs)
