"""A problem found on one line of a batch file, and how problems are listed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Problem:
    """
    One thing wrong with one line.

    :param line: 1-based line number in the file it refers to; 0 for the whole file.
    :param custom_id: the line's custom_id when it could be read, else ``None``.
    :param message: ``"what is wrong — how to fix it"``.
    """

    line: int
    custom_id: str | None
    message: str

    def __str__(self) -> str:
        where = "file" if self.line == 0 else f"line {self.line}"
        if self.custom_id is not None:
            where += f" (custom_id {self.custom_id!r})"
        return f"{where}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        """Return the problem as a JSON-ready dict."""
        return {"line": self.line, "custom_id": self.custom_id, "message": self.message}


def format_problem_list(problems: list[Problem], total: int, indent: str = "  ") -> list[str]:
    """
    Return one text line per listed problem, then ``... and K more`` when some were not listed.

    :param problems: the problems kept (the first ones by line).
    :param total: how many problems there were in all.
    :param indent: prefix of every line.
    """
    out = [f"{indent}{problem}" for problem in problems]
    if total > len(problems):
        out.append(f"{indent}... and {total - len(problems)} more")
    return out


def short_custom_id(value: object, limit: int = 200) -> str | None:
    """
    Return a custom_id fit for a message: a string, cut to ``limit`` characters.

    :param value: whatever the line had under ``custom_id``.
    :param limit: the longest id shown in full. Default 200.
    """
    if not isinstance(value, str):
        return None
    return value if len(value) <= limit else value[:limit] + "..."
