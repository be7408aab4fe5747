"""The progress signals the runner's stall bound reads, checked against vLLM's own sources (no engine start).

vLLM 0.32 (installed) and 0.33 (its venv, ``make vllm033``): the runner's progress report, made
with vLLM's own ``_BAR_FORMAT`` by tqdm as vLLM makes it, must read as progress when its count
rises and as none when it repeats; vLLM's waiting-for-a-hung-process warning must read as no
progress (see :mod:`airflow_vllm_batch.engines.stall`).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
from tqdm import tqdm

from airflow_vllm_batch.engines.stall import StallWatch
from tests.vllm033 import VLLM033

pytestmark = pytest.mark.vllm


def _constant(source: str, name: str) -> str:
    """A module-level string constant of vLLM's source (parsed, not imported: no torch)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            value = ast.literal_eval(node.value)
            return value if isinstance(value, str) else "".join(value)
    raise AssertionError(f"{name} is no longer in vLLM's source")


def _installed(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None
    assert spec.origin is not None
    return Path(spec.origin).read_text(encoding="utf-8")


def _sources(version: str) -> tuple[str, str]:
    """(run_batch.py, shm_broadcast.py) of the installed vLLM 0.32, or of vLLM 0.33's venv (tests/vllm033.py)."""
    if version == "0.32":
        return (
            _installed("vllm.entrypoints.launchers.run_batch"),
            _installed("vllm.distributed.device_communicators.shm_broadcast"),
        )
    return (
        VLLM033.source("entrypoints/launchers/run_batch.py"),
        VLLM033.source("distributed/device_communicators/shm_broadcast.py"),
    )


@pytest.mark.parametrize("version", ["0.32", pytest.param("0.33", marks=pytest.mark.vllm033)])
def test_vllms_progress_report_and_waiting_warning_read_as_the_stall_bound_expects(version):
    run_batch, shm_broadcast = _sources(version)
    bar = _constant(run_batch, "_BAR_FORMAT")
    assert 'desc="Running batch"' in run_batch

    def report(n: int) -> str:
        return tqdm.format_meter(n, 10, 4.0, bar_format=bar, prefix="Running batch").rstrip("\n")

    now = [0.0]
    watch = StallWatch(10, clock=lambda: now[0])
    now[0] = 8
    watch.line(report(3))
    now[0] = 17
    watch.line(report(3))  # the same count again: no progress
    assert watch.silent_s() == 9
    watch.line(_constant(shm_broadcast, "LONG_WAIT_TIME_LOG_MSG") % 60)
    assert watch.silent_s() == 9
    watch.line(report(4))
    assert watch.silent_s() == 0
