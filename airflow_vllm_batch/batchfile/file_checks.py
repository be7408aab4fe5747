"""File checks: the problems of a whole batch input file, found after the line-by-line pass.

Repeated custom_ids, a file that mixes generation and pooling requests, lines that fail the
file even in ``skip`` mode (a URL another engine serves, a URL whose answers ``output_type``
cannot validate), too many lines, an empty file. A file-level problem fails the file in both
``invalid_lines`` modes.

Repeated custom_ids are found after the pass (see
:mod:`~airflow_vllm_batch.batchfile.index`): with ``reread`` (a callable that
opens the file again) a second pass confirms them exactly and names the repeat
line, its first line and the id; without it they are counted as one file-level
problem. A repeat fails the file in both modes: results are matched by
custom_id, and which of the two requests is meant is ambiguous.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager as ContextManager
from typing import IO

import msgspec

from airflow_vllm_batch.batchfile.index import CustomIdIndex, FirstN, repeated_hashes
from airflow_vllm_batch.batchfile.line_checks import SERVER_ONLY_URLS, PreflightOptions
from airflow_vllm_batch.batchfile.models import LineKey, endpoint_kind
from airflow_vllm_batch.batchfile.preflight_report import PreflightReport, error_line
from airflow_vllm_batch.batchfile.problems import Problem, short_custom_id
from airflow_vllm_batch.batchfile.structured import STRUCTURED_URLS


class FileChecks:
    """
    The checks of the whole file, run by :meth:`finish` once every line has been read.

    The pass of :func:`~airflow_vllm_batch.batchfile.preflight.preflight` derives from it and
    fills these attributes while it reads.
    """

    opts: PreflightOptions
    report: PreflightReport
    errors_out: IO[bytes] | None
    index: CustomIdIndex
    #: Line numbers of the invalid and of the blank lines, for the cleaned copy's numbering.
    invalid_line_numbers: array[int]
    blank_line_numbers: array[int]
    #: Lines for a URL only VLLMServer serves (SERVER_ONLY_URLS), when this engine does not.
    other_engine_lines: int
    #: Lines of a URL whose answer output_type cannot validate (an embedding, a score).
    unstructured_lines: int
    stopped: bool

    def finish(self, reread: Callable[[], ContextManager[Iterable[bytes]]] | None) -> None:
        """Find repeated custom_ids, locate them with a second pass when possible, then file-level problems."""
        opts = self.opts
        report = self.report
        repeated = repeated_hashes(self.index.hashes)
        if repeated:
            if reread is not None:
                self.locate_repeats(repeated, reread)
            else:
                count = sum(n - 1 for n in repeated.values())
                self.count_repeats(count, listed=False)
                if len(report.url_counts) == 1:
                    for url in report.url_counts:
                        report.url_counts[url] -= count
                self.file_problem(
                    f"{count} request(s) repeat an earlier custom_id — give every request a unique custom_id "
                    "(run `airflow-vllm-batch validate` on the file to list them)"
                )
        self.check_one_kind()
        if self.unstructured_lines and opts.invalid_lines == "skip":
            # Each line is listed already; in skip mode they must still fail the file, not be left out.
            self.file_problem(
                f"{self.unstructured_lines} line(s) use a URL whose answers output_type cannot validate (only "
                f"{', '.join(sorted(STRUCTURED_URLS))} answer with text); they are not skipped — run them in a task "
                "without output_type"
            )
        if self.other_engine_lines and opts.invalid_lines == "skip":
            urls = sorted(SERVER_ONLY_URLS)
            advice = next(
                (opts.url_advice[u] for u in urls if u in opts.url_advice),
                "run the file with an engine that serves them",
            )
            self.file_problem(
                f"{self.other_engine_lines} line(s) use {', '.join(urls)}, which {opts.urls_from} does not "
                f"serve; they are not skipped — {advice}"
            )
        if report.needs_rewrite:
            self.renumber_for_cleaned_copy()
        if report.total_lines == 0 and not report.stopped_early:
            self.file_problem("the file has no requests — check that the right file was uploaded")
        elif opts.invalid_lines == "skip" and report.valid_lines <= 0 and report.total_lines:
            self.file_problem("no valid request is left after skipping invalid lines — fix the file")

    def check_one_kind(self) -> None:
        """Fail a file that mixes generation and pooling requests: one engine serves one kind."""
        by_kind: dict[str, list[str]] = {}
        for url, count in sorted(self.report.url_counts.items()):
            kind = endpoint_kind(url)
            if count > 0 and kind is not None:
                by_kind.setdefault(kind, []).append(f"{url} ({count:,})")
        if len(by_kind) > 1:
            self.file_problem(
                f"the file mixes generation requests ({', '.join(by_kind['generate'])}) with pooling requests "
                f"({', '.join(by_kind['pooling'])}); vLLM serves one kind per engine — put each kind in a file "
                "of its own"
            )

    def renumber_for_cleaned_copy(self) -> None:
        """Give the index the cleaned copy's line numbers: it has no blank or invalid lines."""
        skipped = sorted(self.invalid_line_numbers + self.blank_line_numbers)
        if not skipped:
            return
        lines = self.index.lines
        for p, numbers in enumerate(lines):
            lines[p] = array(numbers.typecode, [n - bisect_left(skipped, n) for n in numbers])

    def locate_repeats(
        self, repeated: dict[int, int], reread: Callable[[], ContextManager[Iterable[bytes]]]
    ) -> None:
        """Second pass: name each repeat's line and first line, comparing the custom_id strings exactly."""
        decode = msgspec.json.Decoder(LineKey).decode
        skip = set(self.invalid_line_numbers)
        first_seen: dict[str, int] = {}
        found = FirstN(self.opts.max_problems_listed)
        with reread() as lines:
            for lineno, raw in enumerate(lines, start=1):
                if lineno in skip:
                    continue
                try:
                    key = decode(raw)
                except (msgspec.DecodeError, UnicodeDecodeError):
                    continue
                cid = key.custom_id
                if cid.__class__ is not str or hash(cid) not in repeated:
                    continue
                first = first_seen.setdefault(cid, lineno)
                if first != lineno:
                    found.add((lineno, first, cid))
                    if key.url in self.report.url_counts:
                        self.report.url_counts[key.url] -= 1
        if not found.count:
            return  # only 64-bit collisions between different ids
        self.count_repeats(found.count)
        problems = []
        for line, first, cid in found.items():
            message = f"custom_id repeats the one on line {first} — give every request a unique custom_id"
            problems.append(Problem(line, short_custom_id(cid), message))
            if self.errors_out is not None:
                self.errors_out.write(error_line(line, short_custom_id(cid), message))
        merged = sorted(self.report.problems + problems, key=lambda p: p.line)
        self.report.problems = merged[: self.opts.max_problems_listed]
        if self.opts.invalid_lines == "skip":
            self.file_problem(
                f"{found.count} request(s) repeat an earlier custom_id and are not skipped (results are matched "
                "by custom_id) — make every custom_id unique"
            )

    def count_repeats(self, count: int, listed: bool = True) -> None:
        """Move ``count`` lines from valid to invalid (and count them as problems when they are listed one by one)."""
        self.report.valid_lines -= count
        self.report.invalid_lines += count
        if listed:
            self.report.problem_count += count

    def file_problem(self, message: str, line: int = 0) -> None:
        """Record a problem of the whole file (it fails the file in both modes)."""
        problem = Problem(line, None, message)
        self.report.file_problems.append(problem)
        self.report.problem_count += 1
        if len(self.report.problems) < self.opts.max_problems_listed:
            self.report.problems.append(problem)

    def too_many_lines(self, lineno: int) -> None:
        """Stop at the first request over ``max_lines``."""
        self.stopped = True
        self.report.stopped_early = True
        self.file_problem(
            f"more than {self.opts.max_lines} requests (max_lines); reading stopped at line {lineno} — "
            "split the file into shards of at most max_lines and map over them with .expand()",
            line=lineno,
        )
