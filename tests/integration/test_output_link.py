"""The output link through Airflow's real task runner: persisted in execute, built at finalize.

No engine: a two-line operator persists the link the way ``VLLMBatchOperator`` does, and
``dag.test()`` runs it, so what the UI reads (the XCom under the link's ``xcom_key``) is
checked end to end in seconds.
"""

from __future__ import annotations

import pytest
from airflow.sdk import DAG, BaseOperator

from airflow_vllm_batch.links import VLLMBatchOutputLink
from tests.integration.dagrun import register_dag, run_dag

pytestmark = pytest.mark.integration

OUTPUT_URI = "s3://vllm-batch/vllm-batch/link-test/results.jsonl"


class PublishingOperator(BaseOperator):
    operator_extra_links = (VLLMBatchOutputLink(),)

    def execute(self, context):
        VLLMBatchOutputLink.persist(context=context, output_uri=OUTPUT_URI)


def test_task_runner_stores_the_formatted_link_for_the_ui(airflow_db, monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW__VLLM_BATCH__OUTPUT_LINK_TEMPLATE", "http://localhost:8888/buckets/{bucket}/{key}"
    )
    with DAG("vllm_batch_output_link_test", schedule=None) as dag:
        PublishingOperator(task_id="publish")
    register_dag(dag)
    result = run_dag(dag)
    assert result.state == "success", result.output[-3000:]
    link = result.xcom("publish", VLLMBatchOutputLink().xcom_key)
    assert link == "http://localhost:8888/buckets/vllm-batch/vllm-batch/link-test/results.jsonl"
