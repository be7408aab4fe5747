"""The results check's report: what :func:`~airflow_vllm_batch.batchfile.results.check_results` found, and its text.

The counts, the problems found (each list capped, its count not), the manifest's
``request_counts`` and ``usage``, the task log's text and the error that stops a publish.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from airflow_vllm_batch.batchfile.models import OBJECT_TO_URL
from airflow_vllm_batch.batchfile.problems import Problem, format_problem_list
from airflow_vllm_batch.exceptions import ResultsCheckError


@dataclass
class ResultsReport:
    """
    What the results check found.

    :param source: printable name of the results file.
    :param input_source: printable name of the input file, when one was checked against.
    """

    source: str | None = None
    input_source: str | None = None
    input_checked: bool = False
    input_total: int = 0
    input_duplicate_count: int = 0
    input_unreadable_count: int = 0
    total: int = 0
    completed: int = 0
    failed: int = 0
    blank_lines: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)
    object_counts: dict[str, int] = field(default_factory=dict)
    missing: list[Problem] = field(default_factory=list)
    missing_count: int = 0
    extra: list[Problem] = field(default_factory=list)
    extra_count: int = 0
    duplicates: list[Problem] = field(default_factory=list)
    duplicate_count: int = 0
    unparseable: list[Problem] = field(default_factory=list)
    unparseable_count: int = 0
    engine_dead_lines: int = 0
    sample_errors: list[str] = field(default_factory=list)
    dropped_duplicates: int = 0
    #: Answers the engine gave (HTTP 200) that do not fit ``output_schema``: counted in ``failed``.
    invalid_output: int = 0

    @property
    def request_counts(self) -> dict[str, int]:
        """``{"total", "completed", "failed"}`` as in the XCom manifest."""
        return {"total": self.total, "completed": self.completed, "failed": self.failed}

    @property
    def usage(self) -> dict[str, int]:
        """``{"prompt_tokens", "completion_tokens", "total_tokens"}`` as in the XCom manifest."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }

    @property
    def endpoint_counts(self) -> dict[str, int]:
        """Result counts per endpoint URL, inferred from each response's object type."""
        out: dict[str, int] = {}
        for kind, count in self.object_counts.items():
            key = OBJECT_TO_URL.get(kind, kind)
            out[key] = out.get(key, 0) + count
        return out

    @property
    def engine_failure(self) -> bool:
        """True when any error says vLLM's engine core died.

        vLLM 0.32's runner answers every request it had left with that error and exits 0,
        however many it finished before: a death at 60 % is as much the engine's failure
        as one at the start, not 40 % failed requests.
        """
        return self.engine_dead_lines > 0

    @property
    def answers_ok(self) -> bool:
        """True when every input custom_id is answered exactly once and nothing extra (True without input)."""
        return self.missing_count == 0 and self.extra_count == 0 and self.duplicate_count == 0

    @property
    def ok(self) -> bool:
        """True when every result line could be read and the answers are complete."""
        return self.unparseable_count == 0 and self.answers_ok

    def to_dict(self) -> dict[str, Any]:
        """Return the report as a JSON-ready dict."""
        return {
            "source": self.source,
            "input_source": self.input_source,
            "ok": self.ok,
            "request_counts": self.request_counts,
            "usage": self.usage,
            "status_counts": dict(self.status_counts),
            "object_counts": dict(self.object_counts),
            "endpoint_counts": self.endpoint_counts,
            "engine_failure": self.engine_failure,
            "engine_dead_lines": self.engine_dead_lines,
            "sample_errors": list(self.sample_errors),
            "input_checked": self.input_checked,
            "input_total": self.input_total if self.input_checked else None,
            "missing_count": self.missing_count,
            "missing": [p.to_dict() for p in self.missing],
            "extra_count": self.extra_count,
            "extra": [p.to_dict() for p in self.extra],
            "duplicate_count": self.duplicate_count,
            "duplicates": [p.to_dict() for p in self.duplicates],
            "dropped_duplicates": self.dropped_duplicates,
            "invalid_output": self.invalid_output,
            "unparseable_count": self.unparseable_count,
            "unparseable": [p.to_dict() for p in self.unparseable],
            "blank_lines": self.blank_lines,
        }

    def mismatch_lines(self) -> list[str]:
        """Return the text lines naming what does not match (empty when :attr:`ok`)."""
        out: list[str] = []
        groups = (
            ("input request(s) without a result (input line numbers)", self.missing, self.missing_count),
            (
                "result(s) for a custom_id not in the input (result line numbers)",
                self.extra,
                self.extra_count,
            ),
            ("repeated answer(s) (result line numbers)", self.duplicates, self.duplicate_count),
            ("result line(s) that could not be read", self.unparseable, self.unparseable_count),
        )
        for title, problems, count in groups:
            if count:
                out.append(f"  {count} {title}:")
                out.extend(format_problem_list(problems, count, indent="    "))
        return out

    def format(self) -> str:
        """Return a multi-line text report for task logs."""
        name = self.source or "results"
        head = "OK" if self.ok else "MISMATCH"
        out = [
            f"Results check of {name}: {head}",
            f"  requests: {self.total} total, {self.completed} completed, {self.failed} failed",
            f"  usage: {self.prompt_tokens} prompt + {self.completion_tokens} completion = "
            f"{self.total_tokens} total tokens",
        ]
        if self.input_checked:
            out.append(f"  input: {self.input_total} requests in {self.input_source or 'input'}")
        if self.status_counts:
            out.append(
                "  per status: " + ", ".join(f"{k}={v}" for k, v in sorted(self.status_counts.items()))
            )
        if self.object_counts:
            out.append(
                "  per endpoint: " + ", ".join(f"{k}={v}" for k, v in sorted(self.endpoint_counts.items()))
            )
        if self.invalid_output:
            out.append(
                f"  answers that do not fit output_type (failed, code invalid_output): {self.invalid_output}"
            )
        if self.dropped_duplicates:
            out.append(
                f"  repeated answers of a custom_id answered twice, left out: {self.dropped_duplicates}"
            )
        if self.engine_failure:
            out.append(
                f"  ENGINE FAILURE: vLLM reports its engine core died ({self.engine_dead_lines} lines)"
            )
        out.extend(f"  error: {message}" for message in self.sample_errors)
        out.extend(self.mismatch_lines())
        return "\n".join(out)

    def raise_for_mismatch(self, source_name: str | None = None) -> None:
        """
        Raise :class:`ResultsCheckError` unless the results answer the input exactly (see :attr:`ok`).

        :param source_name: name used in the message; default the report's ``source``.
        """
        if self.ok:
            return
        name = source_name or self.source or "results"
        lines = [f"{name} does not answer its input: {self.total} results for {self.input_total} requests."]
        lines.extend(self.mismatch_lines())
        lines.append(
            "The engine's output is incomplete or corrupt; nothing was published. "
            "Retry the task; if it repeats, check the engine log above."
        )
        raise ResultsCheckError("\n".join(lines))
