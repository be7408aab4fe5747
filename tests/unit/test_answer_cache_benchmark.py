"""``benchmarks/answer_cache.py overhead`` runs here small, so the script behind the cache-overhead figures cannot rot.

Timings are not asserted: the overhead target is proven by the benchmark's full-size figures in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cache_overhead_runs_with_and_without_the_cache_side_by_side_and_prints_wall_and_peak_rss():
    argv = [
        sys.executable,
        str(REPO / "benchmarks" / "answer_cache.py"),
        "overhead",
        "--requests",
        "2000",
        "--runs",
        "1",
    ]
    done = subprocess.run(
        argv,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # One child run per variant; each asserted in the child that every request was answered and none came from the cache.
    assert [line.split()[0] for line in lines[:2]] == ["without", "with"]
    figures = json.loads(lines[-1])
    assert figures["requests"] == 2000
    assert figures["engine"] == "stand-in"
    assert figures["median_wall_s_with"] > 0
    assert figures["median_wall_s_without"] > 0
    assert figures["peak_rss_mb_with"] > 0
    assert figures["peak_rss_mb_without"] > 0
    assert set(figures) >= {"overhead_pct", "peak_rss_delta_mb"}
