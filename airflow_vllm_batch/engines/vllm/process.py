"""Engine processes whose life is bound to the task process that started them.

An engine (vLLM's batch runner, or its OpenAI-compatible server) holds a GPU for as long
as it lives. Airflow stops a task with SIGTERM and, a few seconds later, SIGKILL (the
supervisor's escalation), and the kernel's OOM killer sends SIGKILL straight away.
``on_kill`` handles the first; nothing in the task runs after the second. So every
engine is started under a small *guard*:

* the guard leads a session of its own (``start_new_session``), and the engine is its
  child in the same process group, so the whole engine (vLLM's leader, ``EngineCore`` and
  worker children) can be signalled at once;
* the guard asks the kernel (``PR_SET_PDEATHSIG``) for SIGTERM the moment the task process
  dies, however it dies; it then stops its whole group: SIGTERM, and SIGKILL after
  ``grace_s`` seconds. vLLM's own children would not notice the task's death by
  themselves (a death signal reaches only a direct child), which is why a guard sits
  between the task and the engine rather than the engine itself asking for the signal;
* the guard passes the engine's exit status on unchanged (killed by signal N: the guard
  dies of signal N too), so callers see the engine's own outcome.

The guard is a few lines of standard-library Python run with this interpreter, so it also
guards engines started by a runner's custom ``command`` (a container, another environment).
The engine's argv travels in the environment, not on the guard's command line, because a
command line is world-readable (``ps``) and may hold presigned URLs.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
from collections.abc import Mapping, Sequence

#: The environment variables that carry the engine's argv and the guard's settings to it.
#: Not ``VLLM_...``: vLLM warns about every such variable it does not know.
ARGV_ENV = "AIRFLOW_VLLM_BATCH_GUARDED_ARGV"
GRACE_ENV = "AIRFLOW_VLLM_BATCH_GUARD_GRACE"
PARENT_ENV = "AIRFLOW_VLLM_BATCH_GUARD_PARENT"

#: Default seconds between the guard's SIGTERM and SIGKILL: shorter than the ~5 s after
#: which Airflow's supervisor escalates to SIGKILL, so a stop always completes in the task's
#: own time when it can.
DEFAULT_GRACE_S = 4.0

GUARD_SCRIPT = rf"""
import ctypes, ctypes.util, json, os, signal, sys, time
argv = json.loads(os.environ.pop("{ARGV_ENV}"))
grace = float(os.environ.pop("{GRACE_ENV}"))
parent = int(os.environ.pop("{PARENT_ENV}"))
stopping = False

def stop(*_):
    global stopping
    if stopping:
        return
    stopping = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            if os.waitpid(child, os.WNOHANG)[0]:
                break
        except ChildProcessError:
            break
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)

child = os.fork()
if child == 0:
    try:
        os.execvp(argv[0], argv)
    except OSError as err:
        sys.stderr.write("cannot start the engine %r: %s\n" % (argv[0], err))
        os._exit(127)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
if sys.platform.startswith("linux"):
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    stop()
_, status = os.waitpid(child, 0)
code = os.waitstatus_to_exitcode(status)
if code < 0:
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def start_bound_process(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    stdout: int | None = subprocess.PIPE,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start ``argv`` under a guard that stops it, and its children, when this process dies.

    The returned process is the guard, the leader of the engine's process group: signal
    the group with :func:`signal_group` (``pgid == proc.pid``); its exit status is the
    engine's. Standard error is merged into standard output; standard input is closed.

    :param argv: the engine's command, a list (never a shell string).
    :param env: the engine's full environment. Default: this process's.
    :param grace_s: seconds between SIGTERM and SIGKILL when the guard stops the group.
    :param stdout: where the engine's output goes. Default: a pipe, to read line by line.
    :param pass_fds: descriptors the guard and the engine inherit, e.g. the locked files of a
        GPU lease (:mod:`airflow_vllm_batch.gpus`): the lease then lasts until the engine is
        gone, even when this process dies first.
    """
    guard_env = dict(os.environ if env is None else env)
    guard_env.update(
        {ARGV_ENV: json.dumps(list(argv)), GRACE_ENV: str(grace_s), PARENT_ENV: str(os.getpid())}
    )
    return subprocess.Popen(
        [sys.executable, "-I", "-c", GUARD_SCRIPT],
        stdout=stdout,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=guard_env,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
    )


def reap(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait at most ``timeout`` seconds for ``proc`` to exit; return whether it did.

    Never through a blocking ``proc.wait()``: ``on_kill`` runs in Airflow's SIGTERM
    handler on the main thread, which may have been interrupted inside ``proc.wait()``
    holding ``Popen``'s wait lock (not re-entrant): a blocking wait there deadlocks the
    task, and even ``wait(timeout=...)`` only spins until its timeout, as it cannot take the
    lock. A pidfd (Linux 5.3+) becomes readable when the process exits, lock or no lock;
    the exit status is then collected here if the lock is free, else by the interrupted
    wait once the handler returns.
    """
    if proc.poll() is not None:
        return True
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux, or reaped between poll() and here
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return proc.poll() is not None
        return True
    try:
        exited = bool(select.select([pidfd], [], [], timeout)[0])
    finally:
        os.close(pidfd)
    proc.poll()
    return exited


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group; a group that is gone already is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
