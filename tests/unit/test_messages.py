"""The package's messages stay short, and the docs sections they link exist.

A message says what happened and what to do, in Airflow's voice; the reasons live in the docs
page it names (``doc_ref("Troubleshooting", "The engine kept dying")``: the page's title and the
section's heading, which a pip user can find, and no path of the clone). The scan reads every string expression
of the package that is not a docstring (a literal, an f-string, a ``+`` of them: the text of a
``raise X(...)``, a log call, a preflight problem or an error line's message), and counts its
literal text with each ``{...}`` placeholder as two characters: a message of 250 such
characters stays readable in a task log once a URI or two are filled in.
"""

from __future__ import annotations

import ast
import email.message
import re
from pathlib import Path

import pytest

from airflow_vllm_batch import docs_links
from airflow_vllm_batch.docs_links import PAGES, anchor, doc_ref

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


def _anchors(page: Path) -> set[str]:
    return {anchor(m) for m in re.findall(r"^#{1,3} (.+)$", page.read_text(), flags=re.MULTILINE)}


def _title(page: Path) -> str:
    return page.read_text().splitlines()[0].removeprefix("# ").strip()


def _doc_refs(source: str) -> list[tuple[int, tuple[object, ...]]]:
    """``(line, arguments)`` of each ``doc_ref(...)`` call of ``source``, each argument's literal value (``...`` if none)."""
    return [
        (node.lineno, tuple(a.value if isinstance(a, ast.Constant) else ... for a in node.args))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "doc_ref"
    ]


REFS = sorted(
    {(_name(path), line, args) for path in MODULES for line, args in _doc_refs(path.read_text())},
    key=str,
)


def test_the_package_links_docs_sections():
    assert REFS, "no message names a docs page"


@pytest.mark.parametrize("title", PAGES)
def test_every_page_a_message_may_name_is_a_docs_page_with_that_title(title):
    page = REPO / "docs" / PAGES[title]
    assert page.is_file()
    assert _title(page) == title


@pytest.mark.parametrize(("module", "line", "args"), REFS, ids=lambda v: str(v))
def test_every_docs_section_a_message_names_is_a_heading_of_its_page(module, line, args):
    assert all(isinstance(a, str) for a in args), f"{module}:{line}: doc_ref takes literals, got {args}"
    page, *section = args
    assert page in PAGES, f"{module}:{line}: {page!r} is not one of {sorted(PAGES)}"
    if section:
        assert anchor(section[0]) in _anchors(REPO / "docs" / PAGES[page]), f"{module}:{line}"


def _repo_paths(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each string of ``source`` (docstrings and comments left out) that names a ``docs/`` file."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and re.search(r"docs/[\w/-]+\.md", node.value)
    ]


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_message_sends_a_pip_user_to_a_path_of_the_clone(path):
    # A pip install has no docs/: a message names the page (doc_ref), not its file in the repository.
    assert _repo_paths(path.read_text()) == []


def test_the_repo_path_scan_sees_a_path_in_a_message_and_not_in_a_docstring():
    source = '"""See docs/protocol.md."""\nraise ValueError(f"{x} (see docs/troubleshooting.md#memory)")\n'
    assert _repo_paths(source) == [(2, " (see docs/troubleshooting.md#memory)")]


def test_the_anchor_is_the_one_myst_makes():
    assert anchor("A shard's files: changed") == "a-shards-files-changed"


def test_a_reference_names_the_page_and_section_and_adds_the_declared_documentation_url(monkeypatch):
    monkeypatch.setattr(docs_links, "documentation_url", lambda: None)
    assert (
        doc_ref("Troubleshooting", "LoRA on a CPU")
        == 'see "LoRA on a CPU" in the docs\' Troubleshooting page'
    )
    assert doc_ref("Troubleshooting") == "see the docs' Troubleshooting page"
    url = "https://example.org/airflow-vllm-batch/tree/main/docs"
    monkeypatch.setattr(docs_links, "documentation_url", lambda: url)
    assert doc_ref("Troubleshooting", "LoRA on a CPU").endswith(f", {url}/troubleshooting.md#lora-on-a-cpu")
    assert doc_ref("The run protocol and its invariants").endswith(f", {url}/protocol.md")
    with pytest.raises(KeyError):
        doc_ref("No such page")


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        (
            ["Homepage, https://example.org", "Documentation, https://example.org/docs/"],
            "https://example.org/docs",
        ),
        (["Homepage, https://example.org"], None),
        ([], None),
    ],
)
def test_the_documentation_url_is_the_project_url_so_labelled(monkeypatch, entries, expected):
    metadata = email.message.Message()
    for entry in entries:
        metadata["Project-URL"] = entry
    monkeypatch.setattr(docs_links.importlib.metadata, "metadata", lambda name: metadata)
    docs_links.documentation_url.cache_clear()
    try:
        assert docs_links.documentation_url() == expected
    finally:
        docs_links.documentation_url.cache_clear()
