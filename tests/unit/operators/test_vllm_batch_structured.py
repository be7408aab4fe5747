"""VLLMBatchOperator with ``output_type``: the schema sent, answers validated, invalid ones failed apart, in seconds.

The stand-in vLLM server of ``test_vllm_batch_server.py`` (reached through a ``vllm``
connection) and real S3 (SeaweedFS). The real engine's structured decoding is shown in
``tests/integration/test_server_engine.py``.
"""

from __future__ import annotations

import json
from typing import Literal

import pytest
from aiohttp import web
from pydantic import BaseModel

from airflow_vllm_batch.batchfile import Failed, Parsed
from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.manifest import Manifest
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.storage import read_answers
from airflow_vllm_batch.summary import render_summary
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.operators.test_vllm_batch_runs import FakeTI
from tests.unit.operators.test_vllm_batch_server import N
from tests.unit.serving.conftest import chat_completion

pytestmark = pytest.mark.usefixtures("quick_retries")


class Verdict(BaseModel):
    label: Literal["yes", "no"]


#: Requests whose answer is not a Verdict: prose, and JSON of the wrong shape.
PROSE, WRONG_SHAPE = {"r3", "r7"}, {"r11"}


def answers_with_some_invalid(seen: list[dict]):
    async def behaviour(custom_id: str, body: dict, attempt: int) -> web.Response:
        seen.append(body)
        completion = chat_completion(custom_id)
        text = (
            "I think so"
            if custom_id in PROSE
            else '{"label": "maybe"}'
            if custom_id in WRONG_SHAPE
            else '{"label": "yes"}'
        )
        completion["choices"][0]["message"]["content"] = text
        return web.json_response(completion)

    return behaviour


def test_answers_that_do_not_fit_output_type_are_published_as_invalid_output(batch, server):
    seen: list[dict] = []
    server.behaviour = answers_with_some_invalid(seen)
    ti = FakeTI()
    manifest = batch.run(ti, output_type=Verdict, max_failed_ratio=0.2)
    assert manifest["request_counts"] == {"total": N, "completed": N - 3, "failed": 3}
    assert manifest["invalid_output"] == 3
    assert manifest["failed_by_reason"] == {"invalid_output": 3}
    assert {b["response_format"]["json_schema"]["name"] for b in seen} == {"Verdict"}
    assert seen[0]["response_format"]["json_schema"]["schema"] == Verdict.model_json_schema()
    errors = {e["custom_id"]: e["error"] for e in batch.lines("out/results.errors.jsonl")}
    assert set(errors) == PROSE | WRONG_SHAPE
    assert errors["r3"]["code"] == "invalid_output"
    assert errors["r3"]["raw"] == "I think so"
    assert errors["r11"]["raw"] == '{"label": "maybe"}'
    assert "label" in errors["r11"]["message"]
    got = list(read_answers(manifest, output_type=Verdict))
    assert sorted(a.custom_id for a in got if isinstance(a, Parsed)) == sorted(
        f"r{i}" for i in range(N) if f"r{i}" not in errors
    )
    assert all(a.value == Verdict(label="yes") for a in got if isinstance(a, Parsed))
    assert sorted(a.custom_id for a in got if isinstance(a, Failed)) == sorted(errors)
    assert "invalid output" in render_summary(Manifest.from_dict(manifest))


def test_invalid_outputs_count_against_max_failed_ratio(batch, server):
    server.behaviour = answers_with_some_invalid([])
    with pytest.raises(
        AirflowFailException, match=r"3 of 20 requests failed, more than max_failed_ratio=0.1"
    ):
        batch.run(output_type=Verdict, max_failed_ratio=0.1)
    assert "out/results.errors.jsonl" in batch.keys("out/")  # published before failing


def test_the_schema_is_part_of_the_run_identity_only_when_set(batch, server):
    server.behaviour = answers_with_some_invalid([])
    without = batch.run()
    assert "output_type" not in without["identity"]
    assert "invalid_output" not in without
    with_schema = batch.run(
        FakeTI(run_id="again"),
        output_type="tests.unit.operators.test_vllm_batch_structured.Verdict",
        max_failed_ratio=0.2,
    )
    assert with_schema["fingerprint"] != without["fingerprint"]
    assert (
        with_schema["identity"]["output_type"]["name"]
        == "tests.unit.operators.test_vllm_batch_structured.Verdict"
    )
    assert server.requests == 2 * N  # a new schema runs again


def test_a_lines_own_response_format_is_sent_as_it_is(batch, server):
    own = {"type": "json_object"}
    lines = [
        json.loads(x)
        for x in batch.client.get_object(Bucket=batch.bucket, Key="in/input.jsonl")["Body"]
        .read()
        .splitlines()
    ]
    lines[0]["body"]["response_format"] = own
    batch.client.put_object(
        Bucket=batch.bucket,
        Key="in/input.jsonl",
        Body=b"".join(json.dumps(x).encode() + b"\n" for x in lines),
    )
    seen: list[dict] = []
    server.behaviour = answers_with_some_invalid(seen)
    batch.run(output_type=Verdict, max_failed_ratio=1)
    formats = [b["response_format"] for b in seen]
    assert formats.count(own) == 1
    assert len(formats) == N


def test_output_type_not_a_model_fails_at_parse_time_naming_it(batch):
    with pytest.raises(ConfigurationError, match="output_type must be a pydantic BaseModel subclass"):
        batch.operator(output_type=dict)


def test_an_output_type_path_that_does_not_import_fails_the_task_without_retry_before_any_request(
    batch, server
):
    op = batch.operator(
        output_type="no_such_pkg_xyz.Verdict"
    )  # the scheduler may lack the package: checked on the worker
    with pytest.raises(
        AirflowFailException, match=r"output_type 'no_such_pkg_xyz.Verdict' cannot be imported"
    ):
        op.execute({"ti": FakeTI(), "outlet_events": {}})
    assert server.requests == 0


def test_output_type_and_a_response_format_in_default_body_are_refused(batch):
    with pytest.raises(ConfigurationError, match="default_body sets response_format"):
        batch.operator(output_type=Verdict, default_body={"response_format": {"type": "json_object"}})


def test_an_operator_without_output_type_is_unchanged():
    op = VLLMBatchOperator(task_id="t", input_uri="s3://b/i.jsonl", output_uri="s3://b/o.jsonl", model="m")
    assert op.settings().output_type is None
    assert op.settings().output_schema is None
