"""The pipeline DAG's schedule settings: unchanged by default, a start date and catchup from the environment."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING

from tests.airflow_compat import DagBag
from tests.conftest import REPO

if TYPE_CHECKING:
    import pytest

DAG_FILE = REPO / "dags" / "vllm_batch_pipeline.py"


def parse(monkeypatch: pytest.MonkeyPatch, **env: str):
    for name in ("AIRFLOW_VLLM_BATCH_START_DATE", "AIRFLOW_VLLM_BATCH_CATCHUP"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    bag = DagBag(dag_folder=str(DAG_FILE))
    assert bag.import_errors == {}
    return bag.dags["vllm_batch_pipeline"]


def test_by_default_the_pipeline_has_no_start_date_and_no_catchup(monkeypatch):
    dag = parse(monkeypatch)
    assert dag.start_date is None
    assert dag.catchup is False


def test_the_environment_gives_a_start_date_in_utc_and_turns_catchup_on(monkeypatch):
    dag = parse(monkeypatch, AIRFLOW_VLLM_BATCH_START_DATE="2026-11-01", AIRFLOW_VLLM_BATCH_CATCHUP="true")
    assert dag.start_date == datetime(2026, 11, 1, tzinfo=timezone.utc)
    assert dag.catchup is True
