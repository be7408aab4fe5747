"""The DAG that runs the batches of the OpenAI Batches API (``POST /vllm-batch/openai/v1/batches``).

Copy this file into your DAGs folder (or point ``[vllm_batch] openai_batch_dag_id`` at a
DAG of your own built the same way). Each batch an OpenAI SDK creates is one run of it;
the run's conf is the batch's spec, signed by the API, from which the task derives its
locations (``[vllm_batch] openai_files_uri`` and ``openai_signing_key`` on the workers too). ``model`` is what
every line's ``body.model`` must name; the example settings (``vllm_batch_examples.py``)
read it, the engine arguments and an optional warm server's connection from the
environment.
"""

from __future__ import annotations

from vllm_batch_examples import aws_conn_id, chat_model, engine

from airflow_vllm_batch.openai_api.batch_dag import openai_batch_dag

dag = openai_batch_dag(
    model=chat_model(),
    engine=engine(),
    aws_conn_id=aws_conn_id(),
    queue="gpu",  # where the GPU workers are (docs/gpu-workers.md), as the other example DAGs
)
