"""No secrets, with the real vLLM runner and a real task log: an --hf-token in engine_args shows only as ***;
an http(s) input's password is in no line of the task log and on no process's command line.

Fresh processes: the runner is the task's own child, and what it prints while it starts (vLLM's
``args:`` line, its ``Reading batch from`` line) and its command line are what is checked.
"""

from __future__ import annotations

import json
import uuid

import pytest

from airflow_vllm_batch.engines import VLLMRunner
from tests.http_inputs import BasicAuthInput, SecretWatch
from tests.integration.test_operator import _line, _put, _run_operator
from vllm_batch_embedded.demo import BUCKET

pytestmark = pytest.mark.integration

SECRET = "hf_dummyTokenThatMustNotBeLogged42"


@pytest.mark.engine
def test_an_hf_token_in_engine_args_is_masked_in_our_line_and_vllms_own_args_line(
    embedded, airflow_db, tiny_model
):
    model = str(tiny_model)
    uri = _put(
        embedded,
        "secrets/input.jsonl",
        "".join(_line(f"s{i}", model, max_completion_tokens=2) + "\n" for i in range(2)),
    )
    result = _run_operator(
        "hf_token",
        input_uri=uri,
        output_uri=f"s3://{BUCKET}/secrets/results.jsonl",
        model=model,
        engine=VLLMRunner(args=["--enforce-eager", "--hf-token", SECRET]),
    )
    assert result.state == "success", result.output[-3000:]
    assert SECRET not in result.output
    assert "--hf-token ***" in result.output  # our "Starting the vLLM engine" line
    assert "hf_token='***'" in result.output  # vLLM's own args line, relayed
    assert SECRET not in json.dumps(result.rendered, default=str)  # the rendered fields Airflow stored
    manifest = result.xcom("vllm_batch")
    assert SECRET not in json.dumps(manifest)
    assert manifest["identity"]["engine_args"] == ["--enforce-eager", "--hf-token", "<secret>"]


@pytest.mark.engine
def test_an_http_inputs_password_is_in_no_task_log_line_and_on_no_command_line_while_the_runner_runs(
    embedded, airflow_db, tiny_model
):
    model = str(tiny_model)
    password = f"HttpInputPw{uuid.uuid4().hex[:12]}"
    data = "".join(_line(f"h{i}", model, max_completion_tokens=2) + "\n" for i in range(2)).encode()
    marker = f"engine-secrets-{uuid.uuid4().hex}"
    with BasicAuthInput(data, password) as served, SecretWatch(password, marker) as watch:
        result = _run_operator(
            "http_password",
            input_uri=served.url,
            output_uri=f"s3://{BUCKET}/secrets-http/results.jsonl",
            model=model,
            engine=VLLMRunner(args=["--enforce-eager"], env={"TEST_ENGINE_MARKER": marker}),
        )
    assert result.state == "success", result.output[-3000:]
    assert result.xcom("vllm_batch")["request_counts"]["completed"] == 2
    assert watch.engine_seen > 0  # the command lines were read while the engine ran
    assert watch.leaks == []  # the old code: the engine's environment (its arguments, concealed there)
    # The old code: our "Starting the vLLM engine" line, vLLM's "args: Namespace(...)" and "Reading batch from".
    assert password not in result.output
    # vLLM's own line names what it read: the task's checked copy, a local file.
    reading = [line for line in result.output.splitlines() if "Reading batch from" in line]
    assert reading, result.output[-3000:]
    assert all("/input.jsonl" in line and "127.0.0.1" not in line for line in reading), reading
    # The task's one read (preflight); the engine read nothing from the server.
    assert served.reads == ["/batches/in.jsonl"]
