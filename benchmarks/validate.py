"""Benchmark the batch-file checks: preflight and the results check, speed and peak memory.

Generates chat request files (1M and 100k lines by default, ~250 bytes a line),
a gzip copy of each and matching results files in a temporary directory, then
runs each check in a fresh child process, so that the peak RSS (``ru_maxrss`` of that child) belongs
to one run. vLLM's own line model, ``BatchRequestInput.model_validate_json``, runs
on the same file for comparison (capped at ``--vllm-lines`` lines: it is ~50x slower).

Usage::

    .venv/bin/python benchmarks/validate.py                 # 1M and 100k lines
    .venv/bin/python benchmarks/validate.py --lines 200000 --no-vllm

Prints a markdown table. Lines/s are over CPU time of the check itself
(``time.process_time``), which is what "one core" means; wall time is printed too.

Checks: ``preflight`` (no output), ``preflight+cleaned`` (writing the cleaned copy),
``preflight-gzip`` (the same file gzip-compressed), ``results`` (the results check
reading the input again, as the CLI does), ``results-index`` (the results check
given preflight's ``custom_ids``, as the operator does: only the check is timed,
and the peak RSS includes preflight's index).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

REQUEST = (
    b'{"custom_id": "request-%d", "method": "POST", "url": "/v1/chat/completions", '
    b'"body": {"model": "tiny-llama", "messages": [{"role": "system", "content": "Be brief."}, '
    b'{"role": "user", "content": "Summarise doc %d."}], "max_completion_tokens": 64}}\n'
)
RESULT = (
    b'{"id": "vllm-%032d", "custom_id": "request-%d", "response": {"status_code": 200, '
    b'"request_id": "vllm-batch-%032d", "body": {"id": "chatcmpl-%d", "object": "chat.completion", '
    b'"created": 1715633336, "model": "tiny-llama", "choices": [{"index": 0, "message": {"role": "assistant", '
    b'"content": "A short summary."}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 25, '
    b'"completion_tokens": 5, "total_tokens": 30}}}, "error": null}'
)


def generate(directory: Path, n: int) -> tuple[Path, Path]:
    """Write an n-line request file and its results file (no final newline, as vLLM uploads it)."""
    requests = directory / f"requests-{n}.jsonl"
    results = directory / f"results-{n}.jsonl"
    with open(requests, "wb") as f:
        for start in range(0, n, 10_000):
            f.write(b"".join(REQUEST % (i, i) for i in range(start, min(n, start + 10_000))))
    with open(results, "wb") as f:
        for start in range(0, n, 10_000):
            block = b"\n".join(RESULT % (i, i, i, i) for i in range(start, min(n, start + 10_000)))
            f.write((b"\n" if start else b"") + block)
    with open(requests, "rb") as f, gzip.open(f"{requests}.gz", "wb", compresslevel=1) as out:
        while chunk := f.read(1 << 20):
            out.write(chunk)
    return requests, results


# -- children: one measurement each, in a fresh interpreter -----------------------


def child(kind: str, requests: str, results: str, limit: int) -> dict:
    """Run one check in this (fresh) process and return its figures."""
    sys.path.insert(0, str(REPO))
    from airflow_vllm_batch.batchfile import check_results, open_lines, preflight

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    wall, cpu = time.perf_counter(), time.process_time()
    if kind == "preflight":
        with open_lines(requests) as lines:
            report = preflight(lines)
        count, ok = report.total_lines, report.ok
    elif kind == "preflight+cleaned":
        with open_lines(requests) as lines, open(os.devnull, "wb") as sink:
            report = preflight(lines, cleaned_out=sink)
        count, ok = report.total_lines, report.ok
    elif kind == "preflight-gzip":
        with open_lines(f"{requests}.gz") as lines:
            report = preflight(lines)
        count, ok = report.total_lines, report.ok and report.compression == "gzip"
    elif kind == "results-index":
        with open_lines(requests) as lines:
            index = preflight(lines).custom_ids
        wall, cpu = time.perf_counter(), time.process_time()
        with open_lines(results) as result_lines:
            report = check_results(result_lines, input_index=index)
        count, ok = report.total, report.ok
    elif kind == "results":
        with open_lines(results) as result_lines, open_lines(requests) as input_lines:
            report = check_results(result_lines, input_lines)
        count, ok = report.total, report.ok
    elif kind == "vllm":
        from vllm.entrypoints.launchers.run_batch import BatchRequestInput

        validate = BatchRequestInput.model_validate_json
        wall, cpu = time.perf_counter(), time.process_time()
        count = 0
        with open(requests, encoding="utf-8") as f:
            for text in f:
                validate(text)
                count += 1
                if count >= limit:
                    break
        ok = True
    else:
        raise SystemExit(f"unknown child {kind}")
    cpu = time.process_time() - cpu
    wall = time.perf_counter() - wall
    return {
        "kind": kind,
        "lines": count,
        "ok": ok,
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "lines_per_s": round(count / cpu) if cpu else None,
        "rss_start_mb": round(rss_before / 1024, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def run_child(kind: str, requests: Path, results: Path, limit: int) -> dict:
    """Run :func:`child` in a new interpreter and return what it printed."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(requests), str(results), str(limit)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", default="1000000,100000", help="comma-separated file sizes (lines)")
    parser.add_argument("--vllm-lines", type=int, default=100_000, help="lines vLLM's model validates")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM comparison")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, requests, results, limit = args.child
        print(json.dumps(child(kind, requests, results, int(limit))))
        return

    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-batch-bench-") as tmp:
        for n in (int(x) for x in args.lines.split(",")):
            requests, results = generate(Path(tmp), n)
            size_mb = requests.stat().st_size / 1e6
            kinds = ["preflight", "preflight+cleaned", "preflight-gzip", "results", "results-index"]
            kinds += [] if args.no_vllm else ["vllm"]
            for kind in kinds:
                figures = run_child(kind, requests, results, args.vllm_lines)
                figures["file_lines"] = n
                figures["file_mb"] = round(size_mb, 1)
                rows.append(figures)
                print(f"# {n:,} lines / {kind}: {figures}", file=sys.stderr)
            requests.unlink()
            results.unlink()
            Path(f"{requests}.gz").unlink()

    print(f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs\n")
    print("| file | check | lines checked | CPU s | wall s | lines/s (CPU) | RSS at start | peak RSS |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['file_lines']:,} lines ({r['file_mb']} MB) | {r['kind']} | {r['lines']:,} | {r['cpu_s']} | "
            f"{r['wall_s']} | {r['lines_per_s']:,} | {r['rss_start_mb']} MB | {r['peak_rss_mb']} MB |"
        )


if __name__ == "__main__":
    main()
