"""``benchmarks/client_overhead.py`` runs here small, so the script behind the client figures in docs/benchmarks.md cannot rot.

Timings are not asserted: the speed targets are proven by the benchmark and its figures, not by timed tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_client_overhead_prints_cpu_per_request_and_rate_of_stream_and_bare_loop_for_1_and_2_processes():
    argv = [
        sys.executable,
        str(REPO / "benchmarks" / "client_overhead.py"),
        "--requests",
        "2000",
        "--runs",
        "1",
    ]
    argv += ["--in-flight", "64", "--processes", "1,2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("client "))
    assert lines[header].split() == [
        "client",
        "processes",
        "CPU",
        "µs/request",
        "requests/s",
        "least",
        "µs/request",
    ]
    rows = [line.split() for line in lines[header + 1 : header + 5]]
    assert [(row[0], row[1]) for row in rows] == [
        ("stream", "1"),
        ("bare", "1"),
        ("stream", "2"),
        ("bare", "2"),
    ]
    assert all(float(row[2]) > 0 and float(row[3]) > 0 and float(row[4]) > 0 for row in rows)
    assert lines[header + 5].startswith("ratio stream ÷ bare, 1 process(es): CPU per request ")
    assert lines[header + 6].startswith("ratio stream ÷ bare, 2 process(es): CPU per request ")
    assert lines[header + 7].startswith("stream requests/s, 2 processes ÷ 1: ")


def test_client_overhead_times_the_engines_multi_process_stream_for_1_and_2_processes():
    argv = [
        sys.executable,
        str(REPO / "benchmarks" / "client_overhead.py"),
        "--requests",
        "2000",
        "--runs",
        "1",
    ]
    argv += ["--in-flight", "64", "--processes", "1,2", "--clients", "engine", "--answer", "embedding"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("client "))
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [(row[0], row[1]) for row in rows] == [("engine", "1"), ("engine", "2")]
    assert all(float(row[3]) > 0 for row in rows)
    assert lines[header + 3].startswith("engine requests/s, 2 processes ÷ 1: ")
