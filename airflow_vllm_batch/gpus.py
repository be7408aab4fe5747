"""GPU leases on a shared worker: which devices a task's engine gets, and that no other task gets them.

A Celery worker with ``--concurrency 4`` on an 8-GPU machine runs four tasks at once;
without a decision each engine starts on GPU 0 and all but one die of out of memory.
Pools cap how many run, not which device each one gets; ``map_index % n`` drifts as soon
as one task retries; and free memory is a race (an engine allocates seconds after it
starts). So devices are *leased*: one lock file per physical device, taken with a
non-blocking ``flock``, before the engine starts.

* **Which devices.** The ones this worker may use: ``AIRFLOW_VLLM_BATCH_GPUS`` when set
  (a comma-separated list, e.g. ``0,1,2,3``; empty for none, which is also how tests and
  CPU machines say what they have), else the worker's own ``CUDA_VISIBLE_DEVICES``, else
  every GPU ``nvidia-smi -L`` lists, else none (a CPU worker).
* **Who holds one.** An ``flock`` belongs to the open file, and the kernel drops it when the
  last descriptor of that file is closed: at release, or when the holding processes die,
  SIGKILL included. No stale lock survives a crash, and nothing needs cleaning up. The
  operator hands the descriptors to the engine's guard (``pass_fds``), so a device stays
  leased until the engine is really gone, even when the task process dies first.
* **All or nothing.** A task that needs N devices takes N free ones at once or none (it
  lets go of a partial set), so two tasks that each need two of three devices can never
  deadlock holding one each. It retries every second and says so in its log every minute.

The lock directory is ``AIRFLOW_VLLM_BATCH_GPU_LOCK_DIR``, default
``<tmp>/airflow-vllm-batch-gpus``: every worker process that shares the machine's GPUs must
see the same directory (a host path mounted into each worker container). The lock files
are named after the device ids as the workers list them, so workers of one machine must
name them the same way (indices, or UUIDs).

Nothing here imports Airflow.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from airflow_vllm_batch.exceptions import ConfigurationError

#: The devices this worker may use, overriding ``CUDA_VISIBLE_DEVICES`` and the driver.
GPUS_ENV = "AIRFLOW_VLLM_BATCH_GPUS"
#: Where the lock files live; shared by every worker process on the machine.
LOCK_DIR_ENV = "AIRFLOW_VLLM_BATCH_GPU_LOCK_DIR"
DEFAULT_LOCK_DIR = os.path.join(tempfile.gettempdir(), "airflow-vllm-batch-gpus")
#: Seconds between attempts while every device is taken, and between "waiting" log lines.
POLL_S = 1.0
LOG_EVERY_S = 60.0

#: vLLM's parallelism options (long, short, and the underscore spelling its parser also accepts).
_PARALLEL_FLAGS = {
    "tensor_parallel_size": ("--tensor-parallel-size", "--tensor_parallel_size", "-tp"),
    "pipeline_parallel_size": ("--pipeline-parallel-size", "--pipeline_parallel_size", "-pp"),
    "data_parallel_size": ("--data-parallel-size", "--data_parallel_size", "-dp"),
    "data_parallel_size_local": ("--data-parallel-size-local", "--data_parallel_size_local", "-dpl"),
}
_NVIDIA_SMI_GPU = re.compile(r"^GPU (\d+):")
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


# -- which devices ----------------------------------------------------------------------


def parse_device_list(value: str) -> list[str]:
    """Parse a ``CUDA_VISIBLE_DEVICES``-style list: ``"0,1"``, ``"GPU-8f..,GPU-1c.."``; ``""`` is none.

    Like CUDA, an invalid entry (``-1``, empty) ends the list.
    """
    devices = []
    for raw in value.split(","):
        item = raw.strip()
        if not item or item.startswith("-"):
            break
        devices.append(item)
    return devices


def driver_devices(timeout_s: float = 10.0) -> list[str]:
    """The GPU indices ``nvidia-smi -L`` lists; none when there is no driver (a CPU machine)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [m.group(1) for line in out.stdout.splitlines() if (m := _NVIDIA_SMI_GPU.match(line.strip()))]


def worker_devices(environ: Mapping[str, str] | None = None) -> tuple[list[str], str]:
    """The devices this worker may use, and where that list came from (for the log).

    :param environ: the environment to read. Default: this process's.
    """
    env = os.environ if environ is None else environ
    if GPUS_ENV in env:
        return parse_device_list(env[GPUS_ENV]), GPUS_ENV
    if "CUDA_VISIBLE_DEVICES" in env:
        return parse_device_list(env["CUDA_VISIBLE_DEVICES"]), "CUDA_VISIBLE_DEVICES"
    return driver_devices(), "nvidia-smi -L"


# -- how many ---------------------------------------------------------------------------


def parallel_sizes(engine_args: Sequence[str], *, engine: str = "VLLMRunner") -> dict[str, int]:
    """The parallelism sizes set in an engine's ``args`` (``--x N``, ``--x=N``, ``-tp N``); missing ones are left out.

    :param engine: the options class whose ``args`` these are, as messages name them (``VLLMRunner(args=...)``).
    :raises ConfigurationError: a size is not a positive whole number.
    """
    by_flag = {flag: name for name, flags in _PARALLEL_FLAGS.items() for flag in flags}
    sizes: dict[str, int] = {}
    args = list(engine_args)
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        name = by_flag.get(flag)
        if name is None:
            continue
        raw = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigurationError(
                f"{engine}(args=...): {flag} must be a positive whole number, got {raw!r}."
            )
        sizes[name] = value
    return sizes


def devices_needed(engine_args: Sequence[str], *, engine: str = "VLLMRunner") -> int:
    """How many devices the engine's parallelism asks for on this node: TP x PP x local DP."""
    sizes = parallel_sizes(engine_args, engine=engine)
    data = sizes.get("data_parallel_size_local", sizes.get("data_parallel_size", 1))
    return sizes.get("tensor_parallel_size", 1) * sizes.get("pipeline_parallel_size", 1) * data


def gpus_to_lease(
    gpus: int | None,
    engine_args: Sequence[str],
    devices: Sequence[str],
    source: str,
    *,
    engine: str = "VLLMRunner",
) -> int:
    """How many devices to lease for one engine; fail fast when the settings cannot fit.

    :param gpus: the options' ``gpus``. None: as many as the engine's parallelism needs
        (1 without parallelism options) on a worker with GPUs, none on a CPU worker.
    :param engine_args: the engine's arguments (their parallelism sizes must fit the lease).
    :param devices: the devices this worker may use.
    :param source: where ``devices`` came from, for the messages.
    :param engine: the options class whose ``args`` and ``gpus`` these are, as messages name them.
    :raises ConfigurationError: the parallelism needs more devices than ``gpus``, or ``gpus``
        is more than the worker has.
    """
    needed = devices_needed(engine_args, engine=engine)
    if gpus is None:
        if not devices:
            return 0
        gpus = needed
    elif gpus and needed > gpus:
        sizes = ", ".join(f"{k}={v}" for k, v in parallel_sizes(engine_args).items())
        raise ConfigurationError(
            f"{engine}(args=...) ask for {needed} GPUs ({sizes}) but {engine}(gpus={gpus}). Set gpus={needed} "
            "(or leave it unset), or lower the parallel sizes in args."
        )
    if gpus > len(devices):
        have = f"{len(devices)} ({','.join(devices)})" if devices else "none"
        raise ConfigurationError(
            f"The engine needs {gpus} GPU(s), but this worker ({os.uname().nodename}) may use {have}, "
            f"from {source}. Send the task to a worker that has them (queue=...), lower gpus or the parallel "
            f"sizes in {engine}(args=...), or set {GPUS_ENV} on the worker."
        )
    return gpus


# -- leasing ----------------------------------------------------------------------------


@dataclass
class GPULease:
    """Devices held by this process: one locked file descriptor each.

    :param devices: the leased device ids, in the worker's order (``CUDA_VISIBLE_DEVICES``).
    :param fds: the locked descriptors; pass them to the engine's process (``pass_fds``)
        so the lease lasts as long as the engine does.
    """

    devices: list[str]
    fds: list[int] = field(default_factory=list)

    @property
    def cuda_visible_devices(self) -> str:
        """The value of ``CUDA_VISIBLE_DEVICES`` for the engine."""
        return ",".join(self.devices)

    def release(self) -> None:
        """Close this process's descriptors (the lock goes once no engine process holds a copy either)."""
        fds, self.fds = self.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> GPULease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def lock_dir(environ: Mapping[str, str] | None = None) -> str:
    """The lock directory: ``AIRFLOW_VLLM_BATCH_GPU_LOCK_DIR``, or ``<tmp>/airflow-vllm-batch-gpus``."""
    env = os.environ if environ is None else environ
    return env.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR


def lock_path(directory: str, device: str) -> str:
    """The lock file of one device."""
    return os.path.join(directory, f"gpu-{_UNSAFE_NAME.sub('_', device)}.lock")


def try_lock(path: str) -> int | None:
    """Take the lock file at ``path`` without waiting; return its descriptor, or None when another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def holder_of(directory: str, device: str) -> str:
    """Who holds a device, as its holder wrote it in the lock file ("" when unknown)."""
    try:
        with open(lock_path(directory, device)) as f:
            return f.read(500).strip()
    except OSError:
        return ""


def try_lease(
    devices: Sequence[str], count: int, directory: str, holder: Mapping[str, object]
) -> GPULease | None:
    """Lease ``count`` of ``devices`` at once, or none of them: never a partial set.

    :param holder: who asks (task, try, pid), written into each lock file for the others' logs.
    """
    os.makedirs(directory, exist_ok=True)
    lease = GPULease([])
    for device in devices:
        if len(lease.devices) == count:
            break
        fd = try_lock(lock_path(directory, device))
        if fd is not None:
            lease.devices.append(device)
            lease.fds.append(fd)
    if len(lease.devices) < count:
        lease.release()
        return None
    note = json.dumps(
        {**holder, "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    )
    for fd in lease.fds:
        # Only for the waiting tasks' log lines: the lock itself is the flock.
        os.ftruncate(fd, 0)
        os.pwrite(fd, note.encode() + b"\n", 0)
    return lease


def lease_gpus(
    devices: Sequence[str],
    count: int,
    *,
    directory: str | None = None,
    holder: Mapping[str, object] | None = None,
    log: Callable[..., object] | None = None,
    poll_s: float = POLL_S,
    log_every_s: float = LOG_EVERY_S,
) -> GPULease:
    """Wait until ``count`` of ``devices`` are free and lease them.

    Waits as long as it takes: the task's ``execution_timeout`` bounds it, like any other
    step. Logs, every ``log_every_s`` seconds, how long it has waited and who holds what.

    :param devices: the devices this worker may use.
    :param count: how many the engine needs (at least 1, at most ``len(devices)``).
    :param directory: the lock directory. Default: :func:`lock_dir`.
    :param holder: who asks, for the other tasks' log lines.
    :param log: a ``logging``-style call (``log.info``) for the waiting lines.
    """
    directory = directory or lock_dir()
    started = time.monotonic()
    next_log = started
    while True:
        lease = try_lease(devices, count, directory, holder or {})
        if lease is not None:
            return lease
        now = time.monotonic()
        if log is not None and now >= next_log:
            held = "; ".join(f"{d}: {holder_of(directory, d) or 'held'}" for d in devices)
            log(
                "Waiting for %d free GPU(s) of %s for %.0fs (lock files in %s); held now: %s",
                count,
                ",".join(devices),
                now - started,
                directory,
                held,
            )
            next_log = now + log_every_s
        time.sleep(poll_s)


# -- for the operator -------------------------------------------------------------------


@dataclass(frozen=True)
class GPUPlan:
    """How many devices one task's engine leases, from which.

    :param count: how many to lease; 0 means no lease (a CPU worker, ``gpus=0``, a warm server).
    :param devices: the devices the task may use.
    :param source: where that list came from, for the log.
    """

    count: int
    devices: tuple[str, ...] = ()
    source: str = ""


def plan_gpus(
    gpus: int | None,
    engine_args: Sequence[str],
    engine_env: Mapping[str, str] | None,
    *,
    engine: str = "VLLMRunner",
) -> GPUPlan:
    """Decide the lease of one task before anything runs; fail fast when it cannot fit.

    ``CUDA_VISIBLE_DEVICES`` in the engine options' ``env`` narrows the worker's devices to
    those (the lease still keeps other tasks off them).

    :param engine: the options class whose ``gpus``, ``args`` and ``env`` these are, as messages name them.
    :raises ConfigurationError: see :func:`gpus_to_lease`.
    """
    pinned = (engine_env or {}).get("CUDA_VISIBLE_DEVICES")
    if pinned is not None:
        devices, source = parse_device_list(str(pinned)), f"CUDA_VISIBLE_DEVICES in {engine}(env=...)"
    else:
        devices, source = worker_devices()
    return GPUPlan(gpus_to_lease(gpus, engine_args, devices, source, engine=engine), tuple(devices), source)


@contextlib.contextmanager
def engine_gpus(
    plan: GPUPlan,
    env: dict[str, str],
    *,
    holder: Mapping[str, object],
    log: Callable[..., object],
) -> Iterator[tuple[int, ...]]:
    """Lease the plan's devices, point the engine's ``env`` at them, and yield the descriptors to pass it.

    The devices are released when the block ends; the engine's copies of the descriptors
    keep them leased until the engine's last process is gone.
    """
    if not plan.count:
        yield ()
        return
    lease = lease_gpus(plan.devices, plan.count, holder=holder, log=log)
    env["CUDA_VISIBLE_DEVICES"] = lease.cuda_visible_devices
    # Device numbers as nvidia-smi shows them, not CUDA's default "fastest first" order.
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    log(
        "Leased GPU(s) %s of %s (from %s) for the engine",
        lease.cuda_visible_devices,
        ",".join(plan.devices),
        plan.source,
    )
    with lease:
        yield tuple(lease.fds)
    log("Released GPU(s) %s", ",".join(lease.devices))
