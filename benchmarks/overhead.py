"""What the operator adds on top of vLLM's own batch runner, on a warm worker and on a fresh one.

Runs the same 1,000-request chat file through

* ``raw``: ``python -m vllm.entrypoints.launchers.run_batch -i local.jsonl -o out.jsonl``
  (local files, nothing else), and
* ``operator``: a DAG with one ``VLLMBatchOperator`` task reading from and writing to
  real S3 (SeaweedFS) through presigned URLs, with preflight, the results check,
  the error split and the publish step; timed as the task instance's duration, twice:
  on a **warm** worker (a ``results_dir`` an untimed first task used before) and as the
  **first task on a fresh worker** (a new, empty ``results_dir``, as a Kubernetes
  executor's new pod has; same Python process, so the process's own imports are not in it),

alternating them so that drift of the machine hits all alike, and prints the ratio of the
medians (raw against warm) and each operator's time outside the engine. Usage::

    .venv/bin/python benchmarks/overhead.py [--requests 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "dags"))  # the example settings live beside the example DAGs

import vllm_batch_examples as examples  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vllm-batch-bench-"))
    os.environ["AIRFLOW_HOME"] = str(work / "airflow")
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"

    from vllm_batch_embedded.demo import BUCKET, CPU_ENGINE_ARGS, embedded_env
    from vllm_batch_embedded.seaweedfs import SeaweedFS
    from vllm_batch_embedded.tiny_model import build_tiny_chat_model

    model = build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat")
    data = examples.chat_requests(args.requests, str(model), args.max_tokens, 0.0)
    local_input = work / "input.jsonl"
    local_input.write_bytes(data)

    with SeaweedFS(work / "s3") as s3:
        s3.create_bucket(BUCKET)
        os.environ.update(embedded_env(s3, model, work / "airflow"))
        s3.client().put_object(Bucket=BUCKET, Key="bench/input.jsonl", Body=data)

        from airflow.sdk import DAG
        from airflow.utils.db import resetdb

        from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

        resetdb()
        engine_args = CPU_ENGINE_ARGS.split()
        warm_dir = work / "warm-worker"
        # Untimed: the process's first task (clients, imports) and the warm worker's first task.
        run_operator(DAG, VLLMBatchOperator, "warmup", model, engine_args, warm_dir)
        raw_times: list[float] = []
        op_times: dict[str, list[float]] = {"warm": [], "fresh": []}
        engine_in_op: dict[str, list[float]] = {"warm": [], "fresh": []}
        for rep in range(args.repeats):
            raw_times.append(run_raw(local_input, work / f"raw-{rep}.jsonl", model, engine_args))
            for kind in ("warm", "fresh") if rep % 2 == 0 else ("fresh", "warm"):
                results_dir = warm_dir if kind == "warm" else work / f"fresh-worker-{rep}"
                op_times[kind].append(
                    run_operator(DAG, VLLMBatchOperator, f"{kind}-{rep}", model, engine_args, results_dir)
                )
                manifest = json.loads(
                    s3.client()
                    .get_object(Bucket=BUCKET, Key=f"bench/out-{kind}-{rep}/results.manifest.json")["Body"]
                    .read()
                )
                engine_in_op[kind].append(manifest["engine_duration_s"])
            print(
                f"repeat {rep + 1}: raw {raw_times[-1]:.1f}s; "
                + "; ".join(
                    f"operator on a {kind} worker {op_times[kind][-1]:.1f}s (engine inside it {engine_in_op[kind][-1]:.1f}s, "
                    f"the rest {op_times[kind][-1] - engine_in_op[kind][-1]:.1f}s)"
                    for kind in ("warm", "fresh")
                ),
                flush=True,
            )

    raw, op = statistics.median(raw_times), statistics.median(op_times["warm"])
    outside = {
        kind: [o - e for o, e in zip(op_times[kind], engine_in_op[kind])] for kind in ("warm", "fresh")
    }
    print(
        json.dumps(
            {
                "requests": args.requests,
                "repeats": args.repeats,
                "raw_s": [round(t, 2) for t in raw_times],
                "operator_s": [round(t, 2) for t in op_times["warm"]],
                "raw_median_s": round(raw, 2),
                "operator_median_s": round(op, 2),
                "operator_engine_s": [round(t, 2) for t in engine_in_op["warm"]],
                "operator_outside_engine_s": [round(t, 2) for t in outside["warm"]],
                "operator_outside_engine_median_s": round(statistics.median(outside["warm"]), 2),
                "ratio_of_medians": round(op / raw, 3),
                "fresh_worker_operator_s": [round(t, 2) for t in op_times["fresh"]],
                "fresh_worker_operator_median_s": round(statistics.median(op_times["fresh"]), 2),
                "fresh_worker_engine_s": [round(t, 2) for t in engine_in_op["fresh"]],
                "fresh_worker_outside_engine_s": [round(t, 2) for t in outside["fresh"]],
                "fresh_worker_outside_engine_median_s": round(statistics.median(outside["fresh"]), 2),
            }
        )
    )


def run_raw(local_input: Path, output: Path, model: Path, engine_args: list[str]) -> float:
    """Time vLLM's runner alone on local files."""
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.launchers.run_batch",
        "-i",
        str(local_input),
        "-o",
        str(output),
    ]
    started = time.monotonic()
    subprocess.run(
        [*argv, "--model", str(model), *engine_args],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.monotonic() - started


def run_operator(
    dag_cls, operator_cls, name: str, model: Path, engine_args: list[str], results_dir: Path
) -> float:
    """Time one VLLMBatchOperator task (its task-instance duration) in ``dag.test()``, on the worker of ``results_dir``."""
    from airflow.utils.session import create_session

    from airflow_vllm_batch.engines import VLLMRunner
    from tests.integration.dagrun import register_dag

    with dag_cls(
        f"bench_overhead_{name}", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)
    ) as dag:
        operator_cls(
            task_id="vllm_batch",
            input_uri="s3://vllm-batch/bench/input.jsonl",
            output_uri=f"s3://vllm-batch/bench/out-{name}/results.jsonl",
            model=str(model),
            engine=VLLMRunner(args=engine_args),
            results_dir=str(results_dir),
            execution_timeout=timedelta(hours=1),
        )
    register_dag(dag)
    with open(os.devnull, "w") as devnull:
        saved = os.dup(1), os.dup(2)
        os.dup2(devnull.fileno(), 1)
        os.dup2(devnull.fileno(), 2)
        try:
            dr = dag.test()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    with create_session() as session:
        (ti,) = dr.get_task_instances(session=session)
        if str(ti.state) != "success":
            raise SystemExit(f"operator run {name} ended {ti.state}")
        return (ti.end_date - ti.start_date).total_seconds()


if __name__ == "__main__":
    main()
