"""The guard that binds an engine's life to the task process (real processes, no engine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from airflow_vllm_batch.engines.vllm.process import reap, start_bound_process
from tests.processes import processes_with

#: Stands in for vLLM: a leader that starts a child (as EngineCore is), both sleeping.
ENGINE = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print('engine up', flush=True); time.sleep(600)"
)


def _found_within(marker: str, count: int, seconds: float) -> int:
    """How many processes hold ``marker``, once ``count`` do or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while len(found := processes_with(marker)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(found)


def _gone_within(marker: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not processes_with(marker):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_the_engine_and_its_children_die_with_the_task_process(tmp_path, how):
    marker = f"GUARD_TEST_{uuid.uuid4().hex}"
    task = textwrap.dedent(
        f"""
        import os, sys, time
        from airflow_vllm_batch.engines.vllm.process import start_bound_process
        proc = start_bound_process([sys.executable, "-c", {ENGINE!r}], env={{**os.environ, "{marker}": "1"}}, grace_s=1)
        print(proc.stdout.readline().decode().strip(), flush=True)
        time.sleep(600)
        """
    )
    # The "task" has no signal handler of its own: SIGTERM kills it as SIGKILL does.
    proc = subprocess.Popen(
        [sys.executable, "-c", task], stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    assert proc.stdout.readline().strip() == b"engine up"
    # guard, engine, engine's child; on a busy machine /proc may show the child a moment later
    # than the engine's line (an environ read while it is being exec'd fails and is skipped).
    assert _found_within(marker, 3, 10) == 3
    proc.send_signal(how)
    proc.wait()
    # The guard stops the group after grace_s (1 s); the wide bound is for a loaded 2-core
    # machine, where the kernel may run the guard's SIGTERM handling seconds late.
    assert _gone_within(marker, 15), f"still running: {processes_with(marker)}"


def test_the_engines_exit_status_is_passed_on():
    assert start_bound_process([sys.executable, "-c", "raise SystemExit(3)"]).wait() == 3
    killed = start_bound_process(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    )
    assert killed.wait() == -signal.SIGKILL


def test_a_command_that_cannot_start_says_so():
    proc = start_bound_process(["/nonexistent/engine"])
    out, _ = proc.communicate()
    assert proc.returncode == 127
    assert b"cannot start the engine '/nonexistent/engine'" in out


def test_the_engines_argv_is_not_on_the_guards_command_line():
    proc = start_bound_process(
        [sys.executable, "-c", "import time; time.sleep(5)", "https://b/k?X-Amz-Signature=s3cr3t"]
    )
    try:
        assert b"s3cr3t" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_reap_sees_the_exit_while_another_frame_holds_popens_wait_lock():
    # on_kill runs in the SIGTERM handler on the main thread, perhaps inside Popen.wait()
    # with its lock held: reap must notice the exit without that lock, and quickly.
    proc = start_bound_process(
        [sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL
    )
    with proc._waitpid_lock:
        os.killpg(proc.pid, signal.SIGKILL)
        started = time.monotonic()
        assert reap(proc, timeout=10)
        assert time.monotonic() - started < 5
    assert reap(proc, timeout=5)
    assert proc.returncode == -signal.SIGKILL


def test_reap_says_so_when_the_process_outlives_the_timeout():
    proc = start_bound_process(
        [sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL
    )
    try:
        assert not reap(proc, timeout=0.3)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
