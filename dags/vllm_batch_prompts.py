"""Example: prompts from a task in, answers to a task out, no file handling in between.

``prompts (@task) ──> classify (VLLMBatchOperator, requests=XComArg) ──> use_answers (@task)``

The commonest small job, the way vLLM's quickstart writes it (``llm.generate(prompts,
sampling_params)``): an upstream task returns a Python list of prompts, the operator
writes them as a batch file beside its output and runs it, and the downstream task reads
``(custom_id, text)`` pairs with :func:`~airflow_vllm_batch.storage.read_answers`.
Each prompt's custom_id is ``request-<its index>``. XCom is for small batches (at most
10,000 requests, 8 MiB); bigger ones are written to S3 upstream and passed as
``input_uri`` (see ``vllm_batch_pipeline``).
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

PREFIX = "s3://" + examples.bucket() + "/vllm-batch/{{ dag.dag_id }}/{{ run_id | key_safe }}"

REVIEWS = [
    "The delivery was fast and the scheduler never missed a run.",
    "The dashboard crashed twice and support never answered.",
    "It works, I guess. Nothing special.",
    "Best pipeline tool our team has used this year.",
]


@dag(
    dag_id="vllm_batch_prompts",
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
def vllm_batch_prompts():
    @task
    def prompts() -> list[str]:
        """The rows an earlier step produced, as prompts: here, reviews to classify."""
        return [f"Is this review positive, negative or neutral? {review}" for review in REVIEWS]

    classify = VLLMBatchOperator(
        task_id="classify",
        requests=prompts(),
        output_uri=PREFIX + "/answers.jsonl",
        model="{{ params.model }}",
        default_body={"temperature": 0, "max_completion_tokens": 16},
        engine=examples.engine(),
        aws_conn_id=examples.aws_conn_id(),
        execution_timeout=timedelta(hours=1),
        queue="gpu",
    )

    @task
    def use_answers(manifest: dict) -> dict[str, str | None]:
        """Receive the answers, one per prompt, keyed by custom_id (``request-<index>``)."""
        answers: dict[str, str | None] = {}
        for answer in read_answers(manifest, aws_conn_id=examples.aws_conn_id()):
            if isinstance(answer, Failed):
                raise ValueError(f"{answer.custom_id} failed: {answer.error}")
            custom_id, text = answer
            answers[custom_id] = text
        for custom_id, text in sorted(answers.items()):
            log.info("%s: %r", custom_id, text)
        return answers

    use_answers(classify.output)


prompts_dag = vllm_batch_prompts()
