"""Test-session set-up that must happen before anything imports Airflow, and the suite's order.

Airflow reads AIRFLOW_HOME and its configuration at import time, so the suite gets a
throw-away home (SQLite database, logs) here, at collection, not in a fixture. Under
pytest-xdist every worker imports this file, so every worker has a home of its own.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

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

#: Modules handed out first when the suite runs on several workers (``make test``: pytest-xdist,
#: ``--dist loadfile``, so a module's fixtures start once, on one worker): the compose stack
#: (its images take 6-13 minutes cold) and the floor (its venv and unit run), then the longest
#: as measured (docs/contributing.md). Their waits on builds, a scheduler or an engine's start
#: then overlap the other worker's tests instead of ending the run.
FIRST = (
    "tests/integration/test_compose_stack.py",
    "tests/integration/test_floor_wheel.py",
    "tests/integration/test_openai_api.py",
    "tests/integration/test_supervised.py",
    "tests/integration/test_chaos_smoke.py",
    "tests/integration/test_scheduled_runs.py",
    "tests/integration/test_celery_gpu_queue.py",
    "tests/integration/test_server_engine.py",
    "tests/integration/test_operator.py",
)


def xdist_worker() -> str | None:
    """This process's pytest-xdist worker id (``gw0``, ...), or None when the session runs in one process."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start vLLM 0.33's venv build (``make test``) and order the session.

    vLLM 0.33's tests run last, each waiting for the build (tests/vllm033.py). Under xdist a
    module goes to one worker whole, in the order of its first test here, so the modules of
    :data:`FIRST` come first and every module holding a vLLM 0.33 test comes last.
    """
    later = [item for item in items if item.get_closest_marker("vllm033")]
    if config.option.collectonly:
        return
    if later:
        from tests.vllm033 import VLLM033

        VLLM033.start()
    if xdist_worker() is None:
        items[:] = [item for item in items if not item.get_closest_marker("vllm033")] + later
        return
    last = {item.nodeid.split("::")[0] for item in later}

    def rank(item: pytest.Item) -> int:
        module = item.nodeid.split("::")[0]
        if module in FIRST:
            return FIRST.index(module)
        return len(FIRST) + (module in last)

    items.sort(key=rank)  # stable: within a rank, collection order
