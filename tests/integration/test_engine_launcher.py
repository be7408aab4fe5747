"""One vLLM import per task (issue 26 item 2): the engine's own process checks its flags and sizes itself, real vLLM on this CPU.

Each task runs on a fresh worker (its own empty ``results_dir``), where the task used to
import vLLM a second time in a separate check process. A refused flag still fails before
the model loads, once, with the separate check's message; a good runner run and a good
task-started server run start with the offline sizes their launcher read.

Fresh processes: each test is an engine's start on a fresh worker: its flag check and its sizing
in its own process.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

import pytest

from tests.integration.dagrun import DagRunResult, register_dag, run_dag
from vllm_batch_embedded.demo import BUCKET, CPU_ENGINE_ARGS

pytestmark = [pytest.mark.integration, pytest.mark.engine]

N = 4
RUNNER_HELP = "python -m vllm.entrypoints.launchers.run_batch --help"


def _run(embedded, tiny_model, tmp_path, name: str, **op_kwargs) -> DagRunResult:
    from airflow.sdk import DAG

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    model = str(tiny_model)
    lines = b"".join(
        json.dumps(
            {
                "custom_id": f"l{i}",
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
    embedded.client().put_object(Bucket=BUCKET, Key=f"launcher-{name}/input.jsonl", Body=lines)
    with DAG(f"launcher_{name}", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
        VLLMBatchOperator(
            task_id="vllm_batch",
            input_uri=f"s3://{BUCKET}/launcher-{name}/input.jsonl",
            output_uri=f"s3://{BUCKET}/launcher-{name}/results.jsonl",
            model=model,
            results_dir=str(tmp_path / "fresh-worker"),
            retries=1,
            retry_delay=timedelta(0),
            **op_kwargs,
        )
    register_dag(dag)
    return run_dag(dag)


def _try_number(dag_id: str, result: DagRunResult) -> int:
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        return session.scalar(
            select(TaskInstance.try_number).where(
                TaskInstance.dag_id == dag_id, TaskInstance.run_id == result.run_id
            )
        )


def _model_loaded(output: str) -> bool:
    return "Loading safetensors checkpoint shards" in output or "Starting to load model" in output


@pytest.mark.parametrize("engine", ["runner", "server"])
def test_a_misspelled_flag_fails_once_before_the_model_loads_with_the_checks_message(
    embedded, airflow_db, tiny_model, tmp_path, engine
):
    from airflow_vllm_batch.engines import VLLMRunner, VLLMServer

    options = {"runner": VLLMRunner, "server": VLLMServer}[engine](
        args=[*CPU_ENGINE_ARGS.split(), "--max-modle-len", "64"]
    )
    result = _run(embedded, tiny_model, tmp_path, f"bad_{engine}", engine=options)
    assert result.state == "failed"
    # The server's parser takes a bare word as its positional model tag, so it names the flag alone.
    refused, help_command = (
        ("--max-modle-len 64", RUNNER_HELP)
        if engine == "runner"
        else ("--max-modle-len", "vllm serve --help")
    )
    # The separate check's message, word for word, now from the engine's own process.
    assert (
        f"{type(options).__name__}(args=...): unrecognized arguments: {refused} (did you mean --max-model-len for --max-modle-len?). "
        f"Fix args (see '{help_command}')."
    ) in result.output, result.output[-4000:]
    assert "stopping before the model loads" in result.output
    assert not _model_loaded(result.output)
    assert _try_number(f"launcher_bad_{engine}", result) == 1  # not retried


def test_a_runner_task_on_a_fresh_worker_starts_the_engine_with_its_offline_sizes_and_answers(
    embedded, airflow_db, tiny_model, tmp_path
):
    from airflow_vllm_batch.engines import VLLMRunner

    result = _run(
        embedded, tiny_model, tmp_path, "good_runner", engine=VLLMRunner(args=CPU_ENGINE_ARGS.split())
    )
    assert result.state == "success", result.output[-4000:]
    assert result.xcom("vllm_batch")["request_counts"] == {"total": N, "completed": N, "failed": 0}
    assert (
        "Scheduler: --max-num-seqs 256 --max-num-batched-tokens 4096 (vLLM's offline defaults on cpu)"
        in result.output
    )
    # The runner parsed the flags its launcher added (its own "args:" line).
    (namespace,) = re.findall(r"args: Namespace\((.*)\)", result.output)
    assert "max_num_seqs=256" in namespace
    assert "max_num_batched_tokens=4096" in namespace
    # No check or defaults remembered on the worker: a fresh worker and a warm one start the engine alike
    # (only the flags the parser knows are kept, to refuse a misspelling without starting an engine).
    kept = [p.name for p in (tmp_path / "fresh-worker").glob("airflow-vllm-batch/engine-*")]
    assert [name for name in kept if not name.startswith("engine-options-")] == []


def test_a_task_started_server_on_a_fresh_worker_starts_with_its_offline_sizes_and_answers(
    embedded, airflow_db, tiny_model, tmp_path
):
    from airflow_vllm_batch.engines import VLLMServer

    result = _run(
        embedded, tiny_model, tmp_path, "good_server", engine=VLLMServer(args=CPU_ENGINE_ARGS.split())
    )
    assert result.state == "success", result.output[-4000:]
    assert result.xcom("vllm_batch")["request_counts"] == {"total": N, "completed": N, "failed": 0}
    assert (
        "Scheduler: --max-num-seqs 256 --max-num-batched-tokens 4096 (vLLM's offline defaults on cpu)"
        in result.output
    )
    assert (
        "In flight: at most 512 requests (twice the server's max_num_seqs 256 times its data-parallel size 1)"
        in result.output
    )
    (non_default,) = re.findall(r"non-default args: (\{.*\})", result.output)
    assert "'max_num_seqs': 256" in non_default
    assert "'max_num_batched_tokens': 4096" in non_default
