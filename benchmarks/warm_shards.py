"""A sharded batch on one warm vLLM server against one runner run of the whole file.

The same N-request chat file (tiny local model, CPU, ``max_completion_tokens`` 1 as in
``benchmarks/scale.py``) runs, side by side in one run of this script:

* ``runner``: vLLM's batch runner on the whole file (started as ``benchmarks/engines.py``
  starts it), timed from its start to its exit (what one task with the runner engine pays);
* ``warm``: one :class:`~airflow_vllm_batch.engines.vllm.server_process.VLLMServerProcess`, then the
  file split into ``--shards`` shards with :func:`~airflow_vllm_batch.sharding.split_lines`,
  each streamed through the server with :func:`~airflow_vllm_batch.serving.run_stream`
  one after another (what the mapped shards of ``dags/vllm_batch_sharded.py`` do on one
  worker pointed at a warm server), and the shards' journals joined with
  :func:`~airflow_vllm_batch.sharding.merge_results`.

It prints both walls and two ratios: ``warm ÷ runner`` counting the server's start once
(a server the DAG starts for this batch) and not counting it (a server that was already
warm, as a ``vllm`` connection gives). Local files only: the S3 transfers, preflight and
results check of the operators are in neither figure. Usage::

    .venv/bin/python benchmarks/warm_shards.py [--requests 50000] [--shards 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "dags"))  # the example settings live beside the example DAGs
sys.path.insert(0, str(REPO / "benchmarks"))

import vllm_batch_examples as examples  # noqa: E402
from engines import run_runner, stream_once  # noqa: E402

from vllm_batch_embedded.demo import CPU_ENGINE_ARGS, CPU_ENGINE_ENV  # noqa: E402
from vllm_batch_embedded.tiny_model import build_tiny_chat_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--shards", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=1)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vllm-batch-warm-shards-"))
    os.environ.setdefault("AIRFLOW_HOME", str(work / "airflow"))  # the hooks import Airflow
    model = str(build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat"))
    local_input = work / "input.jsonl"
    local_input.write_bytes(examples.chat_requests(args.requests, model, args.max_tokens, 0.0))
    env = {**os.environ, **CPU_ENGINE_ENV}
    engine_args = CPU_ENGINE_ARGS.split()

    _, _, runner_s = run_runner(local_input, work / "runner.jsonl", model, engine_args, env)
    print(f"runner, whole file: {runner_s:.1f}s from its start to its exit", flush=True)

    ready_s, shard_s, merge_s, merged = warm_shards(local_input, work, model, engine_args, env, args)
    warm_s = sum(shard_s) + merge_s
    print(
        json.dumps(
            {
                "requests": args.requests,
                "shards": args.shards,
                "max_tokens": args.max_tokens,
                "runner_whole_file_s": round(runner_s, 1),
                "server_time_to_ready_s": round(ready_s, 1),
                "warm_shard_s": [round(s, 1) for s in shard_s],
                "merge_s": round(merge_s, 2),
                "warm_total_without_start_s": round(warm_s, 1),
                "warm_total_with_start_s": round(warm_s + ready_s, 1),
                "ratio_warm_over_runner": round(warm_s / runner_s, 3),
                "ratio_warm_with_start_over_runner": round((warm_s + ready_s) / runner_s, 3),
                "merged_lines": merged,
                "load_after": os.getloadavg(),
            }
        )
    )


def warm_shards(
    local_input: Path,
    work: Path,
    model: str,
    engine_args: list[str],
    env: dict[str, str],
    args: argparse.Namespace,
) -> tuple[float, list[float], float, int]:
    """Start one server, stream every shard through it in turn, merge; return the timings and lines merged."""
    from airflow_vllm_batch.batchfile import open_lines
    from airflow_vllm_batch.engines.vllm.server_process import VLLMServerProcess
    from airflow_vllm_batch.serving import DEFAULT_MAX_IN_FLIGHT
    from airflow_vllm_batch.sharding import merge_results, split_lines

    shard_dir = work / "shards"
    shard_dir.mkdir()
    per_shard = -(-args.requests // args.shards)
    with open_lines(local_input) as lines:
        shards = list(
            split_lines(
                lines,
                lambda i: open(shard_dir / f"{i:03d}.jsonl", "wb"),  # noqa: SIM115 - split_lines closes each shard
                max_requests=per_shard,
            )
        )
    shard_s: list[float] = []
    with VLLMServerProcess(model, engine_args=engine_args, env=env, startup_timeout_s=600) as server:
        assert server.hook is not None
        ready_s = server.time_to_ready_s or 0.0
        print(f"server ready after {ready_s:.1f}s", flush=True)
        for shard in shards:
            path = shard_dir / f"{shard.index:03d}.jsonl"
            shard_s.append(
                stream_once(
                    path,
                    work / f"journal-{shard.index:03d}",
                    server.hook,
                    DEFAULT_MAX_IN_FLIGHT,
                    shard.requests,
                )
            )
            print(
                f"shard {shard.index + 1}/{len(shards)}: {shard.requests} requests in {shard_s[-1]:.1f}s",
                flush=True,
            )
    started = time.monotonic()
    parts = sorted(work.glob("journal-*/part-*.jsonl"))
    with open(work / "merged.jsonl", "wb") as out:
        merged = merge_results(parts, out)
    merge_s = time.monotonic() - started
    if merged != args.requests:
        raise SystemExit(f"merged {merged} answers, expected {args.requests}")
    return ready_s, shard_s, merge_s, merged


if __name__ == "__main__":
    main()
