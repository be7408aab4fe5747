"""What the real engines (vLLM on this CPU) report they resolved for the scheduler sizes the task passes.

That both engines resolve vLLM's offline defaults when ``engine_args`` set none is read
from their own logs by ``benchmarks/gpu_acceptance.py``, which the suite runs
(``test_gpu_acceptance.py``): no engine is started twice for it. Here, a user's flag wins.

vLLM 0.32's offline row on a CPU is 256 sequences and 4096 tokens per step; its batch
runner alone would take 128 and 2048, its server 128 and 2048. Each engine is asked what
it resolved from its own log: the runner's ``args: Namespace(...)`` and the server's
``non-default args``, and the scheduler's "Chunked prefill is enabled with
max_num_batched_tokens=N" from both.

Fresh processes: what a server started with the user's ``--max-num-seqs`` resolves is what is
tested (flags of its own).
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone

import pytest

from airflow_vllm_batch.engines import VLLMServer
from tests.integration.dagrun import DagRunResult, register_dag, run_dag
from vllm_batch_embedded.demo import BUCKET, CPU_ENGINE_ARGS

pytestmark = [pytest.mark.integration, pytest.mark.engine]

N = 6


def _run(embedded, tiny_model, name: str, **op_kwargs) -> DagRunResult:
    from airflow.sdk import DAG

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    model = str(tiny_model)
    lines = b"".join(
        json.dumps(
            {
                "custom_id": f"z{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_completion_tokens": 2,
                },
            }
        ).encode()
        + b"\n"
        for i in range(N)
    )
    embedded.client().put_object(Bucket=BUCKET, Key=f"sizing-{name}/input.jsonl", Body=lines)
    with DAG(f"sizing_{name}", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
        VLLMBatchOperator(
            task_id="vllm_batch",
            input_uri=f"s3://{BUCKET}/sizing-{name}/input.jsonl",
            output_uri=f"s3://{BUCKET}/sizing-{name}/results.jsonl",
            model=model,
            **op_kwargs,
        )
    register_dag(dag)
    run = run_dag(dag)
    assert run.state == "success", run.output[-4000:]
    assert run.xcom("vllm_batch")["request_counts"]["completed"] == N
    return run


def _scheduler_resolved(output: str) -> int:
    """The token budget vLLM's scheduler config says it resolved."""
    (tokens,) = set(re.findall(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)", output))
    return int(tokens)


def test_a_users_max_num_seqs_is_what_the_server_resolves(embedded, airflow_db, tiny_model):
    run = _run(
        embedded,
        tiny_model,
        "server_user",
        engine=VLLMServer(args=[*CPU_ENGINE_ARGS.split(), "--max-num-seqs=64"]),
    )
    assert (
        "Scheduler: --max-num-batched-tokens 4096 (vLLM's offline defaults on cpu; --max-num-seqs from the engine's args)"
        in run.output
    )
    (non_default,) = re.findall(r"non-default args: (\{.*\})", run.output)
    assert "'max_num_seqs': 64" in non_default
    assert "'max_num_batched_tokens': 4096" in non_default
    assert _scheduler_resolved(run.output) == 4096
    assert (
        "In flight: at most 128 requests (twice the server's max_num_seqs 64 times its data-parallel size 1)"
        in run.output
    )
