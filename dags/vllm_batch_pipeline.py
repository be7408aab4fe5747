"""Example: upload a chat batch to S3, run it through vLLM, validate the results.

A nightly (or UI-triggered, or backfilled) pipeline in three tasks::

    upload ──> vllm_batch (VLLMBatchOperator, queue "gpu") ──> validate

Keys are templated by run id, so runs of different dates (a backfill) or manual
triggers never share an output. Trigger it from the UI to change the model, the
number of requests or the sampling settings. Settings come from environment
variables (see :mod:`vllm_batch_examples`) so the same file runs on a laptop
and on a GPU worker.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import vllm_batch_examples as examples
from airflow.sdk import Param, dag, task

from airflow_vllm_batch.batchfile import Failed
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.storage import read_answers

log = logging.getLogger(__name__)

RESULTS_ASSET = examples.results_asset()
PREFIX = "s3://" + examples.bucket() + "/vllm-batch/{{ dag.dag_id }}/{{ run_id | key_safe }}"


@dag(
    dag_id="vllm_batch_pipeline",
    schedule="@daily",
    # Both unset by default (no start date, no catchup); a test or a deployment that wants
    # past intervals run sets AIRFLOW_VLLM_BATCH_START_DATE and AIRFLOW_VLLM_BATCH_CATCHUP.
    start_date=examples.start_date(),
    catchup=examples.catchup(),
    max_active_runs=4,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=2)},
    user_defined_filters={"key_safe": examples.key_safe},
    params={
        "model": Param(
            examples.chat_model(),
            type="string",
            minLength=1,
            description="Model name or directory served by vLLM.",
        ),
        "n_requests": Param(
            8, type="integer", minimum=1, maximum=1_000_000, description="How many chat requests to generate."
        ),
        "max_tokens": Param(
            16,
            type="integer",
            minimum=1,
            maximum=32768,
            description="max_completion_tokens of every request.",
        ),
        "temperature": Param(0.0, type="number", minimum=0, maximum=2, description="Sampling temperature."),
        "max_failed_ratio": Param(
            0.0, type="number", minimum=0, maximum=1, description="Share of failed requests tolerated."
        ),
    },
    tags=["vllm", "example"],
)
def vllm_batch_pipeline():
    @task
    def upload(params: dict, run_id: str, dag=None) -> str:
        """Write the request file to S3 and return its URI."""
        data = examples.chat_requests(
            params["n_requests"], params["model"], params["max_tokens"], params["temperature"]
        )
        uri = examples.upload_requests(data, dag.dag_id, run_id)
        log.info("Uploaded %d requests (%d bytes) to %s", params["n_requests"], len(data), uri)
        return uri

    input_uri = upload()
    inference = VLLMBatchOperator(
        task_id="vllm_batch",
        input_uri=input_uri,
        output_uri=PREFIX + "/results.jsonl",
        model="{{ params.model }}",
        engine=examples.engine(),
        aws_conn_id=examples.aws_conn_id(),
        max_failed_ratio="{{ params.max_failed_ratio }}",
        execution_timeout=timedelta(hours=6),
        queue="gpu",
        outlets=[RESULTS_ASSET],
    )

    @task
    def validate(manifest: dict, params: dict) -> dict:
        """Read the answers back: one per request (the reader checks them against the manifest), failures under the threshold."""
        counts = {"total": 0, "completed": 0, "failed": 0}
        for answer in read_answers(manifest, aws_conn_id=examples.aws_conn_id()):
            counts["total"] += 1
            if isinstance(answer, Failed):
                counts["failed"] += 1
                log.warning("%s failed: %s", answer.custom_id, answer.error)
            else:
                counts["completed"] += 1
        if counts["total"] != params["n_requests"]:
            raise ValueError(f"Expected {params['n_requests']} answers, found {counts['total']}.")
        log.info("Validated %s: %s, usage %s", manifest["output_uri"], counts, manifest["usage"])
        if counts["failed"] / counts["total"] > float(params["max_failed_ratio"]):
            raise ValueError(
                f"{counts['failed']} of {counts['total']} requests failed (max {params['max_failed_ratio']})."
            )
        return {"request_counts": counts, "usage": manifest["usage"]}

    validate(inference.output)


pipeline_dag = vllm_batch_pipeline()
