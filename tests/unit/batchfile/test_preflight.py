from __future__ import annotations

import gzip
import io
import json
import re

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
    obj["body"] = (
        body if body is not None else {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
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
    (
        "latin1_bytes",
        good(1)
        + line(body={"model": "m", "messages": [{"role": "user"}]}).replace(b"user", b"us\xe9r")
        + b"\n",
        2,
        "not valid UTF-8",
    ),
    (
        "invalid_utf8_in_skipped_field",
        good(1) + line().replace(b"hi", b"h\xff") + b"\n",
        2,
        "not valid UTF-8",
    ),
    (
        "missing_custom_id",
        good(1) + json.dumps({"method": "POST", "url": CHAT, "body": {}}).encode() + b"\n",
        2,
        'missing "custom_id"',
    ),
    ("custom_id_number", line(custom_id=7) + b"\n", 1, '"custom_id" is a number'),
    ("custom_id_null", line(custom_id=None) + b"\n", 1, '"custom_id" is a null'),
    ("custom_id_empty", line(custom_id="") + b"\n", 1, '"custom_id" is empty'),
    ("duplicate_custom_id", good(3) + line("ok-1") + b"\n", 4, "repeats the one on line 2"),
    ("method_get", line(method="GET") + b"\n", 1, 'only "POST" is supported'),
    (
        "method_missing",
        json.dumps({"custom_id": "a", "url": CHAT, "body": {}}).encode() + b"\n",
        1,
        'missing "method"',
    ),
    ("url_unsupported", good(1) + line(url="/v1/completions") + b"\n", 2, "is not served by this engine"),
    (
        "url_missing",
        json.dumps({"custom_id": "a", "method": "POST", "body": {}}).encode() + b"\n",
        1,
        'missing "url"',
    ),
    ("url_not_string", line(url=5) + b"\n", 1, '"url" is a number'),
    (
        "body_missing",
        json.dumps({"custom_id": "a", "method": "POST", "url": CHAT}).encode() + b"\n",
        1,
        'missing "body"',
    ),
    ("body_string", line(body="hello") + b"\n", 1, '"body" is a string, not an object'),
    ("chat_no_messages", line(body={"model": "m"}) + b"\n", 1, "missing required field `messages`"),
    ("chat_empty_messages", line(body={"model": "m", "messages": []}) + b"\n", 1, "length >= 1"),
    ("chat_message_not_object", line(body={"model": "m", "messages": ["hi"]}) + b"\n", 1, "body.messages[0]"),
    (
        "chat_message_no_role",
        line(body={"model": "m", "messages": [{"content": "hi"}]}) + b"\n",
        1,
        "missing required field `role`",
    ),
    (
        "stream_true",
        good(2) + line(body={"model": "m", "stream": True, "messages": [{"role": "user"}]}) + b"\n",
        3,
        '"body.stream" is true',
    ),
    (
        "stream_not_bool",
        line(body={"model": "m", "stream": "yes", "messages": [{"role": "user"}]}) + b"\n",
        1,
        '"body.stream" must be a boolean',
    ),
    ("model_missing", line(body={"messages": [{"role": "user"}]}) + b"\n", 1, '"body.model" is missing'),
    (
        "model_not_string",
        line(body={"model": 3, "messages": [{"role": "user"}]}) + b"\n",
        1,
        '"body.model" is a number',
    ),
    (
        "two_models",
        good(2) + line("x", body={"model": "other", "messages": [{"role": "user"}]}) + b"\n",
        3,
        "but line 1 uses 'm'",
    ),
    (
        "embeddings_no_input",
        line(url="/v1/embeddings", body={"model": "m"}) + b"\n",
        1,
        '"input" (a string or a list) or "messages"',
    ),
    (
        "embeddings_input_number",
        line(url="/v1/embeddings", body={"model": "m", "input": 5}) + b"\n",
        1,
        "body.input",
    ),
    (
        "score_half_pair",
        line(url="/v1/score", body={"model": "m", "text_1": "a"}) + b"\n",
        1,
        '"text_1" and "text_2"',
    ),
    (
        "rerank_no_documents",
        line(url="/v1/rerank", body={"model": "m", "query": "q"}) + b"\n",
        1,
        '"query" and "documents"',
    ),
    (
        "line_too_long",
        good(1) + line(body={"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}) + b"\n",
        2,
        "over max_line_bytes=1,000",
    ),
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


EMBED = line("emb-1", url="/v1/embeddings", body={"model": "m", "input": "x"})


def chat(**fields) -> bytes:
    """One chat line whose body adds ``fields`` (e.g. sampling parameters), newline-terminated."""
    return line(body={"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}) + b"\n"


# Cases of issue 10 — (name, file bytes, options, line of the first problem (0: the file), message fragment)
ISSUE_10 = [
    (
        "line_cut_by_the_reader_has_unknown_size",
        good(1) + line(body={"model": "m", "messages": [{"role": "user", "content": "x" * 3000}]}) + b"\n",
        {"max_line_bytes": 1000, "_reader_max": 1000},
        2,
        "line is more than 1,000 bytes, over max_line_bytes=1,000",
    ),
    (
        "line_too_long_names_both_settings",
        good(1) + line(body={"model": "m", "messages": [{"role": "user", "content": "x" * 3000}]}) + b"\n",
        {"max_line_bytes": 1000},
        2,
        "limits=InputLimits(max_line_bytes=...) on the operator, or --max-line-bytes in the CLI",
    ),
    (
        "line_too_long_true_size",
        good(1) + line(body={"model": "m", "messages": [{"role": "user", "content": "x" * 3000}]}) + b"\n",
        {"max_line_bytes": 1000},
        2,
        "line is 3,",
    ),
    (
        "temperature_string",
        good(1) + chat(temperature="hot"),
        {},
        2,
        '"body.temperature" is "hot", but it must be a number from 0 to 2',
    ),
    (
        "temperature_too_high",
        chat(temperature=2.5),
        {},
        1,
        '"body.temperature" is 2.5, but it must be a number from 0 to 2',
    ),
    (
        "max_completion_tokens_negative",
        good(2) + chat(max_completion_tokens=-5),
        {},
        3,
        '"body.max_completion_tokens" is -5, but it must be an integer >= 1',
    ),
    ("max_tokens_zero", chat(max_tokens=0), {}, 1, '"body.max_tokens" is 0, but it must be an integer >= 1'),
    (
        "max_tokens_float",
        chat(max_tokens=1.5),
        {},
        1,
        '"body.max_tokens" is 1.5, but it must be an integer >= 1',
    ),
    (
        "top_p_zero",
        chat(top_p=0),
        {},
        1,
        '"body.top_p" is 0, but it must be a number greater than 0 and at most 1',
    ),
    ("top_p_over_one", chat(top_p=1.5), {}, 1, '"body.top_p" is 1.5'),
    ("n_zero", chat(n=0), {}, 1, '"body.n" is 0, but it must be an integer >= 1'),
    ("n_boolean", chat(n=True), {}, 1, '"body.n" is true'),
    (
        "presence_penalty_too_low",
        chat(presence_penalty=-3),
        {},
        1,
        '"body.presence_penalty" is -3, but it must be a number from -2 to 2',
    ),
    (
        "frequency_penalty_string",
        chat(frequency_penalty="0.5"),
        {},
        1,
        '"body.frequency_penalty" is "0.5", but it must be a number from -2 to 2',
    ),
    ("seed_float", chat(seed=1.5), {}, 1, '"body.seed" is 1.5, but it must be a 64-bit integer'),
    ("stop_number", chat(stop=5), {}, 1, '"body.stop" is 5, but it must be a string or a list of strings'),
    ("stop_list_of_numbers", chat(stop=["a", 1]), {}, 1, '"body.stop" is ["a",1]'),
    (
        "logprobs_string",
        chat(logprobs="yes"),
        {},
        1,
        '"body.logprobs" is "yes", but it must be true or false',
    ),
    (
        "top_logprobs_too_high",
        chat(logprobs=True, top_logprobs=21),
        {},
        1,
        '"body.top_logprobs" is 21, but it must be an integer from 0 to 20',
    ),
    (
        "top_k_below_minus_one",
        chat(top_k=-2),
        {},
        1,
        '"body.top_k" is -2, but it must be an integer: 0 or -1 (no limit), or at least 1',
    ),
    (
        "min_tokens_negative",
        chat(min_tokens=-1),
        {},
        1,
        '"body.min_tokens" is -1, but it must be an integer >= 0',
    ),
    ("min_tokens_null", chat(min_tokens=None), {}, 1, '"body.min_tokens" is null'),
    (
        "embeddings_for_generation_model",
        good(1) + EMBED + b"\n",
        {"model_kind": "generate"},
        2,
        "model 'm' is a generation model; /v1/embeddings needs a pooling model (--runner pooling) — put these requests in a file of their own",
    ),
    (
        "score_for_generation_model",
        line(url="/v1/score", body={"model": "m", "text_1": "a", "text_2": "b"}) + b"\n",
        {"model_kind": "generate", "model": "m"},
        1,
        "/v1/score needs a pooling model (--runner pooling)",
    ),
    (
        "rerank_for_generation_model",
        line(url="/v1/rerank", body={"model": "m", "query": "q", "documents": ["d"]}) + b"\n",
        {"model_kind": "generate"},
        1,
        "/v1/rerank needs a pooling model",
    ),
    (
        "chat_for_pooling_model",
        EMBED + b"\n" + good(1),
        {"model_kind": "pooling"},
        2,
        "model 'm' is a pooling model (--runner pooling); /v1/chat/completions needs a generation model",
    ),
    (
        "chat_and_embeddings_mixed",
        good(2) + EMBED + b"\n",
        {},
        0,
        "the file mixes generation requests (/v1/chat/completions (2)) with pooling requests (/v1/embeddings (1))",
    ),
    (
        "chat_and_score_mixed_in_skip_mode",
        good(1) + line("s", url="/v1/score", body={"model": "m", "text_1": "a", "text_2": "b"}) + b"\n",
        {"invalid_lines": "skip"},
        0,
        "vLLM serves one kind per engine",
    ),
]


@pytest.mark.parametrize(
    ("name", "data", "options", "lineno", "reason"), ISSUE_10, ids=[c[0] for c in ISSUE_10]
)
def test_issue_10_case_reports_line_and_reason(name, data, options, lineno, reason):
    options = dict(options)
    reader_max = options.pop("_reader_max", None)
    kwargs = {"max_line_bytes": reader_max} if reader_max else {}
    with open_lines(io.BytesIO(data), **kwargs) as lines:
        report = preflight(lines, PreflightOptions(**options), reread=lambda: open_lines(io.BytesIO(data)))
    assert not report.runnable
    first = report.problems[0]
    assert first.line == lineno, str(first)
    assert reason in first.message, str(first)


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0},
        {"temperature": 2},
        {"temperature": 0.7},
        {"top_p": 1},
        {"top_p": 0.01},
        {"max_tokens": 1},
        {"max_completion_tokens": 4096},
        {"n": 2},
        {"presence_penalty": -2},
        {"frequency_penalty": 2},
        {"seed": -(2**63)},
        {"stop": "\n"},
        {"stop": ["a", "b"]},
        {"stop": []},
        {"logprobs": True, "top_logprobs": 20},
        {"top_logprobs": 0},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 40},
        {"min_tokens": 0},
        {"temperature": None, "top_p": None, "max_tokens": None, "n": None, "seed": None, "stop": None},
    ],
    ids=lambda fields: "-".join(f"{k}={v}" for k, v in fields.items()),
)
def test_valid_sampling_fields_pass(fields):
    assert run(chat(**fields)).ok


def test_sampling_fields_are_not_checked_on_embeddings():
    assert run(line(url="/v1/embeddings", body={"model": "m", "input": "x", "temperature": "hot"}) + b"\n").ok


def test_bad_sampling_field_in_default_body_is_refused():
    with pytest.raises(ValueError, match=r'default_body: "body.temperature" is "hot"'):
        PreflightOptions(default_body={"temperature": "hot"})


@pytest.mark.parametrize(("kind", "data"), [("generate", good(2)), ("pooling", EMBED + b"\n")])
def test_lines_the_model_kind_serves_pass(kind, data):
    assert run(data, model_kind=kind).ok


def test_wrong_kind_lines_are_skipped_in_skip_mode():
    report = run(good(2) + EMBED + b"\n", model_kind="generate", invalid_lines="skip")
    assert report.runnable
    assert (report.valid_lines, report.invalid_lines) == (2, 1)


def test_gzip_input_is_read_and_not_called_invalid_utf8():
    report = run(gzip.compress(good(3)))
    assert report.ok
    assert report.valid_lines == 3
    assert report.compression == "gzip"


def test_gzip_lines_read_without_decompressing_are_called_gzip_not_bad_utf8():
    report = preflight(gzip.compress(good(2)).split(b"\n"))
    assert report.problems[0].line == 1
    assert "gzip-compressed but was read without decompressing" in report.problems[0].message


def test_gzip_input_needs_the_uncompressed_cleaned_copy():
    out = io.BytesIO()
    with open_lines(io.BytesIO(gzip.compress(good(2)))) as lines:
        report = preflight(lines, cleaned_out=out)
    assert report.needs_rewrite
    assert out.getvalue() == good(2)


def test_an_input_whose_location_is_withheld_is_read_by_the_engine_from_the_copy_numbered_as_the_copy():
    # An http(s) input with credentials: the engine is never given its URL (No secrets).
    out = io.BytesIO()
    data = b"\n" + good(2) + b"\n" + line("last") + b"\n"
    with open_lines(io.BytesIO(data)) as lines:
        report = preflight(lines, cleaned_out=out, withhold_location=True)
    assert report.ok
    assert report.needs_rewrite
    assert out.getvalue() == good(2) + line("last") + b"\n"
    index = report.custom_ids
    assert (index.line_of("ok-0"), index.line_of("ok-1"), index.line_of("last")) == (1, 2, 3)
    with pytest.raises(ValueError, match="needs cleaned_out"):
        preflight([line()], withhold_location=True)


def test_gzip_input_with_a_bad_line_reports_the_line():
    report = run(gzip.compress(good(1) + b"junk\n"))
    assert report.problems[0].line == 2
    assert "not valid JSON" in report.problems[0].message


@pytest.mark.parametrize(
    ("name", "data", "fragment"),
    [
        ("gzip_truncated", gzip.compress(good(300))[:-50], "the gzip file is truncated"),
        ("gzip_trailing_garbage", gzip.compress(good(2)) + b"junk", "the gzip data is corrupt"),
        ("zstd", b"\x28\xb5\x2f\xfd" + b"\0" * 30, "compressed with zstd"),
    ],
)
def test_unreadable_compressed_file_raises_a_preflight_error(name, data, fragment):
    with pytest.raises(PreflightError, match=fragment):
        run(data)


def test_custom_ids_carry_physical_line_numbers_when_the_input_is_read_as_is():
    report = run(b"\n" + good(2) + b"\n" + line("last") + b"\n")
    assert not report.needs_rewrite
    index = report.custom_ids
    assert (len(index), index.line_of("ok-0"), index.line_of("ok-1"), index.line_of("last")) == (3, 2, 3, 5)


def test_custom_ids_carry_cleaned_copy_line_numbers_when_lines_are_dropped():
    data = line("a") + b"\n\njunk\n" + line("b", method="GET") + b"\n" + line("c") + b"\n"
    cleaned = io.BytesIO()
    with open_lines(io.BytesIO(data)) as lines:
        report = preflight(
            lines, PreflightOptions(invalid_lines="skip"), cleaned_out=cleaned, errors_out=io.BytesIO()
        )
    index = report.custom_ids
    assert (len(index), index.line_of("a"), index.line_of("c"), index.line_of("b")) == (2, 1, 2, None)
    assert [json.loads(x)["custom_id"] for x in cleaned.getvalue().splitlines()] == ["a", "c"]


def test_custom_ids_follow_the_cleaned_copy_of_a_gzip_input():
    report = run(gzip.compress(b"\n" + good(2)))
    assert report.custom_ids.line_of("ok-1") == 2


def test_corpus_has_at_least_thirty_cases():
    assert len(MALFORMED) >= 30


@pytest.mark.parametrize(
    "name", ["openai_example_batch.jsonl", "embeddings_batch.jsonl", "score_batch.jsonl"]
)
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
    assert report.ok
    assert not report.needs_rewrite
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
        report = preflight(
            lines, PreflightOptions(invalid_lines="skip"), cleaned_out=cleaned, errors_out=errors
        )
    assert report.runnable
    assert report.needs_rewrite
    assert not report.ok
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
    assert report.ok
    assert report.needs_rewrite
    assert report.rewritten_lines == 2
    assert [json.loads(x)["body"]["model"] for x in out.getvalue().splitlines()] == ["tiny", "tiny"]


def test_rewrite_model_fills_a_missing_model():
    out = io.BytesIO()
    data = line(body={"messages": [{"role": "user"}]}) + b"\n"
    with open_lines(io.BytesIO(data)) as lines:
        report = preflight(lines, PreflightOptions(model="tiny", rewrite_model=True), cleaned_out=out)
    assert report.ok
    assert json.loads(out.getvalue())["body"]["model"] == "tiny"


def test_default_body_is_added_only_where_missing():
    data = (
        line("a")
        + b"\n"
        + line("b", body={"model": "m", "messages": [{"role": "u"}], "max_tokens": 9})
        + b"\n"
    )
    out = io.BytesIO()
    with open_lines(io.BytesIO(data)) as lines:
        report = preflight(lines, PreflightOptions(default_body={"max_tokens": 5}), cleaned_out=out)
    bodies = [json.loads(x)["body"] for x in out.getvalue().splitlines()]
    assert [b["max_tokens"] for b in bodies] == [5, 9]
    assert report.rewritten_lines == 1
    assert report.needs_rewrite


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
    assert report.valid_lines == 5
    assert report.invalid_lines == 1


def test_duplicates_without_reread_are_counted_as_a_file_problem():
    with open_lines(io.BytesIO(good(3) + line("ok-2") + b"\n")) as lines:
        report = preflight(lines)
    assert report.invalid_lines == 1
    assert report.valid_lines == 3
    assert "1 request(s) repeat an earlier custom_id" in report.problems[-1].message


def test_duplicates_fail_the_file_even_in_skip_mode():
    report = run(good(2) + line("ok-0") + b"\n", invalid_lines="skip")
    assert not report.runnable


def test_max_lines_stops_reading_with_a_file_problem():
    report = run(good(10), max_lines=4)
    assert report.stopped_early
    assert not report.runnable
    assert report.problems[0].line == 5
    assert "more than 4 requests" in report.problems[0].message
    assert report.total_lines == 4


def test_max_lines_ignores_blank_lines():
    assert run(b"\n\n" + good(3), max_lines=3).ok


def test_empty_file_is_a_file_problem():
    report = run(b"\n \n")
    assert not report.ok
    assert "no requests" in report.problems[0].message


def test_skip_mode_with_nothing_valid_is_not_runnable():
    report = run(b"junk\n", invalid_lines="skip")
    assert not report.runnable


def test_mixed_pooling_urls_are_counted_per_url():
    data = (
        EMBED
        + b"\n"
        + line("b", url="/v1/score", body={"model": "m", "text_1": "a", "text_2": "b"})
        + b"\n"
        + EMBED.replace(b"emb-1", b"c")
        + b"\n"
    )
    report = run(data)
    assert report.ok
    assert report.url_counts == {"/v1/embeddings": 2, "/v1/score": 1}


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
    report = run(
        line(url="/v1/embeddings", body={"model": "m", "input": "x"}) + b"\n",
        supported_urls=frozenset({CHAT}),
    )
    assert "is not served" in report.problems[0].message


def test_non_ascii_utf8_text_is_valid():
    assert run(line(body={"model": "m", "messages": [{"role": "user", "content": "héllo 你好"}]}) + b"\n").ok


def test_raise_for_problems_names_source_counts_and_problems():
    report = run(b"junk\n" * 60)
    with pytest.raises(PreflightError) as excinfo:
        report.raise_for_problems("s3://b/in.jsonl")
    text = str(excinfo.value)
    assert "s3://b/in.jsonl failed preflight" in text
    assert "line 1" in text
    assert "... and 10 more" in text
    assert excinfo.value.report is report


def test_raise_for_problems_passes_in_skip_mode_with_valid_lines():
    run(good(1) + b"junk\n", invalid_lines="skip").raise_for_problems("x")


def test_report_to_dict_is_json_serialisable():
    assert json.loads(json.dumps(run(good(1) + b"junk\n").to_dict()))["invalid_lines"] == 1


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"invalid_lines": "ignore"}, "invalid_lines must be"),
        ({"rewrite_model": True}, "rewrite_model=True needs model="),
        ({"default_body": {"model": "x"}}, "default_body may not set"),
        ({"supported_urls": frozenset()}, "supported_urls is empty"),
        ({"model_kind": "chat"}, "model_kind must be"),
        ({"default_body": {"max_completion_tokens": -5}}, "default_body: "),
    ],
)
def test_bad_options_raise_value_error(kwargs, names):
    with pytest.raises(ValueError, match=re.escape(names)):
        PreflightOptions(**kwargs)


# -- model names: served names and LoRA adapters ---------------------------------------


def named(custom_id: str, model: str) -> bytes:
    return line(custom_id, body={"model": model, "messages": [{"role": "user", "content": "hi"}]}) + b"\n"


def test_lines_may_alternate_between_the_base_model_and_its_adapters():
    data = b"".join(named(f"r{i}", ["base", "sql", "chat"][i % 3]) for i in range(9))
    report = run(data, model="base", model_names={"base", "sql", "chat"})
    assert report.ok
    assert report.valid_lines == 9
    assert report.requests_per_model == {"base": 3, "sql": 3, "chat": 3}
    assert report.url_counts == {CHAT: 9}


def test_runs_of_one_adapter_are_counted_per_name():
    data = b"".join(named(f"r{i}", "sql" if 3 <= i < 8 else "base") for i in range(10)) + b"\n"
    report = run(data, model="base", model_names={"base", "sql"})
    assert report.ok
    assert report.requests_per_model == {"base": 5, "sql": 5}


def test_a_name_the_engine_does_not_serve_fails_with_the_names_it_does():
    data = named("a", "base") + named("b", "sql") + named("c", "/models/base")
    report = run(data, model="base", model_names={"base", "sql"})
    assert report.invalid_lines == 1
    assert report.problems[0].line == 3
    message = report.problems[0].message
    assert "'/models/base', which the engine does not serve" in message
    assert "use one of: 'base', 'sql'" in message


def test_a_missing_model_names_every_name_it_may_use():
    data = line("a", body={"messages": [{"role": "user"}]}) + b"\n"
    report = run(data, model="base", model_names={"base", "sql"})
    assert "set it to one of: 'base', 'sql'" in report.problems[0].message


def test_rewrite_model_keeps_served_names_and_rewrites_the_others():
    data = named("a", "sql") + named("b", "other") + named("c", "base")
    out = io.BytesIO()
    with open_lines(io.BytesIO(data)) as lines:
        report = preflight(
            lines,
            PreflightOptions(model="base", model_names={"base", "sql"}, rewrite_model=True),
            cleaned_out=out,
        )
    assert report.ok
    assert report.rewritten_lines == 1
    assert [json.loads(x)["body"]["model"] for x in out.getvalue().splitlines()] == ["sql", "base", "base"]
    assert report.requests_per_model == {"sql": 1, "base": 2}
    assert report.models == {"sql": 1, "base": 1, "other": 1}


def test_model_names_need_model_among_them():
    with pytest.raises(ValueError, match="model_names needs model="):
        PreflightOptions(model="/models/base", model_names={"base"})


def test_without_model_names_the_first_line_still_sets_the_model():
    report = run(named("a", "x") + named("b", "x"))
    assert report.ok
    assert report.requests_per_model == {"x": 2}


# -- /v1/completions ---------------------------------------------------------------

COMPLETIONS = "/v1/completions"
WITH_COMPLETIONS = frozenset({CHAT, COMPLETIONS})


def completion(custom_id="cmp-1", **body) -> bytes:
    """One /v1/completions line whose body is ``{"model": "m", **body}``, newline-terminated."""
    return line(custom_id, url=COMPLETIONS, body={"model": "m", **body}) + b"\n"


@pytest.mark.parametrize(
    "prompt",
    ["Once upon a time", ["a", "b"], [1, 2, 3], [[1, 2], [3]], [0]],
    ids=["string", "strings", "token_ids", "lists_of_token_ids", "token_zero"],
)
def test_every_prompt_form_vllm_takes_passes_for_an_engine_that_serves_completions(prompt):
    report = run(
        good(1) + completion(prompt=prompt, max_tokens=4, logprobs=2, echo=True),
        supported_urls=WITH_COMPLETIONS,
    )
    assert report.ok, report.format()
    assert report.url_counts == {CHAT: 1, COMPLETIONS: 1}


# (name, body fields besides model, message fragment)
BAD_COMPLETIONS = [
    ("no_prompt", {}, "missing required field `prompt`"),
    ("empty_string", {"prompt": ""}, "body.prompt"),
    ("empty_list", {"prompt": []}, "body.prompt"),
    ("number", {"prompt": 5}, "body.prompt"),
    ("object", {"prompt": {"text": "a"}}, "body.prompt"),
    ("negative_token_id", {"prompt": [1, -2]}, "body.prompt"),
    ("float_token_id", {"prompt": [1, 2.5]}, "body.prompt"),
    ("strings_and_ids_mixed", {"prompt": ["a", 1]}, "(one kind per list)"),
    ("ids_and_lists_mixed", {"prompt": [1, [2]]}, "(one kind per list)"),
    ("empty_inner_list", {"prompt": [[1], []]}, "body.prompt"),
    (
        "max_tokens_zero",
        {"prompt": "a", "max_tokens": 0},
        '"body.max_tokens" is 0, but it must be an integer >= 1',
    ),
    ("temperature_string", {"prompt": "a", "temperature": "hot"}, '"body.temperature" is "hot"'),
    (
        "logprobs_boolean",
        {"prompt": "a", "logprobs": True},
        '"body.logprobs" is true, but it must be an integer >= 0',
    ),
    ("echo_string", {"prompt": "a", "echo": "yes"}, '"body.echo" is "yes", but it must be true or false'),
    ("stream_true", {"prompt": "a", "stream": True}, '"body.stream" is true'),
]


@pytest.mark.parametrize(("name", "fields", "reason"), BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_a_bad_completion_body_is_named_with_its_line(name, fields, reason):
    report = run(good(1) + completion("bad", **fields), supported_urls=WITH_COMPLETIONS)
    assert not report.ok
    first = report.problems[0]
    assert (first.line, first.custom_id) == (2, "bad"), str(first)
    assert reason in first.message, str(first)


ADVICE = {"/v1/completions": "run this file with the other engine, which serves it"}


def test_completion_lines_for_an_engine_without_them_name_each_line_and_the_engines_advice():
    report = run(good(1) + completion("c1", prompt="a") + completion("c2", prompt=[1, 2]), url_advice=ADVICE)
    assert [(p.line, p.custom_id) for p in report.problems] == [(2, "c1"), (3, "c2")]
    assert all("run this file with the other engine" in p.message for p in report.problems)


def test_completion_lines_for_an_engine_without_them_fail_the_file_even_in_skip_mode():
    report = run(good(2) + completion(prompt="a"), invalid_lines="skip", url_advice=ADVICE)
    assert not report.runnable
    assert "run this file with the other engine" in report.file_problems[0].message


def test_a_url_no_engine_advises_on_names_the_supported_ones():
    report = run(good(1) + completion("c1", prompt="a"))
    assert "is not served by this engine — use one of: " in report.problems[0].message


def test_completions_for_a_pooling_model_are_the_wrong_kind():
    report = run(completion(prompt="a"), supported_urls=WITH_COMPLETIONS, model_kind="pooling")
    assert "/v1/completions needs a generation model" in report.problems[0].message


def test_completions_and_chat_may_share_a_file_but_not_with_embeddings():
    report = run(
        good(1) + completion(prompt="a") + EMBED + b"\n", supported_urls=WITH_COMPLETIONS | {"/v1/embeddings"}
    )
    assert "/v1/chat/completions (1), /v1/completions (1)" in report.file_problems[0].message


SKIP_HINT = "invalid_lines='skip'"


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\n\n", id="blank_lines_only"),
        pytest.param(b"\xef\xbb\xbf" + good(3), id="bom"),
        pytest.param(gzip.compress(good(2)) + b"\n", id="compressed_read_raw"),
        pytest.param(b"hello\nworld\n", id="no_valid_line"),
    ],
)
def test_a_problem_of_the_whole_file_is_not_told_to_skip_lines(data):
    report = preflight(data.splitlines(), PreflightOptions())
    with pytest.raises(PreflightError) as err:
        report.raise_for_problems()
    assert SKIP_HINT not in str(err.value)
    assert "and upload the file again." in str(err.value)


def test_bad_lines_among_good_ones_are_told_they_can_be_skipped():
    report = run(good(2) + b"hello\n")
    with pytest.raises(
        PreflightError,
        match=r"Fix the lines above and upload the file again, or run with invalid_lines='skip' to leave them out\.",
    ):
        report.raise_for_problems()


def test_lines_default_body_fills_are_counted_without_a_cleaned_copy():
    # The report counts the lines default_body fills whether or not a cleaned copy is written.
    report = run(good(3), default_body={"max_completion_tokens": 8})
    assert report.ok
    assert report.rewritten_lines == 3
