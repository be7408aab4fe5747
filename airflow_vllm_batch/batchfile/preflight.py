"""Preflight: stream-check a batch input file before any GPU time is spent on it.

vLLM 0.32's ``run-batch`` reads the whole input, and one line it cannot parse
makes it exit with a traceback after the model has loaded; a wrong model name
or URL turns every line into an error result. :func:`preflight` finds those
problems first, in one pass, in bounded memory, at several hundred thousand
lines per second.

Each line is checked as :mod:`~airflow_vllm_batch.batchfile.line_checks` says (its
:class:`~airflow_vllm_batch.batchfile.line_checks.PreflightOptions` say what a valid line is);
the problems of the whole file (repeated custom_ids, mixed kinds, an empty file) are
:mod:`~airflow_vllm_batch.batchfile.file_checks`'s; what is found goes into a
:class:`~airflow_vllm_batch.batchfile.preflight_report.PreflightReport`.

The report's :attr:`~airflow_vllm_batch.batchfile.preflight_report.PreflightReport.custom_ids`
index holds every valid line's custom_id with its line number *in the file the engine reads*:
the cleaned copy's numbering when
:attr:`~airflow_vllm_batch.batchfile.preflight_report.PreflightReport.needs_rewrite`, else the
input's physical line numbers. :func:`~airflow_vllm_batch.batchfile.results.check_results` takes it
(``input_index=``) so that the input is not read again to check the results.

The cleaned copy (``cleaned_out``) holds every valid line, newline-terminated,
with its bytes as read, except lines whose ``body.model`` is rewritten or that
get ``default_body`` fields: those are re-encoded (compact JSON, key order kept,
new keys appended to ``body``).

In ``skip`` mode each invalid line is written to ``errors_out`` as a result-like line
(:func:`~airflow_vllm_batch.batchfile.preflight_report.error_line`).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager as ContextManager
from typing import IO, Any

import msgspec

from airflow_vllm_batch.batchfile.file_checks import FileChecks
from airflow_vllm_batch.batchfile.index import CustomIdIndex
from airflow_vllm_batch.batchfile.line_checks import (
    DEFAULT_MAX_LINE_BYTES,
    RUNNER_URL_ADVICE,
    SERVER_ONLY_URLS,
    PreflightOptions,
    diagnose_line,
    kind_problem,
    structured_problem,
    too_long_message,
)
from airflow_vllm_batch.batchfile.models import CustomIdOnly, RequestLine, body_spec_for, request_struct
from airflow_vllm_batch.batchfile.preflight_report import PreflightReport, error_line
from airflow_vllm_batch.batchfile.problems import Problem, short_custom_id
from airflow_vllm_batch.batchfile.structured import STRUCTURED_URLS

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "RUNNER_URL_ADVICE",
    "PreflightOptions",
    "PreflightReport",
    "custom_ids_at",
    "diagnose_line",
    "error_line",
    "preflight",
]

# ValidationError subclasses DecodeError; msgspec raises UnicodeDecodeError for
# bad UTF-8 inside a string it decodes; KeyError is an unsupported URL.
_DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError, KeyError)
_UNSET = msgspec.UNSET


def preflight(
    lines: Iterable[bytes],
    options: PreflightOptions | None = None,
    cleaned_out: IO[bytes] | None = None,
    errors_out: IO[bytes] | None = None,
    *,
    source: str | None = None,
    reread: Callable[[], ContextManager[Iterable[bytes]]] | None = None,
    withhold_location: bool = False,
) -> PreflightReport:
    """
    Check every line of a batch input file in one streaming pass.

    :param lines: raw lines as ``bytes`` (with or without their ``\\n``), e.g. from :func:`open_lines`.
    :param options: what to check; default :class:`PreflightOptions()`.
    :param cleaned_out: binary writable; receives every valid line (see the module docs).
    :param errors_out: binary writable; in ``skip`` mode receives one error line per invalid line.
    :param source: printable name of the file, for the report.
    :param reread: optional callable opening the same file again, e.g.
        ``lambda: open_lines(path)``; used only when custom_ids repeat, to confirm the
        listed repeats exactly and name their custom_ids (without it, repeats are
        found by 64-bit hash and named by line numbers only).
    :param withhold_location: the engine must read the cleaned copy whatever the lines hold, never the
        input itself (its location carries credentials): the report then says
        :attr:`~airflow_vllm_batch.batchfile.preflight_report.PreflightReport.needs_rewrite`. Needs ``cleaned_out``.
    """
    if withhold_location and cleaned_out is None:
        raise ValueError("withhold_location needs cleaned_out: the engine reads the copy")
    opts = options or PreflightOptions()
    report = PreflightReport(source=source, mode=opts.invalid_lines, location_withheld=withhold_location)
    checker = _Checker(opts, report, errors_out)
    report.custom_ids = checker.index
    checker.run(lines, cleaned_out)
    # Known only now: a Lines from open_lines says so once it is opened.
    report.compression = getattr(lines, "compression", None)
    checker.finish(reread)
    return report


class _Checker(FileChecks):
    """The state of one preflight pass: a fast loop (:meth:`run`) and a slow path for everything unusual."""

    def __init__(self, opts: PreflightOptions, report: PreflightReport, errors_out: IO[bytes] | None) -> None:
        self.opts = opts
        self.report = report
        self.errors_out = errors_out if opts.invalid_lines == "skip" else None
        self.expected_model: str | None = opts.model
        self.first_model_line = 0
        # Names a line may use besides expected_model (served names, LoRA adapters).
        self.accepted = opts.model_names
        self.default_items = list(opts.default_body.items())
        # What a body lacking a field gets: default_body's, and for structured URLs output_type's format.
        self.fill_values = dict(opts.default_body)
        if opts.response_format is not None:
            self.fill_values["response_format"] = opts.response_format
        self.decode_envelope = msgspec.json.Decoder(RequestLine).decode
        # Lenient decoders (any model, any stream) for the slow path; strict ones
        # (only this URL, this model, no stream) once the model is known.
        # URLs the model cannot serve get no decoder: their lines go to diagnose_line.
        self.urls = [
            url
            for url in opts.supported_urls
            if kind_problem(url, opts, None) is None and structured_problem(url, opts) is None
        ]
        self.lenient = {url: self._line_decoder(url, None) for url in self.urls}
        # Built on first use, one per (URL, model name) a valid line uses.
        self.strict: dict[tuple[str, str], tuple[Any, Any, list[tuple[str, str]]]] = {}
        self.index = CustomIdIndex()
        self.invalid_line_numbers = array("q")
        self.blank_line_numbers = array("q")
        self.write: Any = None
        # The loop's current decoder: the strict one of the last valid line's URL and model.
        self.url: str | None = None
        self.seg_model: str | None = None
        self.decode: Any = _to_slow_path
        self.complete: Any = None
        self.default_attrs: list[tuple[str, str]] = []
        self.limit = opts.max_lines if opts.max_lines is not None else sys.maxsize
        self.stopped = False
        self.blank = 0
        self.rewritten = 0
        self.model_changed = 0
        # Valid lines per URL and per model are counted per run of lines decoded with one
        # (URL, model) decoder ("segment"), so the fast path keeps no counters.
        self.url_counts: dict[str, int] = {}
        self.model_counts: dict[str, int] = {}
        self.seg_start = 1
        self.seg_skip = 0
        # Lines for a URL only VLLMServer serves (SERVER_ONLY_URLS), when this engine does not.
        self.other_engine_lines = 0
        # Lines of a URL whose answer output_type cannot validate (an embedding, a score).
        self.unstructured_lines = 0

    def defaults_for(self, url: str) -> list[tuple[str, Any]]:
        """The fields filled into ``url``'s bodies that lack them."""
        if self.opts.response_format is not None and url in STRUCTURED_URLS:
            return [*self.default_items, ("response_format", self.opts.response_format)]
        return self.default_items

    def _line_decoder(self, url: str, model: str | None) -> tuple[Any, Any, list[tuple[str, str]]]:
        """Build a whole-line decoder for ``url`` (strict when ``model`` is given); default_body keys become extra optional body fields."""
        body, complete, _ = body_spec_for(url)
        struct: type[msgspec.Struct] = body
        default_attrs: list[tuple[str, str]] = []
        items = self.defaults_for(url)
        if items:
            extra, rename = [], {}
            for i, (key, _value) in enumerate(items):
                if key in struct.__struct_fields__:
                    default_attrs.append((key, key))
                    continue
                attr = f"_default_{i}"
                extra.append((attr, Any, _UNSET))
                rename[attr] = key
                default_attrs.append((key, attr))
            if extra:
                struct = msgspec.defstruct(
                    f"{struct.__name__}WithDefaults",
                    extra,
                    bases=(struct,),
                    rename=rename,
                    kw_only=True,
                    gc=False,
                )
        line_struct = request_struct(struct, url if model is not None else None, model)  # type: ignore[arg-type]  # a RequestBody with the default_body fields added
        return msgspec.json.Decoder(line_struct).decode, complete, default_attrs

    # -- the hot loop ------------------------------------------------------------
    # A valid line costs one msgspec decode (which checks the URL, the model and
    # stream too) and a handful of bytecodes; each bytecode statement costs about
    # as much as decoding 50 bytes, so everything else goes to slow_line().

    def run(self, lines: Iterable[bytes], cleaned_out: IO[bytes] | None) -> None:
        """Check every line; fill the report (custom_id repeats are found afterwards, by :meth:`finish`)."""
        max_bytes = self.opts.max_line_bytes
        has_defaults = bool(self.fill_values)
        write = self.write = cleaned_out.write if cleaned_out is not None else None
        slow_line = self.slow_line
        hashes, id_lines, mask = self.index.hashes, self.index.lines, self.index.mask
        decode, complete, limit = self.decode, self.complete, self.limit
        lineno = 0

        for lineno, raw in enumerate(lines, 1):  # lineno is read after the loop
            try:
                req = decode(raw)
            except _DECODE_ERRORS:
                req = None
            if (
                req is None
                or lineno > limit
                or len(raw) > max_bytes
                or (complete is not None and not complete(req.body))
            ):
                slow_line(raw, lineno)
                if self.stopped:
                    break
                decode, complete, limit = self.decode, self.complete, self.limit
                continue
            if not raw.isascii():
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    slow_line(raw, lineno)
                    continue
            h = hash(req.custom_id)
            p = h & mask
            hashes[p].append(h)
            id_lines[p].append(lineno)
            # fill_defaults counts the lines it fills (report.rewritten) even when no copy is written.
            line = self.fill_defaults(raw, req.body) if has_defaults else raw
            if write is not None:
                write(line + b"\n")

        self.close_segment(lineno + 1 if not self.stopped else lineno)
        report = self.report
        report.total_lines = lineno - self.blank - (1 if self.stopped else 0)
        report.blank_lines = self.blank
        report.valid_lines = sum(self.url_counts.values())
        report.url_counts = self.url_counts
        report.rewritten_lines = self.rewritten
        report.requests_per_model = {name: n for name, n in self.model_counts.items() if n > 0}
        as_named = dict(report.requests_per_model)
        if self.model_changed and self.expected_model in as_named:
            as_named[self.expected_model] -= self.model_changed
        report.models = {**{name: n for name, n in as_named.items() if n > 0}, **report.models}

    def slow_line(self, raw: bytes, lineno: int) -> None:
        """Handle any line the fast path did not: blank, invalid, another URL, a model to rewrite."""
        if not raw or raw.isspace():
            self.blank += 1
            self.blank_line_numbers.append(lineno)
            self.limit += 1
            self.seg_skip += 1
            return
        if lineno > self.limit:
            self.too_many_lines(lineno)
            return
        if len(raw) > self.opts.max_line_bytes:
            self.invalid(lineno, None, self.too_long_message(len(raw)))
            return
        url = None
        try:
            raw.decode("utf-8")
            url = self.decode_envelope(raw).url
            decode, complete, default_attrs = self.lenient[url]
            req = decode(raw)
        except _DECODE_ERRORS:
            if url in SERVER_ONLY_URLS and url not in self.opts.supported_urls:
                self.other_engine_lines += 1
            elif url in self.opts.supported_urls and structured_problem(url, self.opts) is not None:
                self.unstructured_lines += 1
            self.invalid(lineno, *self.diagnose(raw, lineno))
            return
        body = req.body
        if body.stream or (complete is not None and not complete(body)):
            self.invalid(lineno, *self.diagnose(raw, lineno))
            return
        model = body.model
        change_model = False
        if self.expected_model is None:
            if model is None:
                self.invalid(lineno, *self.diagnose(raw, lineno))
                return
            # The first line that names a model sets the model of the file.
            self.expected_model = model
            self.first_model_line = lineno
        elif model != self.expected_model and model not in self.accepted:
            self.count_model(model)
            if not self.opts.rewrite_model:
                self.invalid(lineno, *self.diagnose(raw, lineno))
                return
            change_model = True
        seg_model = self.expected_model if change_model else model
        if url != self.url or seg_model != self.seg_model:
            self.close_segment(lineno)
            self.url, self.seg_model = url, seg_model
            key = (url, seg_model)
            if key not in self.strict:
                self.strict[key] = self._line_decoder(url, seg_model)
            self.decode, self.complete, self.default_attrs = self.strict[key]
        self.index.add(req.custom_id, lineno)
        missing = [k for k, attr in default_attrs if getattr(body, attr) in (_UNSET, None)]
        if change_model or missing:
            raw = self.rewrite(raw, self.expected_model if change_model else None, missing)
            self.rewritten += 1
            self.model_changed += change_model
        if self.write is not None:
            self.write(raw + b"\n")

    def close_segment(self, end: int) -> None:
        """Count the valid lines of the run of lines before ``end`` that used one URL's decoder."""
        if self.url is not None:
            count = end - self.seg_start - self.seg_skip
            self.url_counts[self.url] = self.url_counts.get(self.url, 0) + count
            if self.seg_model is not None:  # set with the URL: a line that names no model is invalid
                self.model_counts[self.seg_model] = self.model_counts.get(self.seg_model, 0) + count
        self.seg_start = end
        self.seg_skip = 0

    def fill_defaults(self, raw: bytes, body: Any) -> bytes:
        """Return the line with the default_body fields it lacks added (unchanged when it lacks none)."""
        missing = [k for k, attr in self.default_attrs if getattr(body, attr) in (_UNSET, None)]
        if not missing:
            return raw
        self.rewritten += 1
        return self.rewrite(raw, None, missing)

    def count_model(self, model: str | None) -> None:
        """Count a model name seen on a line that does not match the expected one."""
        if model is None:
            return
        models = self.report.models
        if model in models or len(models) < 100:
            models[model] = models.get(model, 0) + 1

    def invalid(self, lineno: int, custom_id: str | None, message: str) -> None:
        """Record an invalid line: count it, list it, and in skip mode write its error line."""
        report = self.report
        report.invalid_lines += 1
        report.problem_count += 1
        self.seg_skip += 1
        self.invalid_line_numbers.append(lineno)
        if len(report.problems) < self.opts.max_problems_listed:
            report.problems.append(Problem(lineno, custom_id, message))
        if self.errors_out is not None:
            self.errors_out.write(error_line(lineno, custom_id, message))

    def too_long_message(self, size: int) -> str:
        """Message for a line over ``max_line_bytes``."""
        return too_long_message(size, self.opts.max_line_bytes)

    def rewrite(self, raw: bytes, model: str | None, missing: list[str]) -> bytes:
        """Return the line with ``body.model`` set and missing default_body fields added."""
        obj = msgspec.json.decode(raw)
        body = obj["body"]
        if model is not None:
            body["model"] = model
        for key in missing:
            body[key] = self.fill_values[key]
        return msgspec.json.encode(obj)

    def diagnose(self, raw: bytes, lineno: int) -> tuple[str | None, str]:
        """Return ``(custom_id, message)`` for the first thing wrong with an invalid line."""
        return diagnose_line(
            raw,
            lineno,
            self.opts,
            expected_model=self.expected_model,
            first_model_line=self.first_model_line,
        )


def _to_slow_path(raw: bytes) -> Any:
    """Decoder in place until the first valid line: sends every line to the slow path."""
    raise KeyError("no decoder yet")


def custom_ids_at(lines: Iterable[bytes], wanted: set[int]) -> dict[int, str | None]:
    """
    Return the custom_ids on the given line numbers, reading no further than the last of them.

    :param lines: the file's lines, from the start.
    :param wanted: 1-based line numbers.
    """
    decode = msgspec.json.Decoder(CustomIdOnly).decode
    found: dict[int, str | None] = {}
    if not wanted:
        return found
    last = max(wanted)
    for lineno, raw in enumerate(lines, start=1):
        if lineno in wanted:
            try:
                found[lineno] = short_custom_id(decode(raw).custom_id)
            except (msgspec.DecodeError, UnicodeDecodeError):
                found[lineno] = None
        if lineno >= last:
            break
    return found
