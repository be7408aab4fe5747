"""The server engine with a server the task starts itself (no connection): started, streamed, stopped.

A module of its own so that its server never runs beside the warm one of
``test_server_engine.py`` (one vLLM process at a time on a small machine).

The worker says it has one GPU (``AIRFLOW_VLLM_BATCH_GPUS=0``), so the task leases it
before starting the server and the server inherits the lease (vLLM on a CPU ignores the
``CUDA_VISIBLE_DEVICES`` it gets): the real engine under a real GPU lease, at no extra cost.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timezone

import pytest
from openai.types.chat import ChatCompletion

from airflow_vllm_batch import gpus
from airflow_vllm_batch.embedded.demo import BUCKET, CPU_ENGINE_ARGS
from tests.integration.dagrun import register_dag, run_dag
from tests.processes import processes_with

pytestmark = [pytest.mark.integration, pytest.mark.engine]


def test_a_task_started_server_answers_the_batch_and_is_stopped_with_the_task(embedded, airflow_db, tiny_model, monkeypatch, tmp_path):
    from airflow.sdk import DAG

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    model = str(tiny_model)
    lines = b"".join(
        json.dumps(
            {"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions", "body": {"model": model, "messages": [{"role": "user", "content": f"Count to {i}"}], "max_completion_tokens": 4}}
        ).encode()
        + b"\n"
        for i in range(30)
    )
    embedded.client().put_object(Bucket=BUCKET, Key="started-server/input.jsonl", Body=lines)
    marker = f"started-{uuid.uuid4().hex}"
    monkeypatch.setenv(gpus.GPUS_ENV, "0")
    monkeypatch.setenv(gpus.LOCK_DIR_ENV, str(tmp_path / "gpu-locks"))
    with DAG("server_engine_started", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
        VLLMBatchOperator(
            task_id="vllm_batch",
            input_uri=f"s3://{BUCKET}/started-server/input.jsonl",
            output_uri=f"s3://{BUCKET}/started-server/results.jsonl",
            model=model,
            engine="server",
            engine_args=CPU_ENGINE_ARGS.split(),
            engine_env={"BATCH_TEST_MARKER": marker},
        )
    register_dag(dag)
    run = run_dag(dag)
    assert run.state == "success", run.output[-4000:]
    manifest = run.xcom("vllm_batch")
    assert manifest["request_counts"] == {"total": 30, "completed": 30, "failed": 0}
    assert manifest["identity"]["engine"] == "server" and manifest["identity"]["engine_args"] == CPU_ENGINE_ARGS.split()
    assert "The vLLM server is ready after" in run.output and "Stopping the vLLM server" in run.output
    assert "Leased GPU(s) 0 of 0 (from AIRFLOW_VLLM_BATCH_GPUS) for the engine" in run.output
    assert "Released GPU(s) 0" in run.output
    body = embedded.client().get_object(Bucket=BUCKET, Key="started-server/results.jsonl")["Body"].read()
    results = [json.loads(line) for line in body.splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(f"s{i}" for i in range(30))
    for result in results:
        ChatCompletion.model_validate(result["response"]["body"])
    deadline = time.monotonic() + 15
    while processes_with(f"BATCH_TEST_MARKER={marker}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_with(f"BATCH_TEST_MARKER={marker}")
    free = gpus.try_lease(["0"], 1, str(tmp_path / "gpu-locks"), {})
    assert free is not None, "the server is gone but its GPU is still leased"
    free.release()
