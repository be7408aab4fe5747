"""Example: a downstream DAG that runs whenever the pipeline DAG publishes results.

``vllm_batch_pipeline`` (its ``vllm_batch`` task) ──Asset event──> ``report_results``

Scheduled on the Asset the pipeline's inference task declares as outlet
(:func:`vllm_batch_examples.results_asset`), so it needs no sensor and no
cross-DAG dependency: the scheduler starts a run after each successful batch. The
asset event's ``extra`` carries the batch's summary (``output_uri``, ``error_uri``,
``manifest_uri``, ``request_counts``, ``usage``, ``model``), so this DAG knows what
was published without reading a single result line.
"""

from __future__ import annotations

import logging
from typing import Any

import vllm_batch_examples as examples
from airflow.sdk import dag, task

log = logging.getLogger(__name__)

RESULTS_ASSET = examples.results_asset()
#: The fields of a results event this DAG reports.
SUMMARY_FIELDS = ("output_uri", "error_uri", "manifest_uri", "request_counts", "usage", "model")


@dag(
    dag_id="vllm_batch_asset_consumer",
    schedule=[RESULTS_ASSET],
    catchup=False,
    tags=["vllm", "example"],
)
def vllm_batch_asset_consumer():
    @task
    def report_results(triggering_asset_events=None) -> list[dict[str, Any]]:
        """Log and return the summary of every batch whose results triggered this run.

        Several pipeline runs can finish before this DAG runs once; each one's event is
        reported, oldest first.
        """
        # Not `(events or {}).get(...)`: an empty accessor is falsy, and Airflow 3.0's Asset is no dict key.
        events = triggering_asset_events.get(RESULTS_ASSET, []) if triggering_asset_events else []
        summaries = []
        for event in sorted(events, key=lambda e: e.timestamp):
            summary = {field: event.extra.get(field) for field in SUMMARY_FIELDS}
            summary["source"] = f"{event.source_dag_id}/{event.source_run_id}"
            counts = summary["request_counts"] or {}
            log.info(
                "Batch %s published %s: %s of %s requests completed, %s failed; errors: %s",
                summary["source"],
                summary["output_uri"],
                counts.get("completed"),
                counts.get("total"),
                counts.get("failed"),
                summary["error_uri"] or "none",
            )
            summaries.append(summary)
        if not summaries:
            # A manual trigger has no asset event: say so rather than succeed silently.
            log.warning("No %s event triggered this run: nothing to report.", RESULTS_ASSET.name)
        return summaries

    report_results()


asset_consumer_dag = vllm_batch_asset_consumer()
