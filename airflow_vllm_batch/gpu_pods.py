"""The ``executor_config`` that runs a ``VLLMBatchOperator`` task in a GPU pod on the KubernetesExecutor.

With the KubernetesExecutor every task instance is a pod built from the worker pod
template, the executor's own settings and, last, the task's
``executor_config={"pod_override": V1Pod(...)}`` (``PodGenerator.construct_pod`` of the
``cncf.kubernetes`` provider merges the three). :func:`gpu_pod_override` builds that last
part for an inference task:

* the engine image (Airflow, this provider and vLLM: ``docker/Dockerfile.gpu-worker``);
* ``nvidia.com/gpu`` limits (the NVIDIA device plugin gives the pod exactly that many GPUs,
  and the operator's GPU lease then simply takes them all);
* a node selector and tolerations to land on the GPU nodes (which are usually tainted so
  nothing else lands there);
* a memory-backed ``/dev/shm``: vLLM's tensor-parallel workers talk through shared memory,
  and a container's default 64 MiB makes NCCL fail;
* optionally the service account whose cloud identity reads and writes the bucket (IRSA on
  EKS, Workload Identity on GKE), so that no S3 key is ever written into the pod spec.

Nothing here holds a credential, and nothing should be added that does: secrets reach the
pod through its service account or ``valueFrom`` references, never as values.

Needs ``apache-airflow-providers-cncf-kubernetes`` (it brings the ``kubernetes`` client)
wherever the DAG is parsed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: The name the KubernetesExecutor gives the task's container; the override must use it to be merged into it.
BASE_CONTAINER = "base"
#: The resource name the NVIDIA device plugin advertises.
GPU_RESOURCE = "nvidia.com/gpu"
#: The taint GPU node pools commonly carry (GKE and EKS GPU AMIs, the GPU operator's docs).
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def gpu_pod_override(
    *,
    image: str,
    gpus: int = 1,
    node_selector: Mapping[str, str] | None = None,
    tolerations: Sequence[Mapping[str, str]] | None = (GPU_TOLERATION,),
    service_account_name: str | None = None,
    memory: str | None = None,
    cpu: str | None = None,
    shm_size: str = "16Gi",
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Return ``{"pod_override": V1Pod}`` for a task whose engine runs on ``gpus`` GPUs of one node.

    :param image: the worker image with Airflow, this provider and vLLM.
    :param gpus: the ``nvidia.com/gpu`` limit (and request). Default 1; make it match the
        engine's tensor x pipeline parallel size.
    :param node_selector: labels of the GPU nodes, e.g.
        ``{"cloud.google.com/gke-accelerator": "nvidia-l4"}``. Default: none.
    :param tolerations: tolerations of the GPU nodes' taints. Default: ``nvidia.com/gpu`` exists.
    :param service_account_name: the pod's service account, e.g. one bound to an IAM role that
        may use the bucket. Default: the pod template's.
    :param memory: the container's memory request and limit, e.g. ``"32Gi"``. Default: none.
    :param cpu: the container's CPU request, e.g. ``"8"``. Default: none.
    :param shm_size: the size of the memory-backed ``/dev/shm``. Default ``16Gi``.
    :param env: plain (non-secret) environment variables, e.g. ``{"HF_HOME": "/models"}``.
    """
    from kubernetes.client import models as k8s

    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"gpus must be a whole number >= 1, got {gpus!r}.")
    limits = {GPU_RESOURCE: str(gpus)}
    requests = {GPU_RESOURCE: str(gpus)}
    if memory:
        limits["memory"] = requests["memory"] = memory
    if cpu:
        requests["cpu"] = cpu
    container = k8s.V1Container(
        name=BASE_CONTAINER,
        image=image,
        resources=k8s.V1ResourceRequirements(limits=limits, requests=requests),
        env=[k8s.V1EnvVar(name=k, value=str(v)) for k, v in (env or {}).items()] or None,
        volume_mounts=[k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm")],
    )
    spec = k8s.V1PodSpec(
        containers=[container],
        node_selector=dict(node_selector) if node_selector else None,
        tolerations=[k8s.V1Toleration(**t) for t in tolerations] if tolerations else None,
        service_account_name=service_account_name,
        volumes=[
            k8s.V1Volume(
                name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=shm_size)
            )
        ],
    )
    return {"pod_override": k8s.V1Pod(spec=spec)}
