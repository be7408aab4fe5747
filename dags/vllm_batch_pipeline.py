"""Example: upload a chat batch to S3, run it through vLLM, validate the results.

A nightly (or UI-triggered, or backfilled) pipeline in three tasks::

    upload ──> vllm_batch (VLLMBatchOperator, queue "gpu") ──> validate

Keys are templated by run id, so runs of different dates (a backfill) or manual
triggers never share an output. Trigger it from the UI to change the model, the
number of requests or the sampling settings. Settings come from environment
variables (see :mod:`airflow_vllm_batch.examples`) so the same file runs on a laptop
and on a GPU worker.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from airflow.sdk import Param, dag, task

from airflow_vllm_batch import examples
from airflow_vllm_batch.batchfile import check_results, open_lines
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

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
        "model": Param(examples.chat_model(), type="string", minLength=1, description="Model name or directory served by vLLM."),
        "n_requests": Param(8, type="integer", minimum=1, maximum=1_000_000, description="How many chat requests to generate."),
        "max_tokens": Param(16, type="integer", minimum=1, maximum=32768, description="max_completion_tokens of every request."),
        "temperature": Param(0.0, type="number", minimum=0, maximum=2, description="Sampling temperature."),
        "max_failed_ratio": Param(0.0, type="number", minimum=0, maximum=1, description="Share of failed requests tolerated."),
    },
    tags=["vllm", "example"],
)
def vllm_batch_pipeline():
    @task
    def upload(params: dict, run_id: str, dag=None) -> str:
        """Write the request file to S3 and return its URI."""
        data = examples.chat_requests(params["n_requests"], params["model"], params["max_tokens"], params["temperature"])
        uri = examples.upload_requests(data, dag.dag_id, run_id)
        log.info("Uploaded %d requests (%d bytes) to %s", params["n_requests"], len(data), uri)
        return uri

    input_uri = upload()
    inference = VLLMBatchOperator(
        task_id="vllm_batch",
        input_uri=input_uri,
        output_uri=PREFIX + "/results.jsonl",
        model="{{ params.model }}",
        engine_args=examples.engine_args(),
        vllm_conn_id=examples.vllm_conn_id(),
        aws_conn_id=examples.aws_conn_id(),
        max_failed_ratio="{{ params.max_failed_ratio }}",
        execution_timeout=timedelta(hours=6),
        queue="gpu",
        outlets=[RESULTS_ASSET],
    )

    @task
    def validate(manifest: dict, params: dict) -> dict:
        """Re-read the results: one answer per custom_id, failures under the threshold."""
        hook = S3Hook(aws_conn_id=examples.aws_conn_id())
        out_bucket, out_key = S3Hook.parse_s3_url(manifest["output_uri"])
        in_bucket, in_key = S3Hook.parse_s3_url(manifest["input_uri"])
        with (
            open_lines(hook.get_key(out_key, out_bucket).get()["Body"]) as results,
            open_lines(hook.get_key(in_key, in_bucket).get()["Body"]) as inputs,
        ):
            report = check_results(results, inputs)
        report.raise_for_mismatch()
        counts = report.request_counts
        if counts["total"] != params["n_requests"]:
            raise ValueError(f"Expected {params['n_requests']} results, found {counts['total']}.")
        ratio = counts["failed"] / counts["total"]
        log.info("Validated %s: %s, usage %s", manifest["output_uri"], counts, report.usage)
        if ratio > float(params["max_failed_ratio"]):
            raise ValueError(f"{counts['failed']} of {counts['total']} requests failed (max {params['max_failed_ratio']}).")
        return {"request_counts": counts, "usage": report.usage}

    validate(inference.output)


pipeline_dag = vllm_batch_pipeline()
