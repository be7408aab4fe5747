"""The benchmark scripts of docs/benchmarks.md start as the page runs them: from the repository root, no PYTHONPATH.

Only their start is run here (``--help``), and every module they import, at the top or
inside a function, is looked up after their own ``sys.path`` set-up: a real run starts
vLLM engines for minutes. ``client_overhead.py`` and ``answer_cache.py`` run small in their
own tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "benchmarks.md"


def _from_the_root(*args: str) -> subprocess.CompletedProcess[str]:
    """Run this Python with ``args`` from the repository root, without PYTHONPATH (as the page's commands run)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.parametrize("script", ["overhead.py", "scale.py", "chaos.py"])
def test_the_benchmark_starts_from_the_repository_root_as_the_page_runs_it(script):
    # The page's command, as written: `.venv/bin/python benchmarks/<script> ...` without PYTHONPATH.
    assert re.search(
        rf"^\s*\.venv/bin/python benchmarks/{re.escape(script)}\b", PAGE.read_text(encoding="utf-8"), re.M
    )
    done = _from_the_root(f"benchmarks/{script}", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"usage: {script}")


#: Runs the script's top (its sys.path set-up, not main()), then looks up the top-level
#: package of every import in the file, functions included, without importing it.
FIND_IMPORTS = """
import ast, importlib.util, json, runpy, sys
path = sys.argv[1]
runpy.run_path(path, run_name="benchmark_without_main")
tree = ast.parse(open(path, encoding="utf-8").read())
names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
print(json.dumps(sorted({name.split(".")[0] for name in names if importlib.util.find_spec(name.split(".")[0]) is None})))
"""


@pytest.mark.parametrize("script", ["overhead.py", "scale.py", "chaos.py"])
def test_every_module_the_benchmark_imports_is_found_from_the_repository_root(script):
    done = _from_the_root("-c", FIND_IMPORTS, f"benchmarks/{script}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "[]", (
        f"benchmarks/{script} cannot find {done.stdout.splitlines()[-1]}"
    )


def test_the_chaos_campaign_refuses_celery_worker_faults_without_celery():
    # No Celery worker runs on the LocalExecutor: a weight for one would draw faults that do nothing.
    done = _from_the_root("benchmarks/chaos.py", "--fault-weights", "worker_kill=3,task_kill=2")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--fault-weights: worker_kill needs --celery" in done.stderr
