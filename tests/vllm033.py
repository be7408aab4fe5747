"""vLLM 0.33.0's environment (``.venv-vllm033``, ``make vllm033``), for the tests that read or run it.

vLLM 0.33 is a CUDA wheel of about 7 GB: building its venv takes minutes that wait on the
network and the disk. Under ``make test`` (which sets ``AIRFLOW_VLLM_BATCH_BUILD_VLLM033``) a
session whose selection holds a ``vllm033`` test starts ``make vllm033`` in the background at
collection and runs those tests last, each waiting for the build. Otherwise (a plain
``pytest``) the tests use the venv when it is there and skip saying how to build it.
``AIRFLOW_VLLM_BATCH_VLLM033_PYTHON`` points at another environment's Python.
"""

from __future__ import annotations

import functools
import os
import subprocess
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-vllm033"
STAMP = VENV / ".installed-stamp"
BUILD_ENV = "AIRFLOW_VLLM_BATCH_BUILD_VLLM033"
#: Under pytest-xdist every worker starts the build: the lock lets one build while the others wait
#: for it, and then find the stamp (each worker logs to a file of its own).
BUILD_LOCK = REPO / ".cache" / "vllm033-build.lock"
BUILD_LOG = REPO / ".cache" / f"vllm033-build{os.environ.get('PYTEST_XDIST_WORKER', '')}.log"
BUILD_TIMEOUT_S = 2400
PYTHON = Path(os.environ.get("AIRFLOW_VLLM_BATCH_VLLM033_PYTHON") or VENV / "bin" / "python")


class Vllm033Build:
    """``make vllm033`` in a background thread, once per session."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._returncode: int | None = None

    def _build(self) -> None:
        BUILD_LOG.parent.mkdir(parents=True, exist_ok=True)
        with BUILD_LOG.open("wb") as log:
            done = subprocess.run(
                ["flock", str(BUILD_LOCK), "make", "-s", "vllm033"],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                check=False,
            )
        self._returncode = done.returncode

    def start(self) -> None:
        """Start the build in the background (once), when ``make test`` asked for it and it is not built."""
        if (
            not os.environ.get(BUILD_ENV)
            or STAMP.exists()
            or "AIRFLOW_VLLM_BATCH_VLLM033_PYTHON" in os.environ
        ):
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._build, name="vllm033-venv", daemon=True)
                self._thread.start()

    def python(self) -> Path:
        """vLLM 0.33's Python, waiting for a build this session started; skips when there is none."""
        if self._thread is not None:
            self._thread.join(BUILD_TIMEOUT_S)
            if self._thread.is_alive() or self._returncode != 0:
                tail = BUILD_LOG.read_text(errors="replace")[-3000:] if BUILD_LOG.exists() else ""
                pytest.fail(f"`make vllm033` did not build vLLM 0.33's venv (see {BUILD_LOG}):\n{tail}")
        if not os.access(PYTHON, os.X_OK):
            pytest.skip(
                f"vLLM 0.33's environment is not at {PYTHON}: build it with `make vllm033` "
                "(part of `make test`) or set AIRFLOW_VLLM_BATCH_VLLM033_PYTHON to its Python"
            )
        return PYTHON

    def source(self, module_path: str) -> str:
        """The text of a file of vLLM 0.33's package, e.g. ``entrypoints/launchers/run_batch.py``."""
        return (self._package_dir() / module_path).read_text(encoding="utf-8")

    @functools.cache  # noqa: B019 - one instance per session: the package's place is asked once
    def _package_dir(self) -> Path:
        """Where vLLM 0.33's package is installed (found without importing it: no torch, no device)."""
        python = self.python()
        done = subprocess.run(
            [
                str(python),
                "-c",
                "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('vllm').origin))",
            ],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        )
        return Path(done.stdout.strip())


#: The session's build: started by tests/conftest.py at collection.
VLLM033 = Vllm033Build()
