"""The KubernetesExecutor variant of the sharded DAG: the pod of an inference task, built as the executor builds it.

The DAG goes through the serialization the DAG processor writes and the scheduler reads;
the pod is then made by the ``cncf.kubernetes`` provider's own ``PodGenerator.construct_pod``
with the arguments its ``KubernetesExecutor`` passes (the worker pod template as the base,
the task's ``executor_config`` as the override, the pod mutation hook applied).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# The cncf-kubernetes extra (not on the floor, where the example defines no DAG without it).
pytest.importorskip("airflow.providers.cncf.kubernetes")

from airflow.providers.cncf.kubernetes import kubernetes_executor_templates
from airflow.providers.cncf.kubernetes.kubernetes_helper_functions import (
    create_unique_id,
)
from airflow.providers.cncf.kubernetes.pod_generator import PodGenerator
from kubernetes.client import ApiClient

from tests.airflow_compat import DagBag, DagSerialization
from tests.conftest import REPO

DAG_FILE = REPO / "dags" / "vllm_batch_sharded_k8s.py"
IMAGE = "registry.example.com/ml/airflow-vllm-batch-gpu:1.2.3"
NODE_SELECTOR = {"cloud.google.com/gke-accelerator": "nvidia-l4"}
#: A credential the parsing environment holds: it must not reach the pod spec.
S3_SECRET = "k8s-test-secret-" + "7f3a9c" * 4
S3_KEY_ID = "AKIAK8STESTKEYID0001"
BASE_TEMPLATE = Path(kubernetes_executor_templates.__file__).with_name("basic_template.yaml")


@pytest.fixture(scope="module")
def dag():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AIRFLOW_VLLM_BATCH_K8S_IMAGE", IMAGE)
        env.setenv("AIRFLOW_VLLM_BATCH_K8S_GPUS", "2")
        env.setenv("AIRFLOW_VLLM_BATCH_K8S_NODE_SELECTOR", json.dumps(NODE_SELECTOR))
        env.setenv("AIRFLOW_VLLM_BATCH_K8S_SERVICE_ACCOUNT", "vllm-batch-s3")
        env.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
        env.setenv("AWS_ACCESS_KEY_ID", S3_KEY_ID)
        env.setenv(
            "AIRFLOW_CONN_AWS_DEFAULT",
            json.dumps(
                {
                    "conn_type": "aws",
                    "login": S3_KEY_ID,
                    "password": S3_SECRET,
                    "extra": {"endpoint_url": "http://s3:8333"},
                }
            ),
        )
        bag = DagBag(dag_folder=str(DAG_FILE))
    assert bag.import_errors == {}
    # What the DAG processor stores and the scheduler (and so the executor) reads back.
    return DagSerialization.from_dict(DagSerialization.to_dict(bag.dags["vllm_batch_sharded_k8s"]))


def _pod_for(dag, task_id: str, map_index: int = -1):
    task = dag.get_task(task_id)
    workload = json.dumps({"ti": {"dag_id": dag.dag_id, "task_id": task_id, "map_index": map_index}})
    return PodGenerator.construct_pod(
        namespace="airflow",
        scheduler_job_id="1",
        pod_id=create_unique_id(dag.dag_id, task_id),
        dag_id=dag.dag_id,
        task_id=task_id,
        kube_image="apache/airflow:3.3.2-python3.11",
        try_number=1,
        map_index=map_index,
        date=None,
        run_id="manual__2026-11-22T00:00:00+00:00",
        args=["python", "-m", "airflow.sdk.execution_time.execute_workload", "--json-string", workload],
        pod_override_object=PodGenerator.from_obj(task.executor_config),
        base_worker_pod=PodGenerator.deserialize_model_file(str(BASE_TEMPLATE)),
        with_mutation_hook=True,
    )


@pytest.fixture(scope="module")
def pod(dag) -> dict:
    return ApiClient().sanitize_for_serialization(_pod_for(dag, "vllm_batch", map_index=0))


def test_the_inference_pod_runs_the_engine_image_with_two_gpus(pod):
    (base,) = [c for c in pod["spec"]["containers"] if c["name"] == "base"]
    assert len(pod["spec"]["containers"]) == 1
    assert base["image"] == IMAGE
    assert base["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert base["resources"]["requests"]["nvidia.com/gpu"] == "2"
    # The template's own mounts and environment are kept next to the override's.
    mounts = {m["mountPath"] for m in base["volumeMounts"]}
    assert {"/dev/shm", "/opt/airflow/logs"} <= mounts


def test_the_inference_pod_lands_on_gpu_nodes_with_the_s3_service_account(pod):
    spec = pod["spec"]
    assert spec["nodeSelector"] == NODE_SELECTOR
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["serviceAccountName"] == "vllm-batch-s3"
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"


def test_no_credential_is_anywhere_in_the_pod_spec(pod):
    text = json.dumps(pod)
    for secret in (S3_SECRET, S3_KEY_ID, "X-Amz-Signature", "X-Amz-Credential", "AIRFLOW_CONN_"):
        assert secret not in text
    for container in pod["spec"]["containers"]:
        for var in container.get("env") or []:
            if any(
                word in var["name"].upper()
                for word in ("SECRET", "PASSWORD", "TOKEN", "ACCESS_KEY", "FERNET", "CONN")
            ):
                assert "value" not in var, f"{var['name']} holds a literal value"


def test_the_engine_runs_tensor_parallel_over_the_pods_gpus(dag):
    task = dag.get_task("vllm_batch")
    # The serialized DAG keeps the options as their repr (the worker parses the DAG file for the object itself).
    engine = str(task.partial_kwargs["engine"])
    assert engine.startswith("VLLMRunner(")
    assert "'--tensor-parallel-size', '2'" in engine
    assert "gpus=2" in engine


def test_the_other_tasks_run_in_the_template_pod_without_a_gpu(dag):
    pod = ApiClient().sanitize_for_serialization(_pod_for(dag, "split"))
    (base,) = pod["spec"]["containers"]
    assert base["image"] == "apache/airflow:3.3.2-python3.11"
    assert "nvidia.com/gpu" not in json.dumps(pod)
