"""The sharded DAG on 1 and on 2 Celery ``gpu`` workers: the measured speed-up of adding a worker.

One real Airflow deployment on loopback (the pieces of ``vllm_batch_embedded/airflow_deployment.py``):
Redis as the broker, ``api-server``, ``scheduler``, ``dag-processor``, a Celery worker on
queue ``default`` (upload, split, merge, validate) and Celery workers on queue ``gpu``,
``--concurrency 1`` each, as on a fleet of one-GPU nodes. SeaweedFS for S3, vLLM on the CPU
with the tiny local model. For each phase (default ``1,2``: one gpu worker, then two) the
script makes sure that many ``gpu`` workers are up and ready, triggers ``vllm_batch_sharded``
through the REST API with the same conf (same requests, same shards; a new run id, so no
shard is resumed from an earlier phase), waits for the run and reads its task instances.

It prints, per phase, the DAG run's wall time (start to end, as the scheduler recorded it)
and the inference span (first shard's start to last shard's end), which shards each worker
ran, and the speed-up of each phase over the one-worker phase just before it. Usage::

    .venv/bin/python benchmarks/celery_workers.py                          # ~10 min on 2 cores
    .venv/bin/python benchmarks/celery_workers.py --requests 400 --shard-size 100 --phases 1,2,1,2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The clone's tests and embedded default import only once the clone is on sys.path (above).
from vllm_batch_embedded.airflow_deployment import (  # noqa: E402
    Deployment,
    celery_executor_deployment,
    signal_group,
    start_celery_worker,
)
from vllm_batch_embedded.demo import BUCKET  # noqa: E402
from vllm_batch_embedded.seaweedfs import SeaweedFS  # noqa: E402
from vllm_batch_embedded.tiny_model import build_tiny_chat_model  # noqa: E402

DAG_ID = "vllm_batch_sharded"


def _when(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


@contextlib.contextmanager
def deployment(work: Path, s3: SeaweedFS, model: Path) -> Iterator[Deployment]:
    """Redis, api-server, scheduler, dag-processor and the ``default`` worker (no ``gpu`` worker yet); stopped at the end."""
    home = work / "airflow"
    home.mkdir()
    # Every shard may run at once: the workers, not Airflow's limits, are what is measured.
    extra = {"AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": "64"}
    dag_files = {f"{DAG_ID}.py": (REPO / "dags" / f"{DAG_ID}.py").read_text()}
    with celery_executor_deployment(s3, model, home, dag_files, workers={}, extra_env=extra) as dep:
        start_celery_worker(dep, "default", "default", wait_s=180)
        dep.wait_for_dag(DAG_ID, timeout=180)
        yield dep
        leftover = dep.stop()
        if leftover:
            print(f"warning: processes left alive: {leftover}", file=sys.stderr)


def stop_worker(dep: Deployment, name: str) -> None:
    """Stop one worker (warm shutdown: it has no task between phases)."""
    proc = dep.processes.pop(f"worker-{name}")
    signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


def set_gpu_workers(dep: Deployment, count: int) -> None:
    """Make exactly ``count`` ``gpu`` workers run (gpu1, gpu2, ...)."""
    running = sorted(n.removeprefix("worker-") for n in dep.processes if n.startswith("worker-gpu"))
    for name in running[count:]:
        stop_worker(dep, name)
    for i in range(len(running) + 1, count + 1):
        start_celery_worker(dep, f"gpu{i}", "gpu", wait_s=180)


def run_phase(dep: Deployment, workers: int, conf: dict, timeout: float) -> dict:
    """Trigger the sharded DAG with ``workers`` gpu workers up; return its timings."""
    set_gpu_workers(dep, workers)
    logs_before = {n: len(dep.log(n)) for n in dep.processes if n.startswith("worker-gpu")}
    run_id = dep.trigger(DAG_ID, conf)
    state = dep.wait_for_run(DAG_ID, run_id, timeout)
    run = dep.dag_run(DAG_ID, run_id)
    tis = dep.request("GET", f"{dep.run_path(DAG_ID, run_id)}/taskInstances?limit=1000")["task_instances"]
    if state != "success":
        raise SystemExit(f"run {run_id} ended {state}:\n{dep.diagnose(DAG_ID, run_id, 'vllm_batch')}")
    shards = [ti for ti in tis if ti["task_id"] == "vllm_batch"]
    per_worker = {
        n.removeprefix("worker-"): dep.log(n)[size:].count("task_id='vllm_batch'")
        for n, size in logs_before.items()
    }
    return {
        "workers": workers,
        "run_id": run_id,
        "wall_s": _when(run["end_date"]) - _when(run["start_date"]),
        "inference_s": max(_when(t["end_date"]) for t in shards)
        - min(_when(t["start_date"]) for t in shards),
        "shard_s": [
            round(_when(t["end_date"]) - _when(t["start_date"]), 1)
            for t in sorted(shards, key=lambda t: t["map_index"])
        ],
        "shards": len(shards),
        "per_worker": per_worker,
    }


def speedup_table(results: list[dict]) -> str:
    """A Markdown table; each phase's speed-up is over the one-worker phase run last before it.

    Pairing each phase with the one just before keeps a change of the machine's load (other
    jobs come and go) out of the ratio as far as one run each allows.
    """
    rows = [
        "| gpu workers | DAG run | inference span | speed-up (run) | speed-up (inference) |",
        "|---:|---:|---:|---:|---:|",
    ]
    base = None
    for r in results:
        if r["workers"] == 1:
            base = r
        run_x = f"{base['wall_s'] / r['wall_s']:.2f}" if base else "-"
        inf_x = f"{base['inference_s'] / r['inference_s']:.2f}" if base else "-"
        rows.append(
            f"| {r['workers']} | {r['wall_s']:.1f} s | {r['inference_s']:.1f} s | {run_x} | {inf_x} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="chat requests in the batch (default 400)")
    parser.add_argument(
        "--shard-size", type=int, default=100, help="requests per shard (default 100: 4 shards)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="max_completion_tokens (default 16)")
    parser.add_argument("--phases", default="1,2", help="gpu workers in each phase, in order (default 1,2)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a phase's run may take")
    args = parser.parse_args()
    phases = [int(p) for p in args.phases.split(",")]
    conf = {"n_requests": args.requests, "shard_size": args.shard_size, "max_tokens": args.max_tokens}
    model = build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat")
    work = Path(tempfile.mkdtemp(prefix="vllm-batch-celery-bench-"))
    results = []
    try:
        with SeaweedFS(work / "s3") as s3:
            s3.create_bucket(BUCKET)
            with deployment(work, s3, model) as dep:
                for workers in phases:
                    started = time.monotonic()
                    result = run_phase(dep, workers, conf, args.timeout)
                    results.append(result)
                    print(
                        f"{workers} gpu worker(s): run {result['wall_s']:.1f}s, inference {result['inference_s']:.1f}s, "
                        f"shards {result['shard_s']} s, per worker {result['per_worker']} "
                        f"(phase {time.monotonic() - started:.0f}s)",
                        flush=True,
                    )
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
    print(
        f"\n{args.requests} requests, {results[0]['shards']} shards of {args.shard_size}, max_tokens {args.max_tokens}"
    )
    print(speedup_table(results))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
