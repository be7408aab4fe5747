"""The asset consumer example DAG: it parses, it is scheduled on the results Asset, it reports events."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

import pytest
import vllm_batch_examples as examples
from airflow.sdk.api.datamodels._generated import AssetReferenceAssetEventDagRun
from airflow.sdk.execution_time.comms import AssetEventDagRunReferenceResult
from airflow.sdk.execution_time.context import TriggeringAssetEventsAccessor

from tests.airflow_compat import DagBag
from tests.conftest import REPO

DAG_FILE = REPO / "dags" / "vllm_batch_asset_consumer.py"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def dag():
    bag = DagBag(dag_folder=str(DAG_FILE))
    assert bag.import_errors == {}
    return bag.dags["vllm_batch_asset_consumer"]


def _event(run_id: str, completed: int, failed: int, at: datetime) -> AssetEventDagRunReferenceResult:
    asset = examples.results_asset()
    prefix = f"s3://{examples.bucket()}/vllm-batch/vllm_batch_pipeline/{run_id}"
    extra = {
        "output_uri": f"{prefix}/results.jsonl",
        "error_uri": f"{prefix}/results.errors.jsonl" if failed else None,
        "manifest_uri": f"{prefix}/results.manifest.json",
        "request_counts": {"total": completed + failed, "completed": completed, "failed": failed},
        "usage": {"prompt_tokens": 52, "completion_tokens": 36, "total_tokens": 88},
        "model": "tiny",
    }
    return AssetEventDagRunReferenceResult(
        asset=AssetReferenceAssetEventDagRun(name=asset.name, uri=asset.uri, extra={}),
        extra=extra,
        source_task_id="vllm_batch",
        source_dag_id="vllm_batch_pipeline",
        source_run_id=run_id,
        source_map_index=-1,
        source_aliases=[],
        timestamp=at,
    )


def test_dag_file_imports_without_errors():
    assert DagBag(dag_folder=str(DAG_FILE)).import_errors == {}


def test_dag_is_scheduled_on_the_pipeline_results_asset(dag):
    assert list(dag.timetable.asset_condition.objects) == [examples.results_asset()]


def test_report_returns_each_triggering_batch_oldest_first(dag, caplog):
    events = TriggeringAssetEventsAccessor.build(
        [
            _event("run-b", completed=3, failed=1, at=T0 + timedelta(hours=1)),
            _event("run-a", completed=5, failed=0, at=T0),
        ]
    )
    report = dag.get_task("report_results").python_callable
    with caplog.at_level(logging.INFO):
        summaries = report(triggering_asset_events=events)
    assert [s["source"] for s in summaries] == ["vllm_batch_pipeline/run-a", "vllm_batch_pipeline/run-b"]
    assert summaries[1]["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert summaries[1]["output_uri"].endswith("/run-b/results.jsonl")
    assert summaries[0]["error_uri"] is None
    assert "3 of 4 requests completed, 1 failed" in caplog.text


def test_report_without_an_asset_event_returns_nothing(dag):
    report = dag.get_task("report_results").python_callable
    assert report(triggering_asset_events=TriggeringAssetEventsAccessor.build([])) == []
