"""The server engine with a server the task starts itself (no connection): started, streamed, stopped.

A module of its own so that its server never runs beside the warm one of
``test_server_engine.py`` (one vLLM process at a time on a small machine).

The worker says it has one GPU (``AIRFLOW_VLLM_BATCH_GPUS=0``), so the task leases it
before starting the server and the server inherits the lease (vLLM on a CPU ignores the
``CUDA_VISIBLE_DEVICES`` it gets): the real engine under a real GPU lease, at no extra cost.

Fresh processes: the task-started server is what is tested: its start, and its stop with the task.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timezone

import pytest
from openai.types.chat import ChatCompletion

from airflow_vllm_batch import gpus
from airflow_vllm_batch.engines import VLLMServer
from tests.http_inputs import BasicAuthInput, SecretWatch
from tests.integration.dagrun import error_lines, register_dag, run_dag
from tests.processes import processes_with
from vllm_batch_embedded.demo import BUCKET, CPU_ENGINE_ARGS

pytestmark = [pytest.mark.integration, pytest.mark.engine]


def test_a_task_started_server_answers_the_batch_and_is_stopped_with_the_task(
    embedded, airflow_db, tiny_model, monkeypatch, tmp_path
):
    from airflow.sdk import DAG

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    model = str(tiny_model)
    lines = b"".join(
        json.dumps(
            {
                "custom_id": f"s{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"Count to {i}"}],
                    "max_completion_tokens": 4,
                },
            }
        ).encode()
        + b"\n"
        for i in range(30)
    )
    embedded.client().put_object(Bucket=BUCKET, Key="started-server/input.jsonl", Body=lines)
    marker = f"started-{uuid.uuid4().hex}"
    monkeypatch.setenv(gpus.GPUS_ENV, "0")
    monkeypatch.setenv(gpus.LOCK_DIR_ENV, str(tmp_path / "gpu-locks"))
    with DAG(
        "server_engine_started", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)
    ) as dag:
        VLLMBatchOperator(
            task_id="vllm_batch",
            input_uri=f"s3://{BUCKET}/started-server/input.jsonl",
            output_uri=f"s3://{BUCKET}/started-server/results.jsonl",
            model=model,
            engine=VLLMServer(args=CPU_ENGINE_ARGS.split(), env={"BATCH_TEST_MARKER": marker}),
        )
    register_dag(dag)
    run = run_dag(dag)
    assert run.state == "success", run.output[-4000:]
    manifest = run.xcom("vllm_batch")
    assert manifest["request_counts"] == {"total": 30, "completed": 30, "failed": 0}
    assert manifest["identity"]["engine"] == "server"
    assert manifest["identity"]["engine_args"] == CPU_ENGINE_ARGS.split()
    assert "The vLLM server is ready after" in run.output
    assert "Stopping the vLLM server" in run.output
    assert "Leased GPU(s) 0 of 0 (from AIRFLOW_VLLM_BATCH_GPUS) for the engine" in run.output
    assert "Released GPU(s) 0" in run.output
    assert error_lines(run.output) == []  # starting, using and stopping the server logs no error
    # The leased GPU's seconds are the server's time, from its start to the last answer.
    cost = manifest["cost"]
    assert (cost["device"], cost["gpus"]) == ("gpu", 1)
    assert cost["gpu_s"] == pytest.approx(manifest["engine_duration_s"], abs=0.01)
    assert cost["tokens_per_gpu_s"] > 0
    assert "cost" not in cost
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


def test_a_task_started_pooling_server_answers_embeddings_score_and_rerank_lines(embedded, airflow_db):
    """Every pooling URL preflight accepts for the server engine, through a real vLLM server.

    The embeddings validate with the OpenAI SDK's own type, score and rerank with vLLM's
    own response models; and the server's scores agree with the dot products of its own
    (unit) embeddings of the same texts, so the answers are the model's, not just well-formed.

    The input is an http URL with a password (Basic auth on 127.0.0.1): it is in no line of the
    task log, on no process's command line and in no server process's environment while the
    server runs (*No secrets*; the runner's case is ``test_engine_secrets.py``'s).
    """
    from airflow.sdk import DAG
    from openai.types import CreateEmbeddingResponse
    from vllm.entrypoints.pooling.scoring.protocol import RerankResponse, ScoreResponse

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
    from vllm_batch_embedded.tiny_model import embedding_model_path

    model = str(embedding_model_path())
    query, docs = "Where is Paris?", ["Paris is in France.", "A week has seven days."]
    bodies = {
        "embed": ("/v1/embeddings", {"input": [query, *docs]}),
        "score": ("/score", {"text_1": query, "text_2": docs}),
        "score-v1": ("/v1/score", {"text_1": query, "text_2": docs[0]}),
        "rerank": ("/rerank", {"query": query, "documents": docs}),
        "rerank-v1": ("/v1/rerank", {"query": query, "documents": docs, "top_n": 1}),
    }
    lines = b"".join(
        json.dumps(
            {"custom_id": cid, "method": "POST", "url": url, "body": {"model": model, **body}}
        ).encode()
        + b"\n"
        for cid, (url, body) in bodies.items()
    )
    password = f"PoolingInputPw{uuid.uuid4().hex[:12]}"
    marker = f"started-pooling-{uuid.uuid4().hex}"
    with BasicAuthInput(lines, password) as served:
        with DAG(
            "server_engine_started_pooling",
            schedule=None,
            start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
        ) as dag:
            VLLMBatchOperator(
                task_id="vllm_batch",
                input_uri=served.url,
                output_uri=f"s3://{BUCKET}/started-pooling/results.jsonl",
                model=model,
                engine=VLLMServer(
                    args=[*CPU_ENGINE_ARGS.split(), "--runner", "pooling"], env={"BATCH_TEST_MARKER": marker}
                ),
            )
        register_dag(dag)
        with SecretWatch(password, marker) as watch:
            run = run_dag(dag)
    assert run.state == "success", run.output[-4000:]
    assert watch.engine_seen > 0  # read while the server ran
    assert watch.leaks == []
    assert password not in run.output
    assert served.reads == ["/batches/in.jsonl"]  # the task's one read: the stream sent its checked copy
    assert run.xcom("vllm_batch")["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    body = embedded.client().get_object(Bucket=BUCKET, Key="started-pooling/results.jsonl")["Body"].read()
    answers = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, body.splitlines())}

    vectors = [item.embedding for item in CreateEmbeddingResponse.model_validate(answers["embed"]).data]
    assert [len(v) for v in vectors] == [384, 384, 384]
    dot = [sum(a * b for a, b in zip(vectors[0], v)) for v in vectors[1:]]
    scores = [item.score for item in ScoreResponse.model_validate(answers["score"]).data]
    assert scores == pytest.approx(dot, abs=1e-3)
    assert scores[0] > scores[1]  # the French sentence answers the question about Paris
    assert ScoreResponse.model_validate(answers["score-v1"]).data[0].score == pytest.approx(dot[0], abs=1e-3)
    ranked = RerankResponse.model_validate(answers["rerank"]).results
    assert [r.index for r in ranked] == [0, 1]
    assert [r.relevance_score for r in ranked] == pytest.approx(dot, abs=1e-3)
    assert [r.index for r in RerankResponse.model_validate(answers["rerank-v1"]).results] == [0]
