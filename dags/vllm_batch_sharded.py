"""Example: a big chat batch split into shards, one mapped inference task per shard, merged back.

::

    upload ──> split ──> vllm_batch[0..n-1] (mapped, queue "gpu") ──> merge ──> validate

Each shard is its own ``VLLMBatchOperator`` task instance, so Airflow spreads the
shards over every worker that serves the ``gpu`` queue, and a shard that fails is
retried alone. A retry, or a cleared run, redoes only what is missing: the split
keeps the shards an earlier try uploaded, and each shard whose results are already
published returns their manifest without starting the engine. Keys are templated by
run id, so different runs never share shards or outputs.

With ``AIRFLOW_VLLM_BATCH_VLLM_CONN_ID`` set (see :mod:`vllm_batch_examples`),
every shard streams through that one running vLLM server: shards cost no engine start.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta

import vllm_batch_examples as examples
from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from airflow.sdk import Param, dag, task

from airflow_vllm_batch.batchfile import check_results, open_lines
from airflow_vllm_batch.operators.shards import (
    VLLMBatchMergeOperator,
    VLLMBatchSplitOperator,
)
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

log = logging.getLogger(__name__)

PREFIX = "s3://" + examples.bucket() + "/vllm-batch/{{ dag.dag_id }}/{{ run_id | key_safe }}"


@dag(
    dag_id="vllm_batch_sharded",
    schedule=None,
    catchup=False,
    max_active_runs=2,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
    user_defined_filters={"key_safe": examples.key_safe},
    params={
        "model": Param(
            examples.chat_model(),
            type="string",
            minLength=1,
            description="Model name or directory served by vLLM.",
        ),
        "n_requests": Param(
            300,
            type="integer",
            minimum=1,
            maximum=100_000_000,
            description="How many chat requests to generate.",
        ),
        "shard_size": Param(
            100,
            type="integer",
            minimum=1,
            maximum=10_000_000,
            description="The most requests in one shard (one engine run).",
        ),
        "max_tokens": Param(
            16,
            type="integer",
            minimum=1,
            maximum=32768,
            description="max_completion_tokens of every request.",
        ),
    },
    tags=["vllm", "example"],
)
def vllm_batch_sharded():
    @task
    def upload(params: dict, run_id: str, dag=None) -> str:
        """Write the request file to S3 and return its URI."""
        data = examples.chat_requests(params["n_requests"], params["model"], params["max_tokens"], 0.0)
        uri = examples.upload_requests(data, dag.dag_id, run_id)
        log.info("Uploaded %d requests (%d bytes) to %s", params["n_requests"], len(data), uri)
        return uri

    input_uri = upload()
    split = VLLMBatchSplitOperator(
        task_id="split",
        input_uri=input_uri,
        shard_prefix=PREFIX + "/shards/",
        max_requests="{{ params.shard_size }}",
        aws_conn_id=examples.aws_conn_id(),
    )
    inference = VLLMBatchOperator.partial(
        task_id="vllm_batch",
        model="{{ params.model }}",
        engine=examples.engine(),
        aws_conn_id=examples.aws_conn_id(),
        execution_timeout=timedelta(hours=2),
        queue="gpu",
    ).expand_kwargs(split.output)
    merge = VLLMBatchMergeOperator(
        task_id="merge",
        shard_manifests=inference.output,
        output_uri=PREFIX + "/results.jsonl",
        input_uri=input_uri,
        aws_conn_id=examples.aws_conn_id(),
    )

    @task
    def validate(manifest: dict, params: dict) -> dict:
        """The merged results answer exactly the input's custom_ids, once each, in input order."""
        hook = S3Hook(aws_conn_id=examples.aws_conn_id())
        out_bucket, out_key = S3Hook.parse_s3_url(manifest["output_uri"])
        in_bucket, in_key = S3Hook.parse_s3_url(manifest["input_uri"])
        with (
            open_lines(hook.get_key(out_key, out_bucket).get()["Body"]) as results,
            open_lines(hook.get_key(in_key, in_bucket).get()["Body"]) as inputs,
        ):
            report = check_results(results, inputs)
        report.raise_for_mismatch()
        with (
            open_lines(hook.get_key(out_key, out_bucket).get()["Body"]) as results,
            open_lines(hook.get_key(in_key, in_bucket).get()["Body"]) as inputs,
        ):
            position = _first_out_of_order(results, inputs)
        if position is not None:
            raise ValueError(
                f"Result line {position} is not the answer to input request {position}: the merge broke input order."
            )
        counts = report.request_counts
        if counts["total"] != params["n_requests"] or counts["failed"]:
            raise ValueError(f"Expected {params['n_requests']} completed results, found {counts}.")
        log.info("Validated %s: %s in input order, usage %s", manifest["output_uri"], counts, report.usage)
        return {"request_counts": counts, "usage": report.usage, "shards": manifest["shards"]}

    validate(merge.output)


def _first_out_of_order(results, inputs) -> int | None:
    """Return the 1-based position of the first result whose custom_id differs from the input's, or None."""
    # The counts already matched (check_results), so zip() sees every line of both.
    for position, (result, request) in enumerate(zip(_ids(results), _ids(inputs)), start=1):
        if result != request:
            return position
    return None


def _ids(lines):
    return (json.loads(line)["custom_id"] for line in lines if line.strip())


sharded_dag = vllm_batch_sharded()
