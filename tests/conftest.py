"""Test-session set-up that must happen before anything imports Airflow.

Airflow reads AIRFLOW_HOME and its configuration at import time, so the suite gets a
throw-away home (SQLite database, logs) here, at collection, not in a fixture.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_home = tempfile.mkdtemp(prefix="vllm-batch-tests-airflow-")
os.environ["AIRFLOW_HOME"] = _home
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
# As Airflow's dag processor and task runner put the DAG bundle's root on sys.path: the
# example DAGs and the tests import their shared settings (vllm_batch_examples) from there.
sys.path.append(str(REPO / "dags"))
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "False"
os.environ.setdefault("AIRFLOW__LOGGING__LOGGING_LEVEL", "INFO")


def pytest_collection_modifyitems(config, items) -> None:
    """Under ``make test``, build vLLM 0.33's venv in the background and run its tests last (tests/vllm033.py)."""
    later = [item for item in items if item.get_closest_marker("vllm033")]
    if not later or config.option.collectonly:
        return
    from tests.vllm033 import VLLM033

    VLLM033.start()
    items[:] = [item for item in items if not item.get_closest_marker("vllm033")] + later
