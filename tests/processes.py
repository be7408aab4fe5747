"""Find the processes a test started, by a marker in their environment.

An engine's processes (the operator's guard, vLLM's leader, ``EngineCore``) all inherit
the environment the test gave the engine, so a unique marker there finds every one of
them, whoever their parent is now.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Only the operator's guard has this in its environment (it removes it before starting the engine).
GUARD_ENV = b"AIRFLOW_VLLM_BATCH_GUARDED_ARGV"


def processes_with(marker: str, *, guards: bool = True) -> list[int]:
    """PIDs (not zombies) whose environment holds ``marker``; without the guards when ``guards`` is False."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            if marker.encode() not in environ or (not guards and GUARD_ENV in environ):
                continue
            if (entry / "stat").read_text().split(") ", 1)[1][0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def seconds_to_terminate_under_the_wait_lock(proc: Any, terminate: Callable[[], None]) -> float:
    """Call ``terminate`` while another frame holds ``proc``'s ``Popen`` wait lock; return how long it took.

    Airflow runs ``on_kill`` in its SIGTERM handler on the main thread, which may have been
    inside ``proc.wait()`` holding that (non-re-entrant) lock: a blocking wait there deadlocks.
    Fails the test when ``terminate`` is still blocked after 20 s.
    """
    with proc._waitpid_lock:
        stopper = threading.Thread(target=terminate, daemon=True)
        started = time.monotonic()
        stopper.start()
        stopper.join(timeout=20)
        assert not stopper.is_alive(), "terminate() blocked on Popen's wait lock"
        return time.monotonic() - started
