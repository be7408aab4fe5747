"""The operator leases the engine's GPUs on the worker (devices from the environment; engine stand-in, real S3)."""

from __future__ import annotations

import json

import pytest

from airflow_vllm_batch import gpus
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.operators.test_vllm_batch_runs import Batch
from tests.unit.operators.test_vllm_batch_server import (
    Batch as ServerBatch,
    N as SERVER_REQUESTS,
)


@pytest.fixture
def batch(s3, bucket, tmp_path) -> Batch:
    return Batch(s3, bucket, tmp_path)


@pytest.fixture
def worker(monkeypatch, tmp_path):
    """A worker that may use GPUs 0 and 1, its lock files in a directory of this test's own."""
    lock_dir = tmp_path / "gpu-locks"
    monkeypatch.setenv(gpus.GPUS_ENV, "0,1")
    monkeypatch.setenv(gpus.LOCK_DIR_ENV, str(lock_dir))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return lock_dir


def _free(lock_dir, device: str) -> bool:
    fd = gpus.try_lock(gpus.lock_path(str(lock_dir), device))
    if fd is None:
        return False
    gpus.GPULease([device], [fd]).release()
    return True


def test_the_engine_runs_on_the_leased_gpu_which_is_locked_while_it_runs_and_free_after(
    batch, worker, tmp_path
):
    probe = tmp_path / "probe.json"
    batch.run(env={"FAKE_ENGINE_GPU_PROBE": str(probe)})
    seen = json.loads(probe.read_text())
    assert seen == {
        "CUDA_VISIBLE_DEVICES": "0",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "locked": {"0": True, "1": False},
    }
    assert _free(worker, "0")
    assert _free(worker, "1")


def test_a_device_another_task_holds_is_skipped(batch, worker, tmp_path):
    probe = tmp_path / "probe.json"
    with gpus.try_lease(["0"], 1, str(worker), {"task_id": "other"}):
        batch.run(env={"FAKE_ENGINE_GPU_PROBE": str(probe)})
    assert json.loads(probe.read_text())["CUDA_VISIBLE_DEVICES"] == "1"


def test_tensor_parallel_size_is_leased_by_default(batch, worker, tmp_path):
    probe = tmp_path / "probe.json"
    batch.run(args=["--tensor-parallel-size", "2"], env={"FAKE_ENGINE_GPU_PROBE": str(probe)})
    assert json.loads(probe.read_text())["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_parallel_sizes_that_do_not_fit_gpus_fail_without_retry_before_any_engine(batch, worker):
    with pytest.raises(AirflowFailException, match="Set gpus=2"):
        batch.run(gpus=1, args=["-tp", "2"])
    assert batch.engine_runs == 0


def test_a_cpu_worker_leases_nothing_and_leaves_cuda_visible_devices_alone(batch, monkeypatch, tmp_path):
    monkeypatch.setenv(gpus.GPUS_ENV, "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    probe = tmp_path / "probe.json"
    batch.run(env={"FAKE_ENGINE_GPU_PROBE": str(probe)})
    assert json.loads(probe.read_text())["CUDA_VISIBLE_DEVICES"] is None


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_gpus_must_be_a_whole_number_or_none(value):
    from airflow_vllm_batch.engines import VLLMRunner
    from airflow_vllm_batch.exceptions import ConfigurationError
    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    with pytest.raises(ConfigurationError, match="gpus must be"):
        VLLMBatchOperator(
            task_id="t",
            input_uri="s3://b/i.jsonl",
            output_uri="s3://b/o.jsonl",
            model="m",
            engine=VLLMRunner(gpus=value),
        )


@pytest.mark.timeout(120)
def test_a_task_with_a_vllm_connection_leases_no_gpu_even_when_all_are_taken(
    s3, bucket, tmp_path, server, worker
):
    with gpus.try_lease(["0", "1"], 2, str(worker), {"task_id": "other"}):
        manifest = ServerBatch(s3, bucket, tmp_path).run()
    assert manifest["request_counts"]["completed"] == SERVER_REQUESTS


def test_the_manifest_counts_leased_gpus_times_the_engines_time_and_prices_them(batch, worker):
    manifest = batch.run(args=["--tensor-parallel-size", "2"], gpu_hour_cost=2.5)
    cost = manifest["cost"]
    assert (cost["device"], cost["gpus"]) == ("gpu", 2)
    assert cost["gpu_s"] == pytest.approx(2 * manifest["engine_duration_s"], abs=0.01)
    assert cost["tokens_per_gpu_s"] == pytest.approx(
        manifest["usage"]["total_tokens"] / cost["gpu_s"], rel=0.01
    )
    assert cost["cost"] == pytest.approx(cost["gpu_s"] / 3600 * 2.5, abs=1e-5)
    assert sum(entry["cost"] for entry in manifest["per_model"].values()) == pytest.approx(cost["cost"])


def test_on_a_cpu_worker_the_manifest_says_cpu_and_gives_engine_seconds(batch, monkeypatch):
    monkeypatch.setenv(gpus.GPUS_ENV, "")
    cost = batch.run()["cost"]
    assert (cost["device"], cost["gpus"]) == ("cpu", 0)
    assert "gpu_s" not in cost
    assert "cost" not in cost
    assert cost["engine_s"] > 0
    assert cost["tokens_per_engine_s"] > 0


@pytest.mark.timeout(120)
def test_a_vllm_connection_is_counted_by_the_tasks_wall_time_as_a_shared_server(s3, bucket, tmp_path, server):
    manifest = ServerBatch(s3, bucket, tmp_path).run(gpu_hour_cost="3.6")
    cost = manifest["cost"]
    assert cost["device"] == "vllm_connection"
    assert "gpus" not in cost
    assert manifest["engine_duration_s"] <= cost["engine_s"] <= manifest["duration_s"] + 1
    assert "other tasks" in cost["note"]
    assert cost["cost"] == pytest.approx(cost["engine_s"] / 3600 * 3.6, abs=1e-5)
