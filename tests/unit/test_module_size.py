"""No module of the package is over 600 lines unless its docstring says why (issue 35).

The rule: a module of ``airflow_vllm_batch`` has at most :data:`MAX_LINES` lines, or its module
docstring has a paragraph that starts with :data:`MARKER` ("One module because ...") and says
what would be split apart that belongs together. A long module without one is split along its
seams instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

# The installed package, as tests/unit/test_layering.py finds it.
PACKAGE = Path(__import__("airflow_vllm_batch").__file__).parent

MAX_LINES = 600
MARKER = "One module because"


def _unexplained(source: str, name: str) -> str | None:
    """``name`` and its size when ``source`` is over :data:`MAX_LINES` lines with no docstring paragraph saying why."""
    lines = len(source.splitlines())
    if lines <= MAX_LINES:
        return None
    docstring = ast.get_docstring(ast.parse(source)) or ""
    paragraphs = (paragraph.strip() for paragraph in docstring.split("\n\n"))
    if any(paragraph.startswith(MARKER) for paragraph in paragraphs):
        return None
    return f"{name}: {lines} lines, and no docstring paragraph starting {MARKER!r}"


def test_no_module_is_over_600_lines_unless_its_docstring_says_why():
    found = [
        _unexplained(path.read_text(), str(path.relative_to(PACKAGE.parent)))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]
    assert [problem for problem in found if problem] == []


def test_the_size_check_refuses_a_long_module_without_a_reason_and_accepts_one_with_it():
    body = "x = 1\n" * MAX_LINES
    assert _unexplained('"""Short."""\n' + body, "long.py") == (
        "long.py: 601 lines, and no docstring paragraph starting 'One module because'"
    )
    # The marker must open a paragraph of the module's docstring, not sit in a comment or mid-sentence.
    assert _unexplained(f'"""Short; {MARKER} nothing."""\n# {MARKER} x.\n' + body, "long.py") is not None
    assert _unexplained(f'"""Short.\n\n{MARKER} it is one thing.\n"""\n' + body, "long.py") is None
    assert _unexplained('"""Short."""\n' + "x = 1\n" * (MAX_LINES - 1), "short.py") is None
