"""Structured outputs in the batch-file core: the schema injected by preflight, answers validated by the results check, read back as instances."""

from __future__ import annotations

import io
import json
from typing import Literal

import pytest
from pydantic import BaseModel

from airflow_vllm_batch.batchfile import (
    Failed,
    OutputSchema,
    Parsed,
    PreflightOptions,
    Text,
    check_results,
    preflight,
    read_answers,
)
from airflow_vllm_batch.batchfile.structured import resolve_output_type
from airflow_vllm_batch.exceptions import ConfigurationError, PreflightError
from airflow_vllm_batch.summary import tally_failures


class Review(BaseModel):
    sentiment: Literal["positive", "negative"]
    stars: int


SCHEMA = OutputSchema(Review)
FORMAT = SCHEMA.response_format()
URLS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})


def line(cid: str, url: str = "/v1/chat/completions", **body) -> bytes:
    if url == "/v1/chat/completions":
        body.setdefault("messages", [{"role": "user", "content": cid}])
    elif url == "/v1/completions":
        body.setdefault("prompt", cid)
    else:
        body.setdefault("input", cid)
    return json.dumps(
        {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", **body}}
    ).encode()


def cleaned(lines: list[bytes], **options) -> tuple[list[dict], object]:
    out = io.BytesIO()
    opts = PreflightOptions(supported_urls=URLS, model="m", response_format=FORMAT, **options)
    report = preflight(lines, opts, cleaned_out=out)
    return [json.loads(x) for x in out.getvalue().splitlines()], report


def test_the_schema_is_the_models_json_schema_named_after_it_and_strict():
    assert {
        "type": "json_schema",
        "json_schema": {"name": "Review", "schema": Review.model_json_schema(), "strict": True},
    } == FORMAT


def test_chat_and_completions_lines_without_a_response_format_get_the_schema():
    out, report = cleaned([line("a"), line("b", "/v1/completions")])
    assert report.ok
    assert report.rewritten_lines == 2
    assert report.needs_rewrite
    assert [o["body"]["response_format"] for o in out] == [FORMAT, FORMAT]


def test_a_line_with_its_own_response_format_keeps_it():
    own = {"type": "json_object"}
    out, report = cleaned([line("a", response_format=own), line("b")])
    assert report.ok
    assert report.rewritten_lines == 1
    assert out[0]["body"]["response_format"] == own
    assert out[1]["body"]["response_format"] == FORMAT


def test_default_body_fields_and_the_schema_are_both_filled_in():
    out, _ = cleaned([line("a")], default_body={"max_completion_tokens": 16})
    assert out[0]["body"]["max_completion_tokens"] == 16
    assert out[0]["body"]["response_format"] == FORMAT


@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_an_embeddings_line_is_refused_naming_the_line_and_output_type(mode):
    _, report = cleaned([line("a"), line("e", "/v1/embeddings")], invalid_lines=mode)
    assert not report.runnable
    assert report.problems[0].line == 2
    assert "output_type" in report.problems[0].message
    with pytest.raises(PreflightError, match="output_type"):
        report.raise_for_problems()


def test_without_output_type_lines_are_left_as_they_were():
    out = io.BytesIO()
    report = preflight([line("a")], PreflightOptions(supported_urls=URLS, model="m"), cleaned_out=out)
    assert report.rewritten_lines == 0
    assert "response_format" not in json.loads(out.getvalue())["body"]


def test_output_type_with_a_response_format_in_default_body_is_refused():
    with pytest.raises(ValueError, match="response_format"):
        PreflightOptions(response_format=FORMAT, default_body={"response_format": {"type": "json_object"}})


def answer(cid: str, content: str | None, *, completion: bool = False) -> bytes:
    choice = (
        {"index": 0, "text": content}
        if completion
        else {"index": 0, "message": {"role": "assistant", "content": content}}
    )
    body = {
        "object": "text_completion" if completion else "chat.completion",
        "choices": [choice],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    return json.dumps(
        {
            "id": "v",
            "custom_id": cid,
            "response": {"status_code": 200, "request_id": "r", "body": body},
            "error": None,
        }
    ).encode()


def engine_error(cid: str) -> bytes:
    return json.dumps(
        {
            "id": "v",
            "custom_id": cid,
            "response": {"status_code": 500, "request_id": "r", "body": None},
            "error": {"message": "boom"},
        }
    ).encode()


GOOD = '{"sentiment":"positive","stars":4}'


def checked(results: list[bytes], schema: OutputSchema | None = SCHEMA):
    ok, bad = io.BytesIO(), io.BytesIO()
    report = check_results(
        results,
        [line(json.loads(r)["custom_id"]) for r in results],
        results_out=ok,
        errors_out=bad,
        output_schema=schema,
    )
    return (
        report,
        [json.loads(x) for x in ok.getvalue().splitlines()],
        [json.loads(x) for x in bad.getvalue().splitlines()],
    )


def test_answers_that_fit_are_results_and_those_that_do_not_go_to_the_error_file_with_their_raw_text():
    results = [
        answer("good", GOOD),
        answer("prose", "I liked it"),
        answer("mismatch", '{"sentiment":"meh","stars":4}'),
        answer("completion", GOOD, completion=True),
        answer("empty", None),
    ]
    report, ok, bad = checked(results)
    assert report.request_counts == {"total": 5, "completed": 2, "failed": 3}
    assert report.invalid_output == 3
    assert report.ok
    assert [r["custom_id"] for r in ok] == ["good", "completion"]
    by_id = {e["custom_id"]: e for e in bad}
    assert by_id["prose"]["error"]["code"] == "invalid_output"
    assert by_id["prose"]["error"]["raw"] == "I liked it"
    assert "Invalid JSON" in by_id["prose"]["error"]["message"]
    assert by_id["mismatch"]["error"]["message"].startswith("does not fit Review: sentiment:")
    assert by_id["mismatch"]["error"]["raw"] == '{"sentiment":"meh","stars":4}'
    assert by_id["mismatch"]["error"]["line"] == 3
    assert by_id["mismatch"]["response"] == json.loads(results[2])["response"]  # the engine's response, kept
    assert by_id["empty"]["error"]["raw"] is None
    assert "invalid_output" in report.format()


def test_invalid_outputs_are_counted_apart_from_engine_errors_by_reason():
    _, _, bad = checked([answer("prose", "no"), engine_error("e"), answer("good", GOOD)])
    tally = tally_failures(json.dumps(e).encode() for e in bad)
    assert tally.counts == {"engine_error": 1, "invalid_output": 1}


def test_without_a_schema_no_answer_is_validated():
    report, _ok, bad = checked([answer("prose", "I liked it")], schema=None)
    assert report.request_counts == {"total": 1, "completed": 1, "failed": 0}
    assert report.invalid_output == 0
    assert not bad


def test_a_long_validation_message_is_cut_but_the_raw_text_is_kept_whole():
    raw = "x" * 5000
    _, _, bad = checked([answer("long", raw)])
    assert len(bad[0]["error"]["message"]) <= 300
    assert bad[0]["error"]["raw"] == raw


def test_read_answers_yields_model_instances(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_bytes(answer("a", GOOD) + b"\n" + answer("b", "prose") + b"\n")
    got = list(read_answers(str(results), output_type=Review))
    assert got[0] == Parsed("a", Review(sentiment="positive", stars=4))
    assert isinstance(got[0].value, Review)
    assert isinstance(got[1], Failed)
    assert got[1].error.startswith("invalid_output: does not fit Review")
    assert next(iter(read_answers(str(results)))) == Text("a", GOOD)


def test_read_answers_of_a_manifest_with_invalid_outputs_keeps_its_counts(tmp_path):
    results, errors = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    report_ok, report_bad = io.BytesIO(), io.BytesIO()
    check_results(
        [answer("a", GOOD), answer("b", "prose")],
        results_out=report_ok,
        errors_out=report_bad,
        output_schema=SCHEMA,
    )
    results.write_bytes(report_ok.getvalue())
    errors.write_bytes(report_bad.getvalue())
    manifest = {
        "output_uri": str(results),
        "error_uri": str(errors),
        "request_counts": {"total": 2, "completed": 1, "failed": 1},
    }
    got = list(read_answers(manifest, output_type="tests.unit.batchfile.test_structured.Review"))
    assert got[0] == Parsed("a", Review(sentiment="positive", stars=4))
    assert isinstance(got[1], Failed)
    assert got[1].custom_id == "b"


class NotAModel:
    pass


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (NotAModel, "must be a pydantic BaseModel subclass"),
        (Review(sentiment="positive", stars=1), "must be a pydantic BaseModel subclass"),
        ("Review", "is not an import path"),
        ("no_such_pkg_xyz.models.Review", "cannot be imported on this worker"),
        ("tests.unit.batchfile.test_structured.Missing", "cannot be imported on this worker"),
    ],
)
def test_a_wrong_output_type_is_a_configuration_error_naming_it(value, match):
    with pytest.raises(ConfigurationError, match=f"output_type.*{match}|{match}") as err:
        resolve_output_type(value)
    assert "output_type" in str(err.value)


def test_an_import_path_resolves_to_the_class():
    assert resolve_output_type("tests.unit.batchfile.test_structured.Review") is Review


def test_the_schema_digest_changes_with_a_field():
    class Other(BaseModel):
        sentiment: str

    assert SCHEMA.digest != OutputSchema(Other).digest
    assert SCHEMA.identity() == {
        "name": "tests.unit.batchfile.test_structured.Review",
        "schema_sha256": SCHEMA.digest,
    }


def test_a_model_without_a_json_schema_is_a_configuration_error_naming_output_type():
    from pydantic import BaseModel as Base

    class Broken(Base):
        when: Undefined  # noqa: F821 - a forward reference that never resolves

    with pytest.raises(ConfigurationError, match="output_type Broken has no JSON schema"):
        resolve_output_type(Broken)


def cut_off(cid: str, content: str, *, completion: bool = False, tokens: int = 16) -> bytes:
    """An answer the engine stopped at the token limit."""
    obj = json.loads(answer(cid, content, completion=completion))
    obj["response"]["body"]["choices"][0]["finish_reason"] = "length"
    obj["response"]["body"]["usage"]["completion_tokens"] = tokens
    return json.dumps(obj).encode()


def test_an_answer_cut_off_at_the_token_limit_says_so_and_names_max_completion_tokens():
    _, _, bad = checked([cut_off("c", '{"sentiment":"positive","st')])
    message = bad[0]["error"]["message"]
    assert message.startswith("does not fit Review:")
    assert 'cut off at the token limit (finish_reason "length", 16 tokens)' in message
    assert "raise the request's max_completion_tokens (or max_tokens)" in message
    assert "disable_any_whitespace" not in message


def test_a_completion_cut_off_at_the_token_limit_names_max_tokens():
    _, _, bad = checked([cut_off("c", '{"sentiment":"posi', completion=True)])
    assert "raise the request's max_tokens, e.g. in default_body" in bad[0]["error"]["message"]


@pytest.mark.parametrize("padded", ["{" + "\n " * 20, '{"sentiment": "positive", ' + " " * 40])
def test_an_answer_padded_with_whitespace_to_the_limit_names_the_xgrammar_flag_not_more_tokens(padded):
    _, _, bad = checked([cut_off("c", padded, tokens=40)])
    message = bad[0]["error"]["message"]
    assert (
        """--structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'""" in message
    )
    assert "cut off at the token limit" in message
    assert "raise the request's" not in message


def test_an_answer_that_ended_by_itself_and_does_not_fit_gets_no_hint():
    obj = json.loads(answer("c", '{"sentiment":"meh","stars":4}'))
    obj["response"]["body"]["choices"][0]["finish_reason"] = "stop"
    _, _, bad = checked([json.dumps(obj).encode()])
    assert (
        bad[0]["error"]["message"]
        == "does not fit Review: sentiment: Input should be 'positive' or 'negative'"
    )
