"""Every module, file and template filter the README and docs/*.md name exists (issue 28).

A name a user copies from the docs must work: ``airflow_vllm_batch...`` paths are
imported (an attribute is looked up on its module), ``airflow_vllm_batch/...`` files must
be in the package, ``vllm.entrypoints...`` modules must be in the installed vLLM, a
``python -m`` of vLLM's batch runner must name the module the operator runs, and every
``{{ ... | filter }}`` must be a filter a DAG renders with by default. The filters are
also checked in the provider's docstrings, which are the API reference ``make docs`` builds.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

import airflow_vllm_batch
from airflow_vllm_batch.engines.vllm import RUN_BATCH_MODULE

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
#: The provider imported (the floor stage's is the installed wheel's, not the clone's).
PROVIDER = Path(airflow_vllm_batch.__file__).parent
PROVIDER_SOURCES = sorted(PROVIDER.rglob("*.py"))

_DOTTED = r"(?:\.[A-Za-z_][A-Za-z0-9_]*)+"
PROVIDER_NAME = re.compile(rf"\bairflow_vllm_batch{_DOTTED}")
PROVIDER_FILE = re.compile(r"\bairflow_vllm_batch/[A-Za-z0-9_/]*(?:\.py)?")
VLLM_NAME = re.compile(rf"\bvllm\.entrypoints{_DOTTED}")
RUNNER_COMMAND = re.compile(rf"-m\s+(vllm\.entrypoints{_DOTTED}\.run_batch)\b")
TEMPLATE = re.compile(r"\{\{(.*?)\}\}", re.S)
FILTER = re.compile(r"(?<!\|)\|\s*([A-Za-z_][A-Za-z0-9_]*)")


def _where(path: Path, line: int) -> str:
    root = REPO if path.is_relative_to(REPO) else PROVIDER.parent
    return f"{path.relative_to(root)}:{line}"


def _named(pattern: re.Pattern[str], paths: list[Path], group: int = 0) -> dict[str, list[str]]:
    """Each name ``pattern`` finds, with where it is (``file:line``)."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in pattern.finditer(line):
                found.setdefault(match.group(group), []).append(_where(path, number))
    return found


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module of the provider, or an attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def test_every_provider_module_the_docs_name_imports():
    named = _named(PROVIDER_NAME, DOCS)
    assert named, "the docs name no airflow_vllm_batch module: the pattern is wrong"
    assert {name: where for name, where in named.items() if not _resolves(name)} == {}


def test_every_provider_file_the_docs_name_exists():
    named = _named(PROVIDER_FILE, DOCS)
    assert named
    assert {name: where for name, where in named.items() if not (PROVIDER.parent / name).exists()} == {}


def _vllm_module_exists(dotted: str) -> bool:
    """Whether the installed vLLM has module ``dotted``, found on disk: importing vLLM's entrypoints takes seconds."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None
    assert spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations)), *dotted.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@pytest.mark.vllm  # the installed vLLM (0.32) is what the docs describe
def test_every_vllm_module_the_docs_name_is_in_the_installed_vllm():
    named = _named(VLLM_NAME, DOCS)
    assert named
    assert {name: where for name, where in named.items() if not _vllm_module_exists(name)} == {}


def test_every_runner_command_the_docs_show_runs_the_module_the_operator_runs():
    # The old module (vllm.entrypoints.openai.run_batch) still imports in 0.32, as a deprecated shim.
    named = _named(RUNNER_COMMAND, DOCS, group=1)
    assert RUN_BATCH_MODULE in named
    assert {name: where for name, where in named.items() if name != RUN_BATCH_MODULE} == {}


def _filters(paths: list[Path]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in paths:
        text = path.read_text(encoding="utf-8")
        for template in TEMPLATE.finditer(text):
            line = text.count("\n", 0, template.start()) + 1
            for name in FILTER.findall(template.group(1)):
                found.setdefault(name, []).append(_where(path, line))
    return found


def _default_filters() -> set[str]:
    from airflow.sdk import DAG

    return set(DAG("doc_names", schedule=None).get_template_env().filters)


def test_every_template_filter_the_docs_and_the_api_reference_use_is_one_a_dag_has_by_default():
    used = _filters([*PROVIDER_SOURCES, *DOCS])
    known = _default_filters()
    assert {name: where for name, where in used.items() if name not in known} == {}
