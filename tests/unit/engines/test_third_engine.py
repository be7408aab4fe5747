"""A third engine, with its own connection type and options, from a module of its own, runs a batch unchanged.

Nothing in the operator, the settings, the run layer or preflight names it
(:mod:`tests.unit.engines.echo_gateway`); the steps are in ``docs/contributing/architecture.md``.
"""

from __future__ import annotations

import json

import pytest

from airflow_vllm_batch.exceptions import ConfigurationError
from tests.unit.engines.echo_gateway import EchoGateway, EchoGatewayEngine
from tests.unit.operators.test_vllm_batch_runs import Batch, FakeTI


@pytest.fixture
def gateway(monkeypatch):
    """An ``echo_gateway`` connection, as Airflow reads one from the environment."""
    conn = {"conn_type": "echo_gateway", "extra": {"greeting": "echo: "}}
    monkeypatch.setenv("AIRFLOW_CONN_MY_GATEWAY", json.dumps(conn))
    EchoGatewayEngine.produced = 0
    return EchoGatewayEngine


def test_a_third_engine_runs_a_batch_through_the_run_layer_with_its_connection_and_options(
    s3, bucket, tmp_path, gateway
):
    batch = Batch(s3, bucket, tmp_path)
    manifest = batch.run(engine=EchoGateway(conn_id="my_gateway", suffix="!", gpu_hour_cost=3.6))
    assert manifest["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert manifest["vllm_version"] == "echo-1"
    answers = {
        json.loads(line)["custom_id"]: json.loads(line)
        for line in batch.get("out/results.jsonl").splitlines()
    }
    assert answers["r3"]["response"]["body"]["choices"][0]["message"]["content"] == "echo: hi 3!"
    # Its own identity, its own pricing basis (a shared server's hours, at its own price).
    assert manifest["identity"]["engine"] == "echo-gateway"
    assert manifest["identity"]["suffix"] == "!"
    assert manifest["cost"]["device"] == "vllm_connection"
    assert manifest["cost"]["gpu_hour_cost"] == 3.6
    # The run layer's resume holds for it too: the same run again does not call the engine.
    assert (
        batch.run(
            FakeTI(try_number=2), engine=EchoGateway(conn_id="my_gateway", suffix="!", gpu_hour_cost=3.6)
        )
        == manifest
    )
    assert gateway.produced == 1


def test_a_third_engines_options_are_templated_and_checked_by_it(s3, bucket, tmp_path, gateway):
    batch = Batch(s3, bucket, tmp_path)
    op = batch.operator(engine=EchoGateway(conn_id="{{ params.gateway }}", suffix="{{ params.suffix }}"))
    op.render_template_fields({"params": {"gateway": "my_gateway", "suffix": " (templated)"}})
    assert (op.engine.conn_id, op.engine.suffix) == ("my_gateway", " (templated)")
    manifest = op.execute({"ti": FakeTI(), "outlet_events": {}})
    answers = [json.loads(line) for line in batch.get("out/results.jsonl").splitlines()]
    assert answers[0]["response"]["body"]["choices"][0]["message"]["content"].endswith(" (templated)")
    assert manifest["request_counts"]["completed"] == 5
    with pytest.raises(ConfigurationError, match="max_words must be a whole number"):
        batch.operator(engine=EchoGateway(max_words=0))
