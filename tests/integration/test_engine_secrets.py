"""No secrets, with the real vLLM runner and a real task log: an --hf-token in engine_args shows only as ***.

Fresh processes: the runner is the task's own child, and what it prints while it starts (vLLM's
``args:`` line) is what is checked.
"""

from __future__ import annotations

import json

import pytest

from airflow_vllm_batch.engines import VLLMRunner
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
