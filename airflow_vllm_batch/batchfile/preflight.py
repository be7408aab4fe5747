"""Preflight: stream-check a batch input file before any GPU time is spent on it.

vLLM 0.32's ``run-batch`` reads the whole input, and one line it cannot parse
makes it exit with a traceback after the model has loaded; a wrong model name
or URL turns every line into an error result. :func:`preflight` finds those
problems first, in one pass, in bounded memory, at several hundred thousand
lines per second.

What a line must be (checks in order; the first failure is the line's problem):

1. at most ``max_line_bytes`` bytes; valid UTF-8 without a byte order mark
   (a BOM is rejected rather than stripped: vLLM would crash on it, and the
   fix, saving without BOM, is one click);
2. one JSON object (``\\r\\n`` endings are fine: the ``\\r`` is JSON whitespace);
3. ``custom_id``: a non-empty string, unique in the file;
4. ``method``: ``"POST"``; ``url``: one of ``supported_urls`` (a ``/v1/completions``
   line for an engine without it, vLLM 0.32's batch runner, is told to use
   ``engine=VLLMServer(...)`` and fails the file in both modes: :data:`SERVER_ONLY_URLS`);
5. ``body``: an object that fits its URL (chat: ``messages``, a non-empty list
   of objects with a ``role``; completions: ``prompt``, a non-empty string or a
   non-empty list of strings, of token ids or of lists of token ids, one kind per
   list; embeddings: ``input`` or ``messages``; score:
   ``text_1``/``text_2`` or vLLM's ``queries``/``documents``, ``queries``/``items``,
   ``data_1``/``data_2``; rerank: ``query`` and ``documents``);
6. ``body.stream`` not true; for chat, the OpenAI sampling fields
   (``temperature``, ``top_p``, ``max_tokens``, ``max_completion_tokens``, ``n``,
   ``presence_penalty``, ``frequency_penalty``, ``seed``, ``stop``, ``logprobs``,
   ``top_logprobs``, ``top_k``, ``min_tokens``) of the right type and range
   (:data:`~airflow_vllm_batch.batchfile.models.SAMPLING_FIELDS`); for completions the
   same but ``max_completion_tokens`` and ``top_logprobs``, with ``logprobs`` an integer
   and ``echo`` a boolean (:data:`~airflow_vllm_batch.batchfile.models.COMPLETION_SAMPLING_FIELDS`);
7. ``body.model``: a string, the same on every line (and equal to ``model``
   when given, unless ``rewrite_model``); with ``model_names`` (the names the engine
   serves: ``--served-model-name`` values, LoRA adapters), any of those names, so one
   file may mix the base model and its adapters;
8. the URL fits the kind of model (``model_kind``): a generation model serves
   chat and completions, a pooling model (``--runner pooling``) embeddings, score and rerank.
   Without ``model_kind``, a file that mixes the two kinds fails as a whole:
   vLLM serves one kind per engine;
9. with ``response_format`` (the operator's ``output_type``), the URL answers with text
   (:data:`~airflow_vllm_batch.batchfile.structured.STRUCTURED_URLS`); in both modes
   another URL fails the file. Chat and completions bodies without a ``response_format``
   get this one in the cleaned copy.

Blank (whitespace-only) lines are skipped and not counted; line numbers are
physical line numbers, as an editor shows them. A gzip file is read decompressed
(see :mod:`~airflow_vllm_batch.batchfile.sources`); vLLM cannot read it, so the
report then says :attr:`PreflightReport.needs_rewrite` and the engine must be given
the cleaned copy.

The report's :attr:`~PreflightReport.custom_ids` index holds every valid line's
custom_id with its line number *in the file the engine reads*: the cleaned copy's
numbering when :attr:`~PreflightReport.needs_rewrite`, else the input's physical
line numbers. :func:`~airflow_vllm_batch.batchfile.results.check_results` takes it
(``input_index=``) so that the input is not read again to check the results.

Repeated custom_ids are found after the pass (see
:mod:`~airflow_vllm_batch.batchfile.index`): with ``reread`` (a callable that
opens the file again) a second pass confirms them exactly and names the repeat
line, its first line and the id; without it they are counted as one file-level
problem. A repeat fails the file in both modes: results are matched by
custom_id, and which of the two requests is meant is ambiguous.

The cleaned copy (``cleaned_out``) holds every valid line, newline-terminated,
with its bytes as read, except lines whose ``body.model`` is rewritten or that
get ``default_body`` fields: those are re-encoded (compact JSON, key order kept,
new keys appended to ``body``).

In ``skip`` mode each invalid line is written to ``errors_out`` as a result-like
line (the shape of vLLM's own error lines, so one reader handles both)::

    {"id": null, "custom_id": "request-7" | null,
     "response": {"status_code": 400, "request_id": null, "body": null},
     "error": {"code": "invalid_request", "message": "<what is wrong — how to fix>", "line": 7}}
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, ContextManager, Literal

import msgspec

from airflow_vllm_batch.batchfile.index import CustomIdIndex, FirstN, repeated_hashes
from airflow_vllm_batch.batchfile.models import (
    COMPLETION_SAMPLING_FIELDS,
    DEFAULT_SUPPORTED_URLS,
    SAMPLING_FIELDS,
    ChatBody,
    CompletionBody,
    CustomIdOnly,
    LineKey,
    RequestLine,
    body_spec_for,
    endpoint_kind,
    request_struct,
    sampling_problem,
)
from airflow_vllm_batch.batchfile.problems import (
    Problem,
    format_problem_list,
    short_custom_id,
)
from airflow_vllm_batch.batchfile.sources import compression_of_head
from airflow_vllm_batch.batchfile.structured import STRUCTURED_URLS
from airflow_vllm_batch.exceptions import PreflightError

#: URLs vLLM's OpenAI-compatible server serves but its 0.32 batch runner does not. A line naming
#: one for an engine without it is a choice of engine, not a bad line: its message names
#: VLLMServer, and it fails the file even with invalid_lines="skip" (skipping every such
#: line would publish a batch with a whole kind of request left out). A runner that serves one
#: (the probe reads the installed runner's routes) accepts it like any other URL.
SERVER_ONLY_URLS: frozenset[str] = frozenset({"/v1/completions"})
#: What vLLM's batch runner tells a line of :data:`SERVER_ONLY_URLS` (its engine's ``url_advice``;
#: also the CLI's, whose default URL list is the runner's).
RUNNER_URL_ADVICE: dict[str, str] = {
    url: f"vLLM's batch runner has no {url}: run this file with engine=VLLMServer(...) (a server the task starts) "
    "or WarmVLLMServer(conn_id=...), which serve it"
    for url in SERVER_ONLY_URLS
}

#: A request line longer than this is refused by default: real chat requests are
#: a few KiB, and a single huge line is more likely a file without newlines.
DEFAULT_MAX_LINE_BYTES = 1_000_000
DEFAULT_MAX_PROBLEMS_LISTED = 50

_BOM = b"\xef\xbb\xbf"
_BOM_MESSAGE = "line starts with a UTF-8 byte order mark (BOM), which vLLM cannot read — save the file as UTF-8 without BOM"
_COMPRESSED_MESSAGE = "the file is "
#: Problems found on line 1 that are the whole file's (how it was saved), not one request's.
_FILE_WIDE_ON_LINE_1 = (_BOM_MESSAGE, _COMPRESSED_MESSAGE)

# ValidationError subclasses DecodeError; msgspec raises UnicodeDecodeError for
# bad UTF-8 inside a string it decodes; KeyError is an unsupported URL.
_DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError, KeyError)
_UNSET = msgspec.UNSET
# Keys that default_body may not fill: they are checked, not defaulted.
_RESERVED_DEFAULT_KEYS = frozenset({"model", "stream"})


@dataclass(frozen=True)
class PreflightOptions:
    """
    What a valid input file is, and what to do with invalid lines.

    :param supported_urls: URLs the engine serves; ask the engine rather than
        hard-coding. Default: chat completions, embeddings, score, rerank.
    :param model: the model every line must name in ``body.model``; ``None`` (default)
        only requires one model across the file.
    :param rewrite_model: when True, ``body.model`` is set to ``model`` in the
        cleaned copy instead of being checked. Needs ``model``. Default False.
    :param default_body: fields added to every body that lacks them, in the
        cleaned copy (e.g. ``{"max_completion_tokens": 512}``). May not hold
        ``model`` or ``stream``. Default empty.
    :param invalid_lines: ``"fail"`` (default): any invalid line fails the file;
        ``"skip"``: invalid lines are left out of the cleaned copy and written to
        ``errors_out``.
    :param max_lines: most requests a file may hold; more is a file-level problem
        and reading stops. Default ``None`` (no limit).
    :param max_line_bytes: longest line accepted, in bytes. Default 1,000,000.
    :param max_problems_listed: problems kept in the report (all are counted). Default 50.
    :param model_kind: what the engine's model serves: ``"generate"`` (chat) or
        ``"pooling"`` (embeddings, score, rerank; vLLM's ``--runner pooling``); lines
        for the other kind are invalid. ``None`` (default): unknown, and a file
        that mixes the two kinds fails as a whole.
    :param model_names: every name the engine answers to (its served names and LoRA
        adapters); each line may use any of them, and a line naming another fails with
        the list. Needs ``model`` (one of them: the name ``rewrite_model`` writes).
        Default empty: every line must name ``model``.
    :param response_format: the operator's ``output_type`` as an OpenAI ``response_format``
        (:meth:`~airflow_vllm_batch.batchfile.structured.OutputSchema.response_format`): added,
        in the cleaned copy, to every chat and completions body without one; a line of any
        other URL is refused (it fails the file in both modes). Default None.
    :param urls_from: what ``supported_urls`` is, as messages name it ("a URL not served by
        <urls_from>"). Default ``"this engine"`` (the operator asks its engine); the CLI,
        which runs none, names the operator's default engine or ``--supported-url``.
    """

    supported_urls: frozenset[str] = DEFAULT_SUPPORTED_URLS
    model: str | None = None
    rewrite_model: bool = False
    default_body: Mapping[str, Any] = field(default_factory=dict)
    invalid_lines: Literal["fail", "skip"] = "fail"
    max_lines: int | None = None
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    max_problems_listed: int = DEFAULT_MAX_PROBLEMS_LISTED
    model_kind: Literal["generate", "pooling"] | None = None
    model_names: frozenset[str] = frozenset()
    response_format: Mapping[str, Any] | None = None
    urls_from: str = "this engine"
    url_advice: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "supported_urls", frozenset(self.supported_urls))
        object.__setattr__(self, "model_names", frozenset(self.model_names or ()))
        if self.model_names and self.model not in self.model_names:
            raise ValueError(f"model_names needs model= to be one of them, got model={self.model!r}")
        object.__setattr__(self, "default_body", dict(self.default_body or {}))
        if self.invalid_lines not in ("fail", "skip"):
            raise ValueError(f"invalid_lines must be 'fail' or 'skip', not {self.invalid_lines!r}")
        if self.rewrite_model and not self.model:
            raise ValueError("rewrite_model=True needs model= (the name to write into every body)")
        reserved = _RESERVED_DEFAULT_KEYS.intersection(self.default_body)
        if reserved:
            raise ValueError(
                f"default_body may not set {sorted(reserved)}: use model= (with rewrite_model=True) "
                "for the model; batch requests never stream"
            )
        if self.max_line_bytes < 1:
            raise ValueError("max_line_bytes must be positive")
        if self.model_kind not in (None, "generate", "pooling"):
            raise ValueError(f"model_kind must be 'generate', 'pooling' or None, not {self.model_kind!r}")
        for key in SAMPLING_FIELDS.keys() & self.default_body.keys():
            problem = sampling_problem({key: self.default_body[key]})
            if problem:
                raise ValueError(f"default_body: {problem}")
        if not self.supported_urls:
            raise ValueError("supported_urls is empty: no request could ever be valid")
        if self.response_format is not None and "response_format" in self.default_body:
            raise ValueError("default_body sets response_format and output_type gives one: drop one of them")


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

    @property
    def ok(self) -> bool:
        """True when no problem at all was found."""
        return self.problem_count == 0

    @property
    def needs_rewrite(self) -> bool:
        """True when the engine must read the cleaned copy: lines skipped, rewritten or answered from the cache, or a compressed input."""
        return (
            self.invalid_lines > 0
            or self.rewritten_lines > 0
            or self.compression is not None
            or self.answered_from_cache > 0
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
        return not any(p.line == 1 and p.message.startswith(_FILE_WIDE_ON_LINE_1) for p in self.problems)


def preflight(
    lines: Iterable[bytes],
    options: PreflightOptions | None = None,
    cleaned_out: IO[bytes] | None = None,
    errors_out: IO[bytes] | None = None,
    *,
    source: str | None = None,
    reread: Callable[[], ContextManager[Iterable[bytes]]] | None = None,
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
    """
    opts = options or PreflightOptions()
    report = PreflightReport(source=source, mode=opts.invalid_lines)
    checker = _Checker(opts, report, errors_out)
    report.custom_ids = checker.index
    checker.run(lines, cleaned_out)
    # Known only now: a Lines from open_lines says so once it is opened.
    report.compression = getattr(lines, "compression", None)
    checker.finish(reread)
    return report


class _Checker:
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
        struct, complete, _ = body_spec_for(url)
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
        line_struct = request_struct(struct, url if model is not None else None, model)
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

        for lineno, raw in enumerate(lines, 1):  # noqa: B007 - lineno is read after the loop
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
            if has_defaults:
                raw = self.fill_defaults(raw, req.body)
            if write is not None:
                write(raw + b"\n")

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
                f"({', '.join(by_kind['pooling'])}); vLLM serves one kind per engine (a generation model, or a "
                "pooling model with --runner pooling) — put each kind in a file of its own"
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
                f"{found.count} request(s) repeat an earlier custom_id; repeats are not skipped, because "
                "results are matched by custom_id and which request is meant is ambiguous — "
                "make every custom_id unique"
            )

    def count_repeats(self, count: int, listed: bool = True) -> None:
        """Move ``count`` lines from valid to invalid (and count them as problems when they are listed one by one)."""
        self.report.valid_lines -= count
        self.report.invalid_lines += count
        if listed:
            self.report.problem_count += count

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

    def too_long_message(self, size: int) -> str:
        """Message for a line over ``max_line_bytes``."""
        limit = self.opts.max_line_bytes
        # A reader given the same limit cuts a longer line to limit + 1 bytes, so
        # that size means "longer than the limit, true size unknown".
        found = f"more than {limit:,} bytes" if size == limit + 1 else f"{size:,} bytes"
        return (
            f"line is {found}, over max_line_bytes={limit:,} — check that every request ends with a newline; "
            "for longer requests raise the limit (max_line_bytes on the operator, or --max-line-bytes in the CLI)"
        )

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


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def diagnose_line(
    raw: bytes,
    lineno: int,
    opts: PreflightOptions,
    *,
    expected_model: str | None = None,
    first_model_line: int = 0,
) -> tuple[str | None, str]:
    """
    Explain what is wrong with one line, in words a user can act on.

    Decodes the line generically (slow, but only invalid lines get here) and
    walks the checks in the order the module docstring lists them.

    :param raw: the line, without its newline.
    :param lineno: its line number.
    :param opts: the preflight options.
    :param expected_model: the model of the file so far, if known.
    :param first_model_line: the line that set ``expected_model`` (0 when it came from options).
    """
    if raw.startswith(_BOM):
        return None, _BOM_MESSAGE
    compression = compression_of_head(raw) if lineno == 1 else None
    if compression is not None:
        return None, (
            f"{_COMPRESSED_MESSAGE}{compression}-compressed but was read without decompressing it — "
            "read it with open_lines(), which decompresses gzip"
            + (", or decompress it first" if compression == "zstd" else "")
        )
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, (
            f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}) — save the file as UTF-8"
        )
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        detail = str(exc).removeprefix("JSON is malformed: ")
        if "truncated" in detail:
            detail = "the line ends before the JSON object does"
            hint = "write each request as one JSON object on a single line"
        else:
            hint = "write each request as one complete JSON object on its own line"
        return None, f"not valid JSON ({detail}) — {hint}"
    if not isinstance(obj, dict):
        return None, f"a JSON {_json_type(obj)}, not an object — each line must be one request object"

    if "custom_id" not in obj:
        return None, 'missing "custom_id" — give every request a unique string custom_id'
    cid = obj["custom_id"]
    if not isinstance(cid, str):
        return None, f'"custom_id" is a {_json_type(cid)}, not a string — use a unique string custom_id'
    shown = short_custom_id(cid)
    if not cid:
        return shown, '"custom_id" is empty — use a unique, non-empty string custom_id'

    method = obj.get("method")
    if method is None:
        return shown, 'missing "method" — add "method": "POST"'
    if method != "POST":
        return (
            shown,
            f'"method" is {msgspec.json.encode(method).decode()}, only "POST" is supported — set "method": "POST"',
        )

    url = obj.get("url")
    supported = ", ".join(sorted(opts.supported_urls))
    if url is None:
        return shown, f'missing "url" — set "url" to one of: {supported}'
    if not isinstance(url, str):
        return shown, f'"url" is a {_json_type(url)}, not a string — set "url" to one of: {supported}'
    if url not in opts.supported_urls:
        if url in opts.url_advice:
            # The engine's own words: which engine serves it (preflight knows no engine).
            return (
                shown,
                f'"url" {url!r} is not served by {opts.urls_from} — {opts.url_advice[url]}; or use one of: {supported}',
            )
        return shown, f'"url" {url!r} is not served by {opts.urls_from} — use one of: {supported}'
    unstructured = structured_problem(url, opts)
    if unstructured:
        return shown, unstructured
    body = obj.get("body")
    named = body.get("model") if isinstance(body, dict) else None
    wrong_kind = kind_problem(url, opts, expected_model or (named if isinstance(named, str) else None))
    if wrong_kind:
        return shown, wrong_kind

    if "body" not in obj:
        return shown, f'missing "body" — add the request body for {url}'
    body = obj["body"]
    if not isinstance(body, dict):
        return (
            shown,
            f'"body" is a {_json_type(body)}, not an object — put the {url} request parameters in an object',
        )

    struct, complete, needs = body_spec_for(url)
    if struct is ChatBody or struct is CompletionBody:
        bad_field = sampling_problem(
            body, SAMPLING_FIELDS if struct is ChatBody else COMPLETION_SAMPLING_FIELDS
        )
        if bad_field:
            return shown, bad_field
    try:
        decoded = msgspec.convert(body, struct)
    except msgspec.ValidationError as exc:
        where = str(exc).replace("`$.", "`body.").replace("`$`", "`body`")
        if " - at `body.model`" in where:
            return (
                shown,
                f'"body.model" is a {_json_type(body.get("model"))}, not a string — set it to the model name',
            )
        if " - at `body.stream`" in where:
            return shown, '"body.stream" must be a boolean — remove it (batch requests never stream)'
        return shown, f"body does not fit {url}: {where} — the body needs {needs}"
    if complete is not None and not complete(decoded):
        return shown, f"body does not fit {url}: it needs {needs}"
    if decoded.stream:
        return (
            shown,
            '"body.stream" is true, but batch requests cannot stream — remove "stream" or set it to false',
        )

    model = decoded.model
    if model is None:
        if opts.model_names:
            return (
                shown,
                f'"body.model" is missing — set it to one of: {_names(opts.model_names, opts.model)}',
            )
        if opts.model:
            return (
                shown,
                f'"body.model" is missing — set it to {opts.model!r} (or run with rewrite_model=True)',
            )
        return shown, '"body.model" is missing — name the model in every request (the same on every line)'
    if (
        expected_model is not None
        and model != expected_model
        and model not in opts.model_names
        and not opts.rewrite_model
    ):
        if opts.model_names:
            return shown, (
                f'"body.model" is {model!r}, which the engine does not serve — use one of: '
                f"{_names(opts.model_names, opts.model)} (the model's served names and its --lora-modules adapters), "
                "or add it to the engine's args"
            )
        if first_model_line:
            return shown, (
                f'"body.model" is {model!r}, but line {first_model_line} uses {expected_model!r} — '
                "a batch file must use one model; split it by model"
            )
        return shown, (
            f'"body.model" is {model!r}, expected {expected_model!r} — '
            "set it to the model the task runs (or run with rewrite_model=True)"
        )
    # The fast path found something this walk does not; say what the decoder said.
    return shown, "the request could not be read — check it against the OpenAI batch format"


def _names(names: frozenset[str], first: str | None) -> str:
    """The names a line may use, quoted, ``first`` (the default) first."""
    ordered = ([first] if first in names else []) + sorted(names - {first})
    return ", ".join(map(repr, ordered))


def structured_problem(url: str, opts: PreflightOptions) -> str | None:
    """Return why a ``url`` line cannot run with ``output_type`` (only text answers fit a schema), or None."""
    if opts.response_format is None or url in STRUCTURED_URLS:
        return None
    return (
        f'"url" {url!r} answers without text, which output_type cannot validate — run these lines in a task '
        f"without output_type, or use {' or '.join(sorted(STRUCTURED_URLS))}"
    )


def kind_problem(url: str, opts: PreflightOptions, model: str | None) -> str | None:
    """
    Return why the engine's model cannot serve ``url`` (see ``model_kind``), or ``None`` when it can or it is unknown.

    :param url: the request's URL.
    :param opts: the preflight options (``model_kind``, ``model``).
    :param model: the model the file names, when known.
    """
    kind = endpoint_kind(url)
    if opts.model_kind is None or kind is None or kind == opts.model_kind:
        return None
    name = f"model {(opts.model or model)!r}" if (opts.model or model) else "the model"
    if opts.model_kind == "generate":
        return (
            f"{name} is a generation model; {url} needs a pooling model (--runner pooling) — "
            "put these requests in a file of their own"
        )
    return (
        f"{name} is a pooling model (--runner pooling); {url} needs a generation model — "
        "put these requests in a file of their own"
    )


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
