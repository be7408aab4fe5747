"""Results check: does the engine's output answer the input, and how did it go?

:func:`check_results` streams the results once and compares their custom_ids with
the input's, held in a compact :class:`~airflow_vllm_batch.batchfile.index.CustomIdIndex`:
preflight's (``input_index=report.custom_ids``, so the input is not read again),
or one built here from ``input_lines``. It reports:

* answers: every input custom_id answered exactly once, nothing extra (missing,
  extra and repeated custom_ids are named, the first 50 of each, and counted). With
  ``duplicates="first"`` a repeated answer is not a mismatch: one answer of a custom_id
  is kept, the best (:func:`_left_out`: a success over a failure, whatever their order;
  among equals the first), and the others are left out of the counts and both files
  (results assembled from the checkpoints of several tries may answer a request twice);
* outcomes: ``request_counts`` (total / completed / failed), per HTTP status, per
  kind of response (chat.completion, embedding, score, rerank);
* ``usage``: prompt, completion and total tokens summed over the results;
* ``engine_failure``: vLLM 0.32 exits 0 even when its engine core died; every
  request it had left then comes back as a 500 whose error is the message of vLLM's
  dead-engine error type, ``vllm.v1.engine.exceptions.EngineDeadError``
  (:data:`ENGINE_DEAD_MESSAGE`, compared whole: a model's answer or another error that
  merely mentions "EngineCore" is not one). This flag catches it.

A result line has **failed** when its ``error`` is not null or its
``response.status_code`` is not 200, and **succeeded** otherwise. The two go to
two files, as in OpenAI's Batch API (see the contract in
:mod:`airflow_vllm_batch.batchfile`):

* ``results_out`` gets the exact bytes of every successful line. The lines are
  separated by ``\\n`` and end with one only if the results file did (vLLM uploads
  its output without a final newline), so with no failures and no blank lines
  the bytes equal the results file's: a caller may publish it by copying instead.
* ``errors_out`` gets every failed line, newline-terminated, with ``id``,
  ``custom_id`` and ``response`` as the engine wrote them and ``error`` rewritten
  to ``{"code", "message", "line"}`` (:func:`~airflow_vllm_batch.batchfile.models.error_object`):
  the shape of preflight's own error lines.

Both result shapes are read (see :mod:`~airflow_vllm_batch.batchfile.models`).
Blank lines are skipped (and written to neither file). A JSON object with neither
``response`` nor ``error`` is not a result line: it is counted as unreadable.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable, Iterable
from typing import IO

import msgspec

from airflow_vllm_batch.batchfile.index import LINE_TYPECODE, CustomIdIndex, FirstN
from airflow_vllm_batch.batchfile.models import (
    CustomIdOnly,
    ResultLine,
    error_message,
    error_object,
    object_type,
)
from airflow_vllm_batch.batchfile.preflight import custom_ids_at
from airflow_vllm_batch.batchfile.problems import Problem
from airflow_vllm_batch.batchfile.results_report import ResultsReport
from airflow_vllm_batch.batchfile.sources import redact_urls
from airflow_vllm_batch.batchfile.structured import (
    INVALID_OUTPUT,
    OutputSchema,
    answer_misfit,
    invalid_output_error,
)

#: ``str(EngineDeadError())`` in vLLM 0.32 (and 0.33, whose runner exits non-zero instead):
#: the error message of every request a 0.32 runner had left when its engine core died.
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
DEFAULT_MAX_LISTED = 50
DEFAULT_SAMPLE_ERRORS = 5

_UNSET = msgspec.UNSET
_NOT_A_RESULT = (
    'not a result line (it has neither "response" nor "error") — check that this is the engine\'s '
    "output, not the request file"
)

#: A callable that opens a file again, e.g. ``lambda: open_lines(path)``.
Reopen = Callable[[], contextlib.AbstractContextManager[Iterable[bytes]]]


def check_results(
    result_lines: Iterable[bytes],
    input_lines: Iterable[bytes] | None = None,
    errors_out: IO[bytes] | None = None,
    *,
    input_index: CustomIdIndex | None = None,
    results_out: IO[bytes] | None = None,
    reread_input: Reopen | None = None,
    reread_results: Reopen | None = None,
    max_listed: int = DEFAULT_MAX_LISTED,
    max_sample_errors: int = DEFAULT_SAMPLE_ERRORS,
    source: str | None = None,
    input_source: str | None = None,
    duplicates: str = "fail",
    output_schema: OutputSchema | None = None,
) -> ResultsReport:
    """
    Count the outcomes of a results file and, given the input, check it answers every request once.

    :param result_lines: the results file's lines (``bytes``, e.g. from :func:`open_lines`;
        its ``ended_with_newline`` lets ``results_out`` end as the file did).
    :param input_lines: the input file's lines (the file the engine read), or ``None``.
    :param errors_out: binary writable; receives every failed result line, its
        ``error`` rewritten to ``{"code", "message", "line"}`` (see the module docs).
    :param input_index: instead of ``input_lines``: the custom_ids of the file the
        engine read, with their line numbers, e.g. ``PreflightReport.custom_ids``.
        With neither, only statistics are gathered.
    :param results_out: binary writable; receives the exact bytes of every successful
        result line (see the module docs).
    :param reread_input: optional callable opening the input again (e.g.
        ``lambda: open_lines(path)``); used only when requests are missing, to name
        their custom_ids. Without it they are named by input line number.
    :param reread_results: the same for the results file; used only for extra or
        repeated answers.
    :param max_listed: how many missing / extra / repeated ids to name. Default 50.
    :param max_sample_errors: how many error messages to keep. Default 5.
    :param source: printable name of the results file.
    :param input_source: printable name of the input file.
    :param duplicates: ``"fail"`` (default): a custom_id answered twice is a mismatch. ``"first"``:
        keep one answer of it and leave the others out of the counts and both files
        (:attr:`ResultsReport.dropped_duplicates` counts them): a success rather than a
        failure, whatever their order (an answer durably checkpointed by one try is not lost
        to another try's failure of the same request: Durability), else the first. That
        takes a second pass over the results, only when there are repeats; it needs
        ``reread_results``, and ``results_out`` and ``errors_out`` seekable (they are written
        again).
    :param output_schema: the answers' shape (the operator's ``output_type``): a successful
        chat or completion answer whose text does not fit it is a failed line with
        ``error.code`` ``"invalid_output"`` and the ``raw`` text (see
        :mod:`~airflow_vllm_batch.batchfile.structured`); :attr:`ResultsReport.invalid_output` counts them.
    """
    if input_lines is not None and input_index is not None:
        raise ValueError("pass input_lines or input_index, not both")
    if duplicates not in ("fail", "first"):
        raise ValueError(f"duplicates must be 'fail' or 'first', got {duplicates!r}")
    report = ResultsReport(source=source, input_source=input_source)
    if input_lines is not None:
        input_index = _index_input(input_lines, report)
    elif input_index is not None:
        _count_index(input_index, report)
    outputs = _Outputs(results_out, errors_out, input_index, output_schema)
    # Which lines failed, and how, to choose among a custom_id's answers (duplicates="first").
    failures = array(LINE_TYPECODE) if duplicates == "first" and input_index is not None else None
    results_index = _scan_results(
        result_lines,
        input_index is not None,
        report,
        outputs,
        max_listed,
        max_sample_errors,
        failures=failures,
    )
    outputs.finish(getattr(result_lines, "ended_with_newline", None))
    if input_index is None or results_index is None:
        return report
    _match(input_index, results_index, report, reread_input, reread_results, max_listed)
    if duplicates == "first" and report.duplicate_count:
        if reread_results is None:
            raise ValueError("duplicates='first' needs reread_results")
        # Every answer of a repeated custom_id but its best (one not in the input too: that one stays an extra).
        assert failures is not None  # recorded whenever duplicates="first" and the input is known
        later = _left_out(results_index, failures)
        input_figures = (
            report.input_checked,
            report.input_total,
            report.input_duplicate_count,
            report.input_unreadable_count,
        )
        report = ResultsReport(source=source, input_source=input_source)
        (
            report.input_checked,
            report.input_total,
            report.input_duplicate_count,
            report.input_unreadable_count,
        ) = input_figures
        outputs = _Outputs(_rewound(results_out), _rewound(errors_out), input_index, output_schema)
        with reread_results() as again:
            results_index = _scan_results(
                again, True, report, outputs, max_listed, max_sample_errors, leave_out=later
            )
            outputs.finish(getattr(again, "ended_with_newline", None))
        report.dropped_duplicates = len(later)
        assert results_index is not None  # indexed: the input is known (True above)
        _match(input_index, results_index, report, reread_input, reread_results, max_listed)
    return report


def _left_out(results_index: CustomIdIndex, failures: array[int]) -> frozenset[int]:
    """The result lines to leave out: of each custom_id answered more than once, every answer but the best.

    The best is a success, else a final failure (a 4xx, or an answer that does not fit the
    output schema), else any other failure (a 5xx, an ``engine_crash``, a timeout); among
    answers of one kind, the first. So one try's success is published even when another try's
    failure of the same request comes first (simulator seed 10097: a zombie try's part
    answering a request ``engine_crash`` listed before its successor's part answering it 200,
    whose answer the first-wins rule dropped: Durability). Exactly once is untouched: one
    answer per custom_id is kept, and the counts and both files are made from the kept ones.

    :param results_index: the index of the results, with its repeats.
    :param failures: the failed lines, as :func:`_scan_results` records them (a final
        failure's line number, any other's negated).
    """
    groups: dict[int, list[int]] = {}
    for line, first in results_index.repeats():
        groups.setdefault(first, [first]).append(line)
    repeated = {line for lines in groups.values() for line in lines}
    kind = {abs(signed): 1 if signed > 0 else 0 for signed in failures if abs(signed) in repeated}
    later: set[int] = set()
    for lines in groups.values():
        best = max(lines, key=lambda line: (kind.get(line, 2), -line))
        later.update(line for line in lines if line != best)
    return frozenset(later)


def _rewound(out: IO[bytes] | None) -> IO[bytes] | None:
    """``out`` emptied, to be written again."""
    if out is not None:
        out.seek(0)
        out.truncate()
    return out


def _index_input(input_lines: Iterable[bytes], report: ResultsReport) -> CustomIdIndex:
    """Read every input custom_id into an index."""
    decode = msgspec.json.Decoder(CustomIdOnly).decode
    index = CustomIdIndex()
    hashes, lines, mask = index.hashes, index.lines, index.mask
    lineno = blank = unreadable = 0
    for raw in input_lines:
        lineno += 1
        try:
            cid = decode(raw).custom_id
        except (msgspec.DecodeError, UnicodeDecodeError):
            if not raw or raw.isspace():
                blank += 1
                continue
            cid = None
        if cid.__class__ is not str:
            # Preflight refuses such lines; vLLM cannot answer them either.
            unreadable += 1
            continue
        h = hash(cid)
        hashes[h & mask].append(h)
        lines[h & mask].append(lineno)
    report.input_checked = True
    report.input_total = lineno - blank
    report.input_duplicate_count = sum(1 for _ in index.repeats())
    report.input_unreadable_count = unreadable
    return index


def _count_index(index: CustomIdIndex, report: ResultsReport) -> None:
    """Fill the input figures of the report from an index built elsewhere (preflight's)."""
    report.input_checked = True
    report.input_total = len(index)
    report.input_duplicate_count = sum(1 for _ in index.repeats())


class _Outputs:
    """Where the successful and the failed result lines go (see the module docs)."""

    def __init__(
        self,
        results_out: IO[bytes] | None,
        errors_out: IO[bytes] | None,
        input_index: CustomIdIndex | None,
        output_schema: OutputSchema | None = None,
    ) -> None:
        self.results_write = results_out.write if results_out is not None else None
        self.errors_write = errors_out.write if errors_out is not None else None
        self.input_index = input_index
        self.output_schema = output_schema
        self.written = 0

    def misfit(self, raw: bytes) -> tuple[str, str | None] | None:
        """``(message, text)`` when a successful line's answer does not fit the output schema, else None."""
        assert self.output_schema is not None  # asked only when there is one (_scan_results)
        return answer_misfit(raw, self.output_schema)

    def invalid_output(self, raw: bytes, custom_id: str | None, message: str, text: str | None) -> None:
        """Write an answer that does not fit as a failed line: the engine's response kept, its text in ``error.raw``."""
        if self.errors_write is None:
            return
        line = (
            self.input_index.line_of(custom_id)
            if self.input_index is not None and custom_id is not None
            else None
        )
        obj = msgspec.json.decode(raw)
        obj["error"] = invalid_output_error(message, text, line)
        self.errors_write(msgspec.json.encode(obj) + b"\n")

    def success(self, raw: bytes) -> None:
        """Write a successful line as it was; the newline goes *before* all but the first, so the file can end as the input did."""
        assert self.results_write is not None  # called only when there is a results file (_scan_results)
        if self.written:
            self.results_write(b"\n")
        self.results_write(raw)
        self.written += 1

    def failure(self, raw: bytes, custom_id: str | None, status: int | None) -> None:
        """Write a failed line with its ``error`` in the one shape of the error file."""
        assert self.errors_write is not None  # called only when there is an error file (_scan_results)
        line = (
            self.input_index.line_of(custom_id)
            if self.input_index is not None and custom_id is not None
            else None
        )
        obj = msgspec.json.decode(raw)
        obj["error"] = error_object(obj.get("error"), status, line)
        self.errors_write(msgspec.json.encode(obj) + b"\n")

    def finish(self, ended_with_newline: bool | None) -> None:
        """End the results file with a newline when the input ended with one (or when that is unknown)."""
        if self.written and ended_with_newline is not False:
            assert self.results_write is not None  # written: there is a results file
            self.results_write(b"\n")


def _scan_results(
    result_lines: Iterable[bytes],
    build_index: bool,
    report: ResultsReport,
    outputs: _Outputs,
    max_listed: int,
    max_sample_errors: int,
    leave_out: frozenset[int] = frozenset(),
    failures: array[int] | None = None,
) -> CustomIdIndex | None:
    """Count outcomes and usage of every result line but those numbered in ``leave_out``; index their custom_ids when asked.

    ``failures``, when given, gets the line number of every failed line: as it is for a final
    failure (a 4xx, an answer that does not fit the output schema), negated for any other.
    """
    decode = msgspec.json.Decoder(ResultLine).decode
    index = CustomIdIndex() if build_index else None
    if index is not None:
        hashes, index_lines, mask = index.hashes, index.lines, index.mask
    succeeded = outputs.success if outputs.results_write is not None else None
    misfit = outputs.misfit if outputs.output_schema is not None else None
    invalid = 0
    failed_out = outputs.failure if outputs.errors_write is not None else None
    status_counts: dict[str, int] = {}
    object_counts: dict[str, int] = {}
    lineno = completed = failed = blank = left_out = 0
    prompt = completion = tokens = dead = 0
    samples = report.sample_errors

    for raw in result_lines:
        lineno += 1
        if leave_out and lineno in leave_out:
            left_out += 1
            continue
        try:
            result = decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            if not raw or raw.isspace():
                blank += 1
                continue
            report.unparseable_count += 1
            if len(report.unparseable) < max_listed:
                report.unparseable.append(
                    Problem(
                        lineno, None, f"not a result line ({exc}) — the output is corrupt; rerun the batch"
                    )
                )
            continue
        response = result.response
        error = result.error
        if response is _UNSET or error is _UNSET:
            if response is _UNSET and error is _UNSET:
                report.unparseable_count += 1
                if len(report.unparseable) < max_listed:
                    report.unparseable.append(Problem(lineno, result.custom_id, _NOT_A_RESULT))
                continue
            response = None if response is _UNSET else response
            error = None if error is _UNSET else error
        status: int | None = None
        body = None
        if response is not None:
            status = response.status_code
            # The older shape has no status nor request_id: the response is the completion itself.
            body = response if status is None and response.request_id is None else response.body
        wrong = (
            misfit(raw)
            if misfit is not None and error is None and (status is None or status == 200)
            else None
        )
        if wrong is not None:
            # The engine answered, but not in the shape asked for: a failed request, counted apart.
            failed += 1
            invalid += 1
            key = "200"
            outputs.invalid_output(raw, result.custom_id, *wrong)
            if failures is not None:
                failures.append(lineno)
            if len(samples) < max_sample_errors:
                samples.append(f"{result.custom_id}: {INVALID_OUTPUT}: {wrong[0]}")
        elif error is None and (status is None or status == 200):
            completed += 1
            key = "200"
            if succeeded is not None:
                succeeded(raw)
        else:
            failed += 1
            key = str(status) if status is not None else "none"
            if failed_out is not None:
                failed_out(raw, result.custom_id, status)
            if failures is not None:
                failures.append(lineno if status is not None and 400 <= status < 500 else -lineno)
            message = error_message(error) or f"HTTP status {status}"
            if message == ENGINE_DEAD_MESSAGE:
                dead += 1
            if len(samples) < max_sample_errors:
                # Logged by the operator: an engine's message may quote a presigned URL.
                message = redact_urls(message)
                samples.append(f"{result.custom_id}: {message}" if result.custom_id else message)
        status_counts[key] = status_counts.get(key, 0) + 1
        if body is not None:
            usage = body.usage
            if usage is not None:
                prompt += usage.prompt_tokens or 0
                completion += usage.completion_tokens or 0
                tokens += usage.total_tokens or 0
            kind = object_type(body) or "unknown"
        else:
            kind = "error" if key != "200" else "unknown"
        object_counts[kind] = object_counts.get(kind, 0) + 1

        if index is not None:
            cid = result.custom_id
            if cid is None:
                report.extra_count += 1
                if len(report.extra) < max_listed:
                    report.extra.append(Problem(lineno, None, "result line has no custom_id"))
                continue
            h = hash(cid)
            hashes[h & mask].append(h)
            index_lines[h & mask].append(lineno)

    report.total = lineno - blank - left_out - report.unparseable_count
    report.completed = completed
    report.failed = failed
    report.blank_lines = blank
    report.prompt_tokens = prompt
    report.completion_tokens = completion
    report.total_tokens = tokens
    report.status_counts = status_counts
    report.object_counts = object_counts
    report.engine_dead_lines = dead
    report.invalid_output = invalid
    return index


def _match(
    input_index: CustomIdIndex,
    results_index: CustomIdIndex,
    report: ResultsReport,
    reread_input: Reopen | None,
    reread_results: Reopen | None,
    max_listed: int,
) -> None:
    """Compare the two indexes; count and name missing, extra and repeated answers."""
    missing, extra, repeat = FirstN(max_listed), FirstN(max_listed), FirstN(max_listed)
    pick = {"missing": missing, "extra": extra, "repeat": repeat}
    for kind, line, first in input_index.match(results_index):
        pick[kind].add((line, first))
    input_names: dict[int, str | None] = {}
    result_names: dict[int, str | None] = {}
    if missing.count and reread_input is not None:
        with reread_input() as again:
            input_names = custom_ids_at(again, {line for line, _ in missing.items()})
    wanted = {line for line, _ in extra.items()} | {line for line, _ in repeat.items()}
    if wanted and reread_results is not None:
        with reread_results() as again:
            result_names = custom_ids_at(again, wanted)
    report.missing_count = missing.count
    report.missing = [
        Problem(line, input_names.get(line), "has no result — the engine did not answer this request")
        for line, _ in missing.items()
    ]
    report.extra_count += extra.count
    report.extra = sorted(
        report.extra
        + [
            Problem(line, result_names.get(line), "answers a custom_id that is not in the input")
            for line, _ in extra.items()
        ],
        key=lambda p: p.line,
    )[:max_listed]
    report.duplicate_count = repeat.count
    report.duplicates = [
        Problem(line, result_names.get(line), f"answers the same request as result line {first}")
        for line, first in repeat.items()
    ]
