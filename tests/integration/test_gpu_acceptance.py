"""``benchmarks/gpu_acceptance.py`` runs here on the CPU with the tiny model, so the script a user runs on a GPU cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_batch_embedded.demo import CPU_ENGINE_ARGS, CPU_ENGINE_ENV

pytestmark = [pytest.mark.integration, pytest.mark.engine]

REPO = Path(__file__).resolve().parents[2]


def test_acceptance_script_prints_both_engines_their_resolved_sizes_and_no_gpu_utilisation(
    tiny_model, tmp_path
):
    env = {**os.environ, **CPU_ENGINE_ENV, "PYTHONPATH": str(REPO), "AIRFLOW_HOME": str(tmp_path / "airflow")}
    env.pop("AIRFLOW_CONN_AWS_DEFAULT", None)  # the script starts its own S3
    script = REPO / "benchmarks" / "gpu_acceptance.py"
    argv = [
        sys.executable,
        str(script),
        "--model",
        str(tiny_model),
        "--requests",
        "8",
        "--max-tokens",
        "2",
        "--engine-args",
        *CPU_ENGINE_ARGS.split(),
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("engine  "))
    assert lines[header].split("  ")[0] == "engine"
    assert "GPU util %" in lines[header]
    runner, server = (lines[header + 2].split(), lines[header + 3].split())
    # engine, requests, requests/s, output tokens/s, max_num_seqs, max_num_batched_tokens, in flight, GPU util
    assert runner[0] == "runner"
    assert runner[1] == "8"
    assert runner[4:] == ["256", "4096", "-", "n/a"]
    assert server[0] == "server"
    assert server[1] == "8"
    assert server[4:] == ["256", "4096", "512", "n/a"]
    assert float(runner[2]) > 0
    assert float(server[3]) > 0
    assert lines[header + 4].startswith("ratio server ÷ runner: requests/s ")
