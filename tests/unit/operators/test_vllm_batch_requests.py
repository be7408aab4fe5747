"""Requests from XCom and model names at the operator, with real S3 and the engine stand-in."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
from aiohttp import web

from airflow_vllm_batch.batchfile.requests import MAX_REQUESTS
from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.operators.test_vllm_batch_runs import Batch, FakeTI, chat_lines
from tests.unit.operators.test_vllm_batch_server import CONN_ID, Batch as WarmBatch, ServedStandIn
from tests.unit.serving.conftest import API_KEY, chat_completion


@pytest.fixture
def batch(s3, bucket, tmp_path) -> Batch:
    return Batch(s3, bucket, tmp_path)


def test_requests_are_written_beside_the_output_and_run(batch):
    manifest = batch.run(input_uri=None, requests=["hello", "bye"], default_body={"max_completion_tokens": 4})
    written = [k for k in batch.keys("out/") if k.startswith("out/results.requests/")]
    assert len(written) == 1
    assert manifest["input_uri"] == f"s3://{batch.bucket}/{written[0]}"
    lines = [json.loads(x) for x in batch.get(written[0]).splitlines()]
    assert [(x["custom_id"], x["body"]["model"], x["body"]["max_completion_tokens"]) for x in lines] == [
        ("request-0", "m", 4),
        ("request-1", "m", 4),
    ]
    assert manifest["request_counts"] == {"total": 2, "completed": 2, "failed": 0}


def test_the_same_requests_again_resume_the_same_run(batch):
    first = batch.run(input_uri=None, requests=["a", "b", "c"])
    again = batch.run(FakeTI(try_number=2), input_uri=None, requests=["a", "b", "c"])
    assert again["fingerprint"] == first["fingerprint"]
    assert batch.engine_runs == 1
    assert len(list(batch.keys("out/results.requests/"))) == 1


def test_other_requests_are_another_run(batch):
    first = batch.run(input_uri=None, requests=["a"])
    second = batch.run(input_uri=None, requests=["b"])
    assert first["fingerprint"] != second["fingerprint"]
    assert batch.engine_runs == 2


@pytest.mark.parametrize("given", [{}, {"input_uri": "s3://b/in.jsonl", "requests": ["a"]}])
def test_exactly_one_of_input_uri_and_requests(given):
    with pytest.raises(ConfigurationError, match="exactly one of them"):
        VLLMBatchOperator(task_id="t", output_uri="s3://b/out.jsonl", model="m", **given)


def test_more_requests_than_xcom_takes_fail_without_retry_and_write_nothing(batch):
    with pytest.raises(AirflowFailException, match="input_uri instead"):
        batch.run(input_uri=None, requests=["x"] * (MAX_REQUESTS + 1))
    assert batch.engine_runs == 0
    assert batch.keys("out/") == []


LORA_ARGS = ["--served-model-name", "chat", "--enable-lora", "--lora-modules", "sql=/adapters/sql"]


def test_lines_use_served_names_and_adapters_and_the_manifest_counts_per_name(batch):
    batch.put(
        "in/input.jsonl",
        chat_lines(2, "chat") + chat_lines(3, "sql").replace(b'"custom_id": "r', b'"custom_id": "s'),
    )
    manifest = batch.run(args=LORA_ARGS)
    assert manifest["request_counts"]["completed"] == 5
    assert {name: c["requests"] for name, c in manifest["per_model"].items()} == {"chat": 2, "sql": 3}
    assert manifest["per_model"]["sql"]["total_tokens"] == 12


def test_the_path_is_no_name_once_served_names_are_given(batch):
    with pytest.raises(
        AirflowFailException, match=r"'m', which the engine does not serve — use one of: 'chat', 'sql'"
    ):
        batch.run(args=LORA_ARGS)
    assert batch.engine_runs == 0


def test_one_name_counts_the_totals_per_model(batch):
    manifest = batch.run()
    assert manifest["per_model"] == {
        "m": {
            "requests": 5,
            "completed": 5,
            "failed": 0,
            "prompt_tokens": 15,
            "completion_tokens": 5,
            "total_tokens": 20,
        }
    }


# -- a warm server's names: its /v1/models listing ---------------------------------------


class AdapterStandIn(ServedStandIn):
    """A warm server that lists its base model and one LoRA adapter, and names the one that answered."""

    async def _models(self, request: web.Request) -> web.Response:
        cards = [
            {"id": "m", "root": "/models/m", "parent": None},
            {"id": "sql", "root": "/adapters/sql", "parent": "m"},
        ]
        return web.json_response({"object": "list", "data": cards})


async def _echo_model(custom_id: str, body: dict, attempt: int) -> web.Response:
    return web.json_response({**chat_completion(custom_id), "model": body["model"]})


@pytest.fixture
def warm_server() -> Iterator[AdapterStandIn]:
    stand_in = AdapterStandIn().start()
    stand_in.behaviour = _echo_model
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(
        {"conn_type": "vllm", "host": "127.0.0.1", "port": stand_in.port, "password": API_KEY}
    )
    yield stand_in
    os.environ.pop(f"AIRFLOW_CONN_{CONN_ID.upper()}", None)
    stand_in.close()


def _warm_lines(models: list[str]) -> bytes:
    # The stand-in keys on the message: it is the custom_id.
    return b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": m, "messages": [{"role": "user", "content": f"r{i}"}]},
            }
        ).encode()
        + b"\n"
        for i, m in enumerate(models)
    )


def test_a_warm_servers_adapters_are_names_its_lines_may_use(s3, bucket, tmp_path, warm_server):
    batch = WarmBatch(s3, bucket, tmp_path)
    batch.client.put_object(Bucket=bucket, Key="in/input.jsonl", Body=_warm_lines(["m", "sql"] * 3))
    manifest = batch.run()
    assert manifest["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert {name: c["completed"] for name, c in manifest["per_model"].items()} == {"m": 3, "sql": 3}


def test_a_name_the_warm_server_does_not_list_fails_naming_the_ones_it_does(
    s3, bucket, tmp_path, warm_server
):
    batch = WarmBatch(s3, bucket, tmp_path)
    batch.client.put_object(Bucket=bucket, Key="in/input.jsonl", Body=_warm_lines(["m", "poem"]))
    with pytest.raises(
        AirflowFailException, match="'poem', which the engine does not serve — use one of: 'm', 'sql'"
    ):
        batch.run()
    assert warm_server.requests == 0
