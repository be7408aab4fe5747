"""Rules that keep the suite within its budget (docs/contributing.md): checked on the test code itself.

A vLLM engine or an Airflow deployment costs 20-90 s to start on two cores. An integration
test that needs one shares the session's (``warm_vllm``, the module's deployment) unless what
it tests is the start itself, a death, a kill, the task's own engine (the runner is the
task's child process) or flags of its own: then the test, its fixture or its module says why
in a docstring paragraph that starts with ``Fresh processes:``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"

#: Calls that start a vLLM engine (a server, the runner, the task-started server) or an Airflow stack
#: (``demo_command``: ``make demo`` starts an engine, ``make demo-api`` a stack and an engine).
STARTS = re.compile(
    r"\b(VLLMServerProcess|local_executor_deployment|celery_executor_deployment|Deployment|ComposeStack|VLLMRunner"
    r"|VLLMServer|run_batch"
    r"|demo_command)\("
)
REASON = "Fresh processes:"


def _starters(path: Path) -> list[tuple[str, bool]]:
    """(name, has its own reason) of each test or fixture in ``path`` whose source starts an engine or a stack."""
    source = path.read_text(encoding="utf-8")
    found = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        fixture = any("fixture" in ast.unparse(decorator) for decorator in node.decorator_list)
        if not (node.name.startswith("test_") or fixture):
            continue
        if STARTS.search(ast.get_source_segment(source, node) or ""):
            found.append((node.name, REASON in (ast.get_docstring(node) or "")))
    return found


def _unexplained(path: Path) -> list[str]:
    if REASON in (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""):
        return []
    return [name for name, explained in _starters(path) if not explained]


@pytest.mark.parametrize(
    "path", sorted(INTEGRATION.rglob("test_*.py")), ids=lambda p: str(p.relative_to(INTEGRATION))
)
def test_a_test_that_starts_its_own_engine_or_stack_says_why(path):
    unexplained = _unexplained(path)
    assert not unexplained, (
        f"{path.name}: {', '.join(unexplained)} start a vLLM engine or an Airflow stack of their own. Use "
        f"the session's (the warm_vllm fixture, the module's deployment), or say why in a docstring "
        f"paragraph starting {REASON!r} (the function's or the module's)."
    )


def test_the_rule_finds_a_fresh_engine_without_a_reason_and_accepts_one_with_it(tmp_path):
    bare = tmp_path / "test_bare.py"
    bare.write_text(
        "def test_x(tmp_path):\n    run(engine=VLLMRunner(args=[]))\n\n"
        "def test_y(warm_vllm):\n    warm_vllm()\n"
    )
    assert _unexplained(bare) == ["test_x"]
    explained = tmp_path / "test_explained.py"
    explained.write_text(
        'def test_x(tmp_path):\n    """Kills it.\n\n    Fresh processes: the kill ends it."""\n'
        "    run(engine=VLLMRunner(args=[]))\n"
    )
    assert _unexplained(explained) == []
    module = tmp_path / "test_module.py"
    module.write_text('"""M.\n\nFresh processes: the runner is the task\'s child."""\n' + bare.read_text())
    assert _unexplained(module) == []


def test_the_rule_finds_a_fresh_celery_deployment_without_a_reason(tmp_path):
    bare = tmp_path / "test_celery.py"
    bare.write_text(
        "@pytest.fixture\ndef deployment(seaweed):\n"
        "    with celery_executor_deployment(seaweed, m, h, {}, workers={}) as dep:\n        yield dep\n"
    )
    assert _unexplained(bare) == ["deployment"]
