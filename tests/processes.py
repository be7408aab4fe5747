"""Find the processes a test started, by a marker in their environment.

An engine's processes (the operator's guard, vLLM's leader, ``EngineCore``) all inherit
the environment the test gave the engine, so a unique marker there finds every one of
them, whoever their parent is now.
"""

from __future__ import annotations

from pathlib import Path

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
