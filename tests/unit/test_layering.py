"""The package's layers: the batch-file core imports no Airflow and no S3 client, every import follows docs/contributing/architecture.md's layers, and none closes a cycle."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The installed package (on the floor, the wheel; tests/integration/test_floor_wheel.py runs these tests in a clone without it).
PACKAGE = Path(__import__("airflow_vllm_batch").__file__).parent

#: Modules that a CLI or a test must be able to use without Airflow or boto3 installed.
AIRFLOW_FREE = (
    "airflow_vllm_batch.batchfile",
    "airflow_vllm_batch.sharding",
    "airflow_vllm_batch.exceptions",
    "airflow_vllm_batch.manifest",
    "airflow_vllm_batch.docs_links",
)
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
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKING_PRELUDE + code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_batchfile_core_imports_and_reads_answers_with_airflow_and_boto3_blocked(tmp_path):
    results = tmp_path / "results.jsonl"
    line = {
        "id": "v",
        "custom_id": "c",
        "response": {"status_code": 200, "body": {"choices": [{"message": {"content": "hi"}}]}},
        "error": None,
    }
    results.write_text(json.dumps(line) + "\n")
    manifest = {
        "output_uri": str(results),
        "error_uri": None,
        "request_counts": {"total": 1, "completed": 1, "failed": 0},
    }
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
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """Every module ``name`` imports: at the top, inside a function, or under ``if TYPE_CHECKING:``.

    Type-only imports count: a type one layer names from another is a dependency all the same.
    """
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
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
        for module in _imports(name):
            imported = module
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
                return [*path[path.index(target) :], target]
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


#: The storage package's modules, each importing only those before it (docs/contributing/architecture.md): the object names
#: and the S3 primitives know nothing of staging or publishing, and nothing imports the reading of answers.
STORAGE_ORDER = ("layout", "s3", "staging", "publishing", "merged_output", "answers")


def test_each_storage_module_imports_only_the_storage_modules_before_it():
    edges = _package_edges()
    assert sorted(name for name in MODULES if name.startswith("airflow_vllm_batch.storage.")) == sorted(
        f"airflow_vllm_batch.storage.{name}" for name in STORAGE_ORDER
    ), "a storage module is missing from STORAGE_ORDER"
    wrong = []
    for index, name in enumerate(STORAGE_ORDER):
        module = f"airflow_vllm_batch.storage.{name}"
        allowed = {f"airflow_vllm_batch.storage.{before}" for before in STORAGE_ORDER[:index]}
        wrong += [
            f"{module} imports {target}"
            for target in sorted(edges[module])
            if target.startswith("airflow_vllm_batch.storage") and target not in allowed
        ]
    assert wrong == []


def test_a_type_only_import_counts_as_an_import():
    assert "airflow_vllm_batch.engines.base" in _imports("airflow_vllm_batch.run.answer_cache")


CONCEPTS = REPO / "docs" / "contributing" / "architecture.md"


def _layers() -> dict[str, int]:
    """docs/contributing/architecture.md's layer table: each module name (or package prefix, ending in ``.``) and its layer."""
    text = CONCEPTS.read_text()
    section = text[text.index("## Layers: what may import what") :]
    layers: dict[str, int] = {}
    for row in re.findall(r"^\| (\d+) \| ([^|]+) \|", section, flags=re.MULTILINE):
        for path in re.findall(r"`([^`]+)`", row[1]):
            name = "airflow_vllm_batch." + path.removesuffix(".py").removesuffix("/").replace("/", ".")
            layers[name.removesuffix(".__init__") + ("." if path.endswith("/") else "")] = int(row[0])
    return layers


def _layer(name: str, layers: dict[str, int]) -> int | None:
    """The layer of module ``name``: its own row, else the deepest package row it is under."""
    if name in layers:
        return layers[name]
    prefixes = [p for p in layers if p.endswith(".") and (name + ".").startswith(p)]
    return layers[max(prefixes, key=len)] if prefixes else None


def test_the_layer_table_places_every_module_of_the_package():
    layers = _layers()
    assert len(set(layers.values())) >= 5, "docs/contributing/architecture.md's layer table was not found"
    assert [name for name in MODULES if _layer(name, layers) is None] == []


def _against_the_table(edges: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """The imports that go to a layer listed after the importer's."""
    return sorted(
        f"{name} (layer {_layer(name, layers)}) imports {target} (layer {_layer(target, layers)})"
        for name, targets in edges.items()
        for target in targets
        if _layer(target, layers) > _layer(name, layers)
    )


def test_every_import_goes_to_its_own_layer_or_one_listed_before_it_in_docs_concepts_md():
    assert _against_the_table(_package_edges(), _layers()) == []


def test_the_layer_check_refuses_the_engines_naming_the_run_layers_settings():
    # What engines/base.py did, type-only, before the engines named their settings as a protocol.
    edges = {"airflow_vllm_batch.engines.base": {"airflow_vllm_batch.run.settings"}}
    assert _against_the_table(edges, _layers()) == [
        "airflow_vllm_batch.engines.base (layer 5) imports airflow_vllm_batch.run.settings (layer 6)"
    ]


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith(AIRFLOW_FREE)])
def test_an_airflow_free_module_imports_only_the_standard_library_msgspec_and_the_core(name):
    allowed_roots = set(sys.stdlib_module_names) | {"msgspec", "__future__"}
    foreign = sorted(
        imported
        for imported in _imports(name)
        if not (
            imported.partition(".")[0] in allowed_roots
            or imported.startswith(AIRFLOW_FREE)
            or imported == "airflow_vllm_batch"
        )
    )
    assert foreign == []


def _private_names_imported(source: str, name: str) -> list[str]:
    """The ``_private`` names that module ``name`` imports from other modules of the package."""
    package = name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(anchor + ([node.module] if node.module else []))
            if module.startswith("airflow_vllm_batch") and module != name:
                found.extend(
                    f"{name} imports {module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                )
    return found


def test_no_module_imports_a_private_name_of_another():
    assert [
        found for name, path in MODULES.items() for found in _private_names_imported(path.read_text(), name)
    ] == []


def test_the_private_name_check_sees_one_imported_from_another_module():
    source = "from airflow_vllm_batch.engines.server import _decode_custom_id, answered_ids\n"
    assert _private_names_imported(source, "airflow_vllm_batch.engines.runner") == [
        "airflow_vllm_batch.engines.runner imports airflow_vllm_batch.engines.server._decode_custom_id"
    ]


#: Preflight's modules, each importing only the ones before it: the line checks know no report,
#: the report no file check, and only the pass knows them all.
PREFLIGHT_ORDER = [
    "airflow_vllm_batch.batchfile.line_checks",
    "airflow_vllm_batch.batchfile.preflight_report",
    "airflow_vllm_batch.batchfile.file_checks",
    "airflow_vllm_batch.batchfile.preflight",
]


def _against_the_order(edges: dict[str, set[str]], order: list[str]) -> list[str]:
    """The imports among ``order``'s modules that go to one listed after the importer."""
    return sorted(
        f"{name} imports {target}"
        for name in order
        for target in edges.get(name, ())
        if target in order and order.index(target) > order.index(name)
    )


def test_preflights_modules_import_only_the_ones_before_them():
    assert _against_the_order(_package_edges(), PREFLIGHT_ORDER) == []


def test_the_order_check_refuses_the_line_checks_importing_the_report():
    edges = {PREFLIGHT_ORDER[0]: {PREFLIGHT_ORDER[1]}}
    assert _against_the_order(edges, PREFLIGHT_ORDER) == [
        f"{PREFLIGHT_ORDER[0]} imports {PREFLIGHT_ORDER[1]}"
    ]
