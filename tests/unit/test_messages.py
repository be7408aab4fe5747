"""The package's messages stay short, and the docs sections they link exist.

A message says what happened and what to do, in Airflow's voice; the reasons live in the docs
page it links ("see docs/troubleshooting.md#anchor"). The scan reads every string expression
of the package that is not a docstring (a literal, an f-string, a ``+`` of them: the text of a
``raise X(...)``, a log call, a preflight problem or an error line's message), and counts its
literal text with each ``{...}`` placeholder as two characters: a message of 250 such
characters stays readable in a task log once a URI or two are filled in.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(__import__("airflow_vllm_batch").__file__).parent

#: The longest literal text a message may have (each placeholder counted as ``{}``).
LIMIT = 250

#: Strings that are not messages, and why they may be longer.
ALLOWED = {
    # The [vllm_batch] config options' descriptions: the documentation `airflow config list` shows.
    "get_provider_info.py": "config option descriptions",
    # A small Python program the supervisor runs as the engine's parent, not a message.
    "engines/vllm/process.py": "the supervisor's child program",
}


def _text(node: ast.AST) -> str | None:
    """The literal text of a string expression, each placeholder as ``{}``; None if it is no string."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        if left is None and right is None:
            return None
        return (left if left is not None else "{}") + (right if right is not None else "{}")
    return None


def long_strings(source: str, limit: int = LIMIT) -> list[tuple[int, int, str]]:
    """``(line, length, start)`` of each string expression of ``source`` longer than ``limit``, docstrings left out."""
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        text = _text(node)
        if text is None:
            continue
        # The outermost string expression stands for its parts.
        skip.update(id(part) for part in ast.walk(node))
        if len(text) > limit:
            found.append((node.lineno, len(text), text[:80]))
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


@pytest.mark.parametrize("path", [p for p in MODULES if _name(p) not in ALLOWED], ids=_name)
def test_no_message_of_the_package_is_longer_than_the_limit(path):
    assert long_strings(path.read_text()) == []


def test_the_scan_sees_a_long_message_in_a_raise_an_f_string_and_a_concatenation():
    long = "x" * 240
    source = (
        '"""A docstring may be long: ' + "d" * 300 + '"""\n'
        f'raise ValueError(f"{long} {{value}} and more words")\n'
        f'log.warning("{long}" + "{long}")\n'
        f'message = "{long}"\n'
    )
    assert [(line, length) for line, length, _ in long_strings(source)] == [(2, 258), (3, 480)]


def _slug(title: str) -> str:
    """The anchor MyST gives a heading (``myst_heading_anchors``)."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#{1,3} (.+)$", page.read_text(), flags=re.MULTILINE)}


LINKS = sorted(
    {
        (m.group(1), m.group(2))
        for path in MODULES
        for m in re.finditer(r"docs/([\w-]+\.md)#([\w-]+)", path.read_text())
    }
)


def test_the_package_links_docs_sections():
    assert LINKS, "no message links a docs page"


@pytest.mark.parametrize(("page", "anchor"), LINKS)
def test_every_docs_link_in_a_message_names_a_section_that_exists(page, anchor):
    assert anchor in _anchors(REPO / "docs" / page)


def test_the_anchor_is_the_one_myst_makes():
    assert _slug("A shard's files: changed") == "a-shards-files-changed"
