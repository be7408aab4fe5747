"""docs/run-by-hand.md's resume, as the page says to see it: ``airflow dags test``, then ``airflow tasks test`` of the batch task."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.dagrun import REPO

pytestmark = [pytest.mark.integration, pytest.mark.engine]

AIRFLOW = str(Path(sys.executable).with_name("airflow"))


def _airflow(*args: str) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [AIRFLOW, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


def test_airflow_tasks_test_of_a_finished_runs_batch_task_reuses_its_output(embedded, airflow_db):
    page = (REPO / "docs" / "run-by-hand.md").read_text()
    assert "airflow tasks test vllm_batch_pipeline vllm_batch <run_id>" in page
    first = _airflow("dags", "test", "vllm_batch_pipeline", "-c", '{"n_requests": 2, "max_tokens": 4}')
    (run_id,) = set(re.findall(r"run_id=(manual__[^\s,>]+)", first))
    again = _airflow("tasks", "test", "vllm_batch_pipeline", "vllm_batch", run_id)
    assert "(reused: no engine ran in this try)" in again, again[-4000:]
    assert "Starting the vLLM" not in again
