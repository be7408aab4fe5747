"""GPU leases: real flocks held by real processes; the devices come from the environment (no GPU here)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from airflow_vllm_batch import gpus
from airflow_vllm_batch.exceptions import ConfigurationError
from tests.processes import processes_with

#: A "task": leases COUNT of DEVICES (polling fast), records when it held which, holds, releases.
HOLDER = textwrap.dedent(
    """
    import json, os, sys, time
    from airflow_vllm_batch import gpus
    lock_dir, devices, count, hold_s, record = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    lease = gpus.lease_gpus(devices, count, directory=lock_dir, holder={"task": record}, poll_s=0.02)
    start = time.time()
    time.sleep(hold_s)
    end = time.time()
    with open(record, "w") as f:
        json.dump({"devices": lease.devices, "start": start, "end": end}, f)
    lease.release()
    """
)

#: A "task" that leases one device and starts a bound engine holding the lease's descriptors, then waits.
TASK_WITH_ENGINE = textwrap.dedent(
    """
    import os, sys, time
    from airflow_vllm_batch import gpus
    from airflow_vllm_batch.engines.vllm.process import start_bound_process
    lock_dir, marker = sys.argv[1], sys.argv[2]
    lease = gpus.lease_gpus(["0"], 1, directory=lock_dir)
    engine = "import signal, time; signal.signal(signal.SIGTERM, lambda *a: time.sleep(1.5) or exit(0)); print('up', flush=True); time.sleep(600)"
    proc = start_bound_process([sys.executable, "-c", engine], env={**os.environ, marker: "1"}, grace_s=5, pass_fds=lease.fds)
    print(proc.stdout.readline().decode().strip(), flush=True)
    time.sleep(600)
    """
)


def _python(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", *args], env={**os.environ, "PYTHONPATH": os.getcwd()}, **kwargs
    )


def _is_free(lock_dir: Path, device: str) -> bool:
    fd = gpus.try_lock(gpus.lock_path(str(lock_dir), device))
    if fd is None:
        return False
    os.close(fd)
    return True


# -- which devices, how many --------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({gpus.GPUS_ENV: "0,1", "CUDA_VISIBLE_DEVICES": "3"}, (["0", "1"], gpus.GPUS_ENV)),
        ({gpus.GPUS_ENV: ""}, ([], gpus.GPUS_ENV)),
        ({"CUDA_VISIBLE_DEVICES": "2, 3"}, (["2", "3"], "CUDA_VISIBLE_DEVICES")),
        ({"CUDA_VISIBLE_DEVICES": "GPU-8f1c,GPU-77aa"}, (["GPU-8f1c", "GPU-77aa"], "CUDA_VISIBLE_DEVICES")),
        ({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, (["1"], "CUDA_VISIBLE_DEVICES")),
    ],
)
def test_worker_devices_come_from_the_override_then_cuda_visible_devices(environ, expected):
    assert gpus.worker_devices(environ) == expected


def test_without_any_setting_the_driver_is_asked_and_a_machine_without_one_has_no_gpu(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpus.worker_devices({}) == ([], "nvidia-smi -L")


@pytest.mark.parametrize(
    ("engine_args", "needed"),
    [
        ([], 1),
        (["--tensor-parallel-size", "2"], 2),
        (["--tensor-parallel-size=4"], 4),
        (["-tp", "2", "--pipeline-parallel-size", "2"], 4),
        (["--tensor_parallel_size", "2", "-dp", "2"], 4),
        (["-tp", "2", "--data-parallel-size", "4", "--data-parallel-size-local", "2"], 4),
        (["--max-model-len", "2"], 1),
    ],
)
def test_the_engine_needs_tensor_times_pipeline_times_local_data_parallel_devices(engine_args, needed):
    assert gpus.devices_needed(engine_args) == needed


@pytest.mark.parametrize(
    "engine_args", [["-tp", "two"], ["--tensor-parallel-size=0"], ["--pipeline-parallel-size"]]
)
def test_a_parallel_size_that_is_not_a_positive_number_is_a_configuration_error(engine_args):
    with pytest.raises(ConfigurationError, match=r"^VLLMRunner\(args=\.\.\.\): "):
        gpus.devices_needed(engine_args)


def test_by_default_a_gpu_worker_leases_what_the_parallelism_needs_and_a_cpu_worker_none():
    assert gpus.gpus_to_lease(None, [], ["0", "1"], "x") == 1
    assert gpus.gpus_to_lease(None, ["-tp", "2"], ["0", "1"], "x") == 2
    assert gpus.gpus_to_lease(None, ["-tp", "2"], [], "x") == 0
    assert gpus.gpus_to_lease(0, ["-tp", "2"], ["0", "1"], "x") == 0


def test_parallel_sizes_larger_than_gpus_fail_fast_naming_the_fix():
    with pytest.raises(
        ConfigurationError,
        match=r"^VLLMRunner\(args=\.\.\.\) ask for 4 GPUs \(tensor_parallel_size=2, pipeline_parallel_size=2\) but VLLMRunner\(gpus=2\)\. Set gpus=4",
    ):
        gpus.gpus_to_lease(2, ["-tp", "2", "-pp", "2"], ["0", "1", "2", "3"], "x")


def test_more_gpus_than_the_worker_may_use_fail_fast_naming_the_devices_and_their_source():
    with pytest.raises(
        ConfigurationError,
        match=r"needs 4 GPU\(s\), but this worker .* may use 2 \(0,1\), from CUDA_VISIBLE_DEVICES",
    ):
        gpus.gpus_to_lease(4, [], ["0", "1"], "CUDA_VISIBLE_DEVICES")
    with pytest.raises(ConfigurationError, match="may use none"):
        gpus.gpus_to_lease(1, [], [], gpus.GPUS_ENV)


def test_cuda_visible_devices_in_the_options_env_narrows_the_workers_devices(monkeypatch):
    monkeypatch.setenv(gpus.GPUS_ENV, "0,1,2,3")
    plan = gpus.plan_gpus(None, [], {"CUDA_VISIBLE_DEVICES": "2"}, engine="VLLMServer")
    assert plan == gpus.GPUPlan(1, ("2",), "CUDA_VISIBLE_DEVICES in VLLMServer(env=...)")


# -- leasing --------------------------------------------------------------------------------


def test_a_lease_is_all_or_nothing_and_released_devices_are_free_again(tmp_path):
    first = gpus.try_lease(["0", "1", "2"], 2, str(tmp_path), {})
    assert first is not None
    assert first.devices == ["0", "1"]
    assert gpus.try_lease(["0", "1", "2"], 2, str(tmp_path), {}) is None
    # The failed attempt let go of the one device it could take.
    assert _is_free(tmp_path, "2")
    first.release()
    assert _is_free(tmp_path, "0")
    assert _is_free(tmp_path, "1")


def test_the_lock_file_names_its_holder_for_the_waiting_tasks_logs(tmp_path):
    with gpus.try_lease(["0"], 1, str(tmp_path), {"task_id": "vllm_batch", "map_index": 3}):
        holder = json.loads(gpus.holder_of(str(tmp_path), "0"))
    assert holder["task_id"] == "vllm_batch"
    assert holder["map_index"] == 3
    assert holder["pid"] == os.getpid()


def test_four_concurrent_tasks_on_two_devices_never_share_one(tmp_path):
    lock_dir = tmp_path / "locks"
    records = [tmp_path / f"task-{i}.json" for i in range(4)]
    procs = [_python(HOLDER, str(lock_dir), "0,1", "1", "0.6", str(r)) for r in records]
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    held = [json.loads(r.read_text()) for r in records]
    assert all(len(h["devices"]) == 1 for h in held)
    for device in ("0", "1"):
        spans = sorted((h["start"], h["end"]) for h in held if h["devices"] == [device])
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end, f"device {device} held by two tasks at once: {spans}"
    # Four 0.6 s holds on two devices: at least two rounds, so somebody waited.
    assert max(h["end"] for h in held) - min(h["start"] for h in held) >= 1.1


def test_a_waiting_task_says_so_and_gets_the_device_once_it_is_free(tmp_path):
    lines = []
    holder = gpus.try_lease(["0"], 1, str(tmp_path), {"task_id": "first"})
    proc_started = time.monotonic()
    threading.Timer(0.5, holder.release).start()
    lease = gpus.lease_gpus(
        ["0"],
        1,
        directory=str(tmp_path),
        log=lambda *a: lines.append(a[0] % a[1:]),
        poll_s=0.05,
        log_every_s=60,
    )
    assert lease.devices == ["0"]
    assert time.monotonic() - proc_started >= 0.4
    lease.release()
    assert len(lines) == 1
    assert lines[0].startswith("Waiting for 1 free GPU(s) of 0 for 0s")
    assert '"task_id": "first"' in lines[0]


def test_a_sigkilled_holder_frees_its_device(tmp_path):
    record = tmp_path / "never.json"
    proc = _python(HOLDER, str(tmp_path), "0", "1", "600", str(record))
    deadline = time.monotonic() + 30
    while _is_free(tmp_path, "0"):
        assert time.monotonic() < deadline, "the holder never took the device"
        assert proc.poll() is None, "the holder never took the device"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _is_free(tmp_path, "0")


def test_the_engine_keeps_the_lease_until_it_is_gone_even_when_the_task_is_sigkilled(tmp_path):
    marker = f"GPU_LEASE_TEST_{uuid.uuid4().hex}"
    task = _python(TASK_WITH_ENGINE, str(tmp_path), marker, stdout=subprocess.PIPE)
    assert task.stdout.readline().strip() == b"up"
    assert not _is_free(tmp_path, "0")
    task.send_signal(signal.SIGKILL)
    task.wait()
    # The task is gone, its engine is stopping (it takes 1.5 s to exit on SIGTERM): still leased.
    assert processes_with(marker)
    assert not _is_free(tmp_path, "0")
    deadline = time.monotonic() + 20
    while not _is_free(tmp_path, "0"):
        assert time.monotonic() < deadline, f"device still leased; engine processes: {processes_with(marker)}"
        time.sleep(0.05)
    assert not processes_with(marker)
