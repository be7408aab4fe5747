"""The package's layers: the batch-file core imports no Airflow and no S3 client, and no module import closes a cycle."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "airflow_vllm_batch"

#: Modules that a CLI or a test must be able to use without Airflow or boto3 installed.
AIRFLOW_FREE = ("airflow_vllm_batch.batchfile", "airflow_vllm_batch.sharding", "airflow_vllm_batch.exceptions")
BLOCKED = ("airflow", "boto3", "botocore")

_BLOCKING_PRELUDE = f"""
import sys

class BlockImports:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ImportError(name + " is blocked in this test")
        return None

sys.meta_path.insert(0, BlockImports())
"""


def _run_blocked(code: str, tmp_path: Path) -> dict:
    """Run ``code`` in a fresh interpreter where importing Airflow, boto3 or botocore fails; return what it prints as JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKING_PRELUDE + code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_batchfile_core_imports_and_reads_answers_with_airflow_and_boto3_blocked(tmp_path):
    results = tmp_path / "results.jsonl"
    line = {"id": "v", "custom_id": "c", "response": {"status_code": 200, "body": {"choices": [{"message": {"content": "hi"}}]}}, "error": None}
    results.write_text(json.dumps(line) + "\n")
    manifest = {"output_uri": str(results), "error_uri": None, "request_counts": {"total": 1, "completed": 1, "failed": 0}}
    seen = _run_blocked(
        f"""
import json
{"; ".join(f"import {m}" for m in AIRFLOW_FREE)}
from airflow_vllm_batch.batchfile import read_answers
from airflow_vllm_batch.exceptions import ConfigurationError

answers = [list(a) for a in read_answers({manifest!r})]
try:
    list(read_answers("s3://bucket/results.jsonl"))
    s3 = "read"
except ConfigurationError as err:
    s3 = str(err)
loaded = sorted({{m.partition(".")[0] for m in sys.modules}} & set({BLOCKED!r}))
print(json.dumps({{"answers": answers, "s3": s3, "loaded": loaded}}))
""",
        tmp_path,
    )
    assert seen["answers"] == [["c", "hi"]]
    assert "airflow_vllm_batch.storage.read_answers" in seen["s3"]
    assert seen["loaded"] == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """Every module ``name`` imports, at the top or inside a function; not under ``if TYPE_CHECKING:``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []  # type-only imports are never executed
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            # "from pkg import module" imports the submodule.
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return found


def _package_edges() -> dict[str, set[str]]:
    edges = {}
    for name in MODULES:
        targets = set()
        for imported in _imports(name):
            while imported and imported not in MODULES:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_of_the_package_imports_its_way_back_to_itself():
    assert _find_cycle(_package_edges()) is None


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _find_cycle(edges) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith(AIRFLOW_FREE)])
def test_an_airflow_free_module_imports_only_the_standard_library_msgspec_and_the_core(name):
    allowed_roots = set(sys.stdlib_module_names) | {"msgspec", "__future__"}
    foreign = sorted(
        imported
        for imported in _imports(name)
        if not (imported.partition(".")[0] in allowed_roots or imported.startswith(AIRFLOW_FREE) or imported == "airflow_vllm_batch")
    )
    assert foreign == []
