"""Example: ``@task.vllm_batch``, the TaskFlow way: a function returns the requests, the task returns the manifest.

``reviews (@task) ──> classify (@task.vllm_batch) ──> use_answers (@task)``

The decorated function runs on the worker when the task starts and returns what
``VLLMBatchOperator(requests=...)`` takes: here chat message lists, one per review, with a
system prompt. The decorator's arguments are the operator's (output, model, engine,
connections); the task's XCom is the run's manifest, which the downstream task reads the
answers of with :func:`~airflow_vllm_batch.storage.read_answers`. Each conversation's
custom_id is ``request-<its index>``; at most 10,000 requests and 8 MiB (bigger batches go
to S3 upstream and through ``VLLMBatchOperator(input_uri=...)``, see ``vllm_batch_pipeline``).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import vllm_batch_examples as examples
from airflow.sdk import Param, dag, task

from airflow_vllm_batch.batchfile import Failed
from airflow_vllm_batch.storage import read_answers

log = logging.getLogger(__name__)

PREFIX = "s3://" + examples.bucket() + "/vllm-batch/{{ dag.dag_id }}/{{ run_id | key_safe }}"
SYSTEM = "Classify the review as positive, negative or neutral. Answer with one word."


@dag(
    dag_id="vllm_batch_taskflow",
    schedule=None,
    catchup=False,
    user_defined_filters={"key_safe": examples.key_safe},
    params={
        "model": Param(
            examples.chat_model(),
            type="string",
            minLength=1,
            description="Model name or directory served by vLLM.",
        ),
    },
    tags=["vllm", "example"],
)
def vllm_batch_taskflow():
    @task
    def reviews() -> list[str]:
        """The rows an earlier step produced: reviews to classify."""
        return [
            "The delivery was fast and the scheduler never missed a run.",
            "The dashboard crashed twice and support never answered.",
            "It works, I guess. Nothing special.",
        ]

    @task.vllm_batch(
        output_uri=PREFIX + "/answers.jsonl",
        model="{{ params.model }}",
        default_body={"temperature": 0, "max_completion_tokens": 8},
        engine=examples.engine(),
        aws_conn_id=examples.aws_conn_id(),
        execution_timeout=timedelta(hours=1),
        queue="gpu",
    )
    def classify(texts: list[str]) -> list[list[dict[str, str]]]:
        """One conversation per review; the task runs them and returns the manifest."""
        return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}] for text in texts]

    @task
    def use_answers(manifest: dict) -> dict[str, str | None]:
        """Receive the answers, one per review, keyed by custom_id (``request-<index>``)."""
        answers: dict[str, str | None] = {}
        for answer in read_answers(manifest, aws_conn_id=examples.aws_conn_id()):
            if isinstance(answer, Failed):
                raise ValueError(f"{answer.custom_id} failed: {answer.error}")
            custom_id, text = answer
            answers[custom_id] = text
        for custom_id, text in sorted(answers.items()):
            log.info("%s: %r", custom_id, text)
        return answers

    use_answers(classify(reviews()))


taskflow_dag = vllm_batch_taskflow()
