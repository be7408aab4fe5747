"""Example: the sharded batch on the KubernetesExecutor, each inference task in a GPU pod of its own.

::

    upload ──> split ──> vllm_batch[0..n-1] (mapped; a GPU pod each) ──> merge

The same pipeline as ``vllm_batch_sharded``; what differs is where the inference tasks
run. With the KubernetesExecutor every task instance is a pod: ``upload``, ``split`` and
``merge`` run in the worker pod template's image (no GPU, no vLLM), and each shard's
``VLLMBatchOperator`` runs in a pod built from the same template plus this task's
``executor_config`` (:func:`airflow_vllm_batch.gpu_pods.gpu_pod_override`): the engine image,
``nvidia.com/gpu`` limits, the GPU nodes' node selector and tolerations, a service account
for S3. The cluster autoscaler then adds GPU nodes for the shards that wait, and removes
them when the batch is done.

Settings, read when the DAG file is parsed (the scheduler builds the pods from them):

``AIRFLOW_VLLM_BATCH_K8S_IMAGE``            the GPU worker image (Airflow + this provider + vLLM,
                                            ``docker/Dockerfile.gpu-worker``)
``AIRFLOW_VLLM_BATCH_K8S_GPUS``             GPUs per inference pod (default 1); above 1 the engine
                                            runs tensor parallel over them
``AIRFLOW_VLLM_BATCH_K8S_NODE_SELECTOR``    the GPU nodes' labels as JSON, e.g.
                                            ``{"cloud.google.com/gke-accelerator": "nvidia-l4"}``
``AIRFLOW_VLLM_BATCH_K8S_SERVICE_ACCOUNT``  the inference pods' service account (its cloud
                                            identity may use the bucket); default: the template's

plus the settings of :mod:`vllm_batch_examples` (bucket, model, engine args, AWS connection).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from datetime import timedelta

import vllm_batch_examples as examples
from airflow.sdk import Param, dag, task

from airflow_vllm_batch.engines import VLLMRunner
from airflow_vllm_batch.gpu_pods import gpu_pod_override
from airflow_vllm_batch.operators.shards import (
    VLLMBatchMergeOperator,
    VLLMBatchSplitOperator,
)
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

IMAGE = os.environ.get("AIRFLOW_VLLM_BATCH_K8S_IMAGE", "ghcr.io/example/airflow-vllm-batch-gpu-worker:0.1.0")
GPUS = int(os.environ.get("AIRFLOW_VLLM_BATCH_K8S_GPUS", "1"))
NODE_SELECTOR = json.loads(
    os.environ.get("AIRFLOW_VLLM_BATCH_K8S_NODE_SELECTOR", '{"nvidia.com/gpu.present": "true"}')
)
SERVICE_ACCOUNT = os.environ.get("AIRFLOW_VLLM_BATCH_K8S_SERVICE_ACCOUNT") or None

PREFIX = "s3://" + examples.bucket() + "/vllm-batch/{{ dag.dag_id }}/{{ run_id | key_safe }}"


@dag(
    dag_id="vllm_batch_sharded_k8s",
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
            description="The most requests in one shard (one pod).",
        ),
        "max_tokens": Param(
            16,
            type="integer",
            minimum=1,
            maximum=32768,
            description="max_completion_tokens of every request.",
        ),
    },
    tags=["vllm", "example", "kubernetes"],
)
def vllm_batch_sharded_k8s():
    @task
    def upload(params: dict, run_id: str, dag=None) -> str:
        """Write the request file to S3 and return its URI."""
        data = examples.chat_requests(params["n_requests"], params["model"], params["max_tokens"], 0.0)
        return examples.upload_requests(data, dag.dag_id, run_id)

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
        # The pod holds exactly its GPUs: the engine leases them all.
        engine=VLLMRunner(
            args=examples.engine_args(*(["--tensor-parallel-size", str(GPUS)] if GPUS > 1 else [])),
            python=examples.engine_python(),
            gpus=GPUS,
        ),
        aws_conn_id=examples.aws_conn_id(),
        execution_timeout=timedelta(hours=2),
        executor_config=gpu_pod_override(
            image=IMAGE, gpus=GPUS, node_selector=NODE_SELECTOR, service_account_name=SERVICE_ACCOUNT
        ),
    ).expand_kwargs(split.output)
    VLLMBatchMergeOperator(
        task_id="merge",
        shard_manifests=inference.output,
        output_uri=PREFIX + "/results.jsonl",
        input_uri=input_uri,
        aws_conn_id=examples.aws_conn_id(),
    )


# Like Airflow's own example_kubernetes_executor: without the Kubernetes client (the
# cncf.kubernetes provider, this provider's ``cncf-kubernetes`` extra) there is no pod to
# describe, and the file defines no DAG instead of failing to parse.
if importlib.util.find_spec("kubernetes") is not None:
    sharded_k8s_dag = vllm_batch_sharded_k8s()
else:
    logging.getLogger(__name__).warning(
        "vllm_batch_sharded_k8s needs the Kubernetes client: pip install 'airflow-vllm-batch[cncf-kubernetes]'"
    )
