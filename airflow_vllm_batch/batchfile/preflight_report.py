"""The preflight report: what preflight found in one input file, and the error line each skipped line gets.

In ``skip`` mode each invalid line is written to ``errors_out`` as a result-like
line (:func:`error_line`; the shape of vLLM's own error lines, so one reader handles both)::

    {"id": null, "custom_id": "request-7" | null,
     "response": {"status_code": 400, "request_id": null, "body": null},
     "error": {"code": "invalid_request", "message": "<what is wrong — how to fix>", "line": 7}}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from airflow_vllm_batch.batchfile.line_checks import FILE_WIDE_ON_LINE_1
from airflow_vllm_batch.batchfile.problems import Problem, format_problem_list
from airflow_vllm_batch.exceptions import PreflightError

if TYPE_CHECKING:
    from airflow_vllm_batch.batchfile.index import CustomIdIndex


@dataclass
class PreflightReport:
    """
    What preflight found in one input file.

    :param source: printable name of the file (no presigned query string).
    :param mode: the ``invalid_lines`` mode it ran with.
    """

    source: str | None = None
    mode: str = "fail"
    total_lines: int = 0
    valid_lines: int = 0
    invalid_lines: int = 0
    blank_lines: int = 0
    rewritten_lines: int = 0
    url_counts: dict[str, int] = field(default_factory=dict)
    models: dict[str, int] = field(default_factory=dict)
    #: Valid lines per ``body.model`` as the engine reads them (after ``rewrite_model``).
    requests_per_model: dict[str, int] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    problem_count: int = 0
    file_problems: list[Problem] = field(default_factory=list)
    stopped_early: bool = False
    #: ``"gzip"`` when the input was decompressed while reading, else ``None``.
    compression: str | None = None
    #: Every valid line's custom_id and its line in the file the engine reads (see the module docs).
    custom_ids: CustomIdIndex | None = field(default=None, repr=False, compare=False)
    #: Requests the answer cache answered, left out of the copy the engine reads (the engine's report only).
    answered_from_cache: int = 0
    #: The input's location may not be given to an engine (an http(s) URL with credentials): it reads the copy.
    location_withheld: bool = False

    @property
    def ok(self) -> bool:
        """True when no problem at all was found."""
        return self.problem_count == 0

    @property
    def needs_rewrite(self) -> bool:
        """True when the engine must read the cleaned copy: lines skipped, rewritten or answered from the cache, a
        compressed input, or one whose location may not be given to an engine (:attr:`location_withheld`)."""
        return (
            self.invalid_lines > 0
            or self.rewritten_lines > 0
            or self.compression is not None
            or self.answered_from_cache > 0
            or self.location_withheld
        )

    @property
    def runnable(self) -> bool:
        """True when the engine can be started: ``ok`` in fail mode; some valid line and no file-level problem in skip mode."""
        if self.mode == "skip":
            return not self.file_problems and self.valid_lines > 0
        return self.ok

    @property
    def model(self) -> str | None:
        """The model most lines name (the only one, in a clean file)."""
        if not self.models:
            return None
        return max(self.models.items(), key=lambda item: item[1])[0]

    def to_dict(self) -> dict[str, Any]:
        """Return the report as a JSON-ready dict."""
        return {
            "source": self.source,
            "ok": self.ok,
            "runnable": self.runnable,
            "mode": self.mode,
            "total_lines": self.total_lines,
            "valid_lines": self.valid_lines,
            "invalid_lines": self.invalid_lines,
            "blank_lines": self.blank_lines,
            "rewritten_lines": self.rewritten_lines,
            "needs_rewrite": self.needs_rewrite,
            "compression": self.compression,
            "url_counts": dict(self.url_counts),
            "models": dict(self.models),
            "requests_per_model": dict(self.requests_per_model),
            "problem_count": self.problem_count,
            "problems": [p.to_dict() for p in self.problems],
            "stopped_early": self.stopped_early,
        }

    def summary(self) -> str:
        """Return the one-line count summary."""
        text = f"{self.total_lines} requests: {self.valid_lines} valid, {self.invalid_lines} invalid"
        if self.rewritten_lines:
            text += f", {self.rewritten_lines} rewritten"
        return text

    def format(self) -> str:
        """Return a multi-line text report for task logs."""
        name = self.source or "batch file"
        head = "OK" if self.ok else f"{self.problem_count} problem(s)"
        out = [f"Preflight of {name}: {head}", f"  {self.summary()}"]
        if self.url_counts:
            out.append("  per url: " + ", ".join(f"{u}={n}" for u, n in sorted(self.url_counts.items())))
        if self.models:
            out.append("  models: " + ", ".join(f"{m}={n}" for m, n in self.models.items()))
        out.extend(format_problem_list(self.problems, self.problem_count))
        return "\n".join(out)

    def raise_for_problems(self, source_name: str | None = None) -> None:
        """
        Raise :class:`PreflightError` unless the file can run as configured (see :attr:`runnable`).

        :param source_name: name used in the message; default the report's ``source``.
        """
        if self.runnable:
            return
        name = source_name or self.source or "batch file"
        lines = [f"{name} failed preflight: {self.summary()}, {self.problem_count} problem(s)."]
        lines.extend(format_problem_list(self.problems, self.problem_count))
        fix = "the lines above" if self.invalid_lines and not self.file_problems else "the file as said above"
        lines.append(
            f"Fix {fix} and upload the file again"
            + (", or run with invalid_lines='skip' to leave them out" if self.skipping_would_run else "")
            + "."
        )
        raise PreflightError("\n".join(lines), report=self)

    @property
    def skipping_would_run(self) -> bool:
        """Whether ``invalid_lines='skip'`` would start the engine on what is left: only bad lines, some good ones.

        Not for a problem of the whole file (empty, too many lines, a BOM or compression on
        line 1: skipping would drop the first request, or everything).
        """
        if self.mode == "skip" or self.file_problems or not self.invalid_lines or self.valid_lines <= 0:
            return False
        return not any(p.line == 1 and p.message.startswith(FILE_WIDE_ON_LINE_1) for p in self.problems)


def error_line(lineno: int, custom_id: str | None, message: str) -> bytes:
    """
    Return the error line written to ``errors_out`` for an invalid input line (newline-terminated).

    :param lineno: the input line number.
    :param custom_id: the line's custom_id, when it could be read.
    :param message: what is wrong and how to fix it.
    """
    return (
        msgspec.json.encode(
            {
                "id": None,
                "custom_id": custom_id,
                "response": {"status_code": 400, "request_id": None, "body": None},
                "error": {"code": "invalid_request", "message": message, "line": lineno},
            }
        )
        + b"\n"
    )
