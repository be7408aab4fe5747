"""A task-started server's engine_args may not set what the task itself sets: its address and key."""

from __future__ import annotations

import pytest

from airflow_vllm_batch.engines.options import VLLMRunner, VLLMServer
from airflow_vllm_batch.engines.vllm.checks import check_engine_args
from airflow_vllm_batch.exceptions import EngineArgumentsError
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

RESERVED = {
    "port": (["--port", "8001"], "--port"),
    "port-equals": (["--port=8001"], "--port"),
    "host": (["--host", "0.0.0.0"], "--host"),
    "api-key": (["--api-key", "mine"], "--api-key"),
    "api_key-underscore": (["--api_key=mine"], "--api_key"),
    "uds": (["--uds", "/tmp/vllm.sock"], "--uds"),
}


def _operator(engine_args):
    return VLLMBatchOperator(
        task_id="t",
        input_uri="s3://b/in.jsonl",
        output_uri="s3://b/out/results.jsonl",
        model="m",
        engine=VLLMServer(args=engine_args),
    )


@pytest.mark.parametrize(("engine_args", "flag"), RESERVED.values(), ids=RESERVED)
def test_a_started_servers_address_or_key_in_engine_args_fails_at_dag_parse_time_naming_the_flag(
    engine_args, flag
):
    with pytest.raises(
        EngineArgumentsError,
        match=rf"^VLLMServer\(args=\.\.\.\): {flag} is not allowed there: the task .*Remove it from args\.",
    ):
        _operator(["--max-model-len", "512", *engine_args])


@pytest.mark.parametrize(("engine_args", "flag"), RESERVED.values(), ids=RESERVED)
def test_a_rendered_reserved_server_flag_is_refused_before_the_engine_python_runs(engine_args, flag):
    # The run-time check (engine_args templated at parse time): refused before the engine's Python is asked.
    with pytest.raises(
        EngineArgumentsError, match=rf"^VLLMServer\(args=\.\.\.\): {flag} is not allowed there"
    ):
        check_engine_args("/nonexistent/python", "m", engine_args, entrypoint="api_server")


def test_the_runner_and_a_warm_connection_keep_their_own_rules():
    # --port means nothing to the runner's parser (its own check says so); not refused here.
    VLLMBatchOperator(
        task_id="t",
        input_uri="s3://b/in.jsonl",
        output_uri="s3://b/out/results.jsonl",
        model="m",
        engine=VLLMRunner(args=["--port", "1"]),
    )


def test_a_templated_flag_value_is_left_for_run_time():
    _operator(["--max-model-len", "{{ params.len }}"])
