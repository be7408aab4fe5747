"""Line checks: what one request line of a batch input file must be, and the words for what is wrong with it.

:class:`PreflightOptions` says what a valid line is; :func:`diagnose_line` explains the first
thing wrong with an invalid one. The streaming pass that applies these checks at speed is
:func:`~airflow_vllm_batch.batchfile.preflight.preflight`.

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
report then says :attr:`~airflow_vllm_batch.batchfile.preflight_report.PreflightReport.needs_rewrite` and the engine must be given
the cleaned copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from airflow_vllm_batch.batchfile.models import (
    COMPLETION_SAMPLING_FIELDS,
    DEFAULT_SUPPORTED_URLS,
    SAMPLING_FIELDS,
    ChatBody,
    CompletionBody,
    body_spec_for,
    endpoint_kind,
    sampling_problem,
)
from airflow_vllm_batch.batchfile.problems import short_custom_id
from airflow_vllm_batch.batchfile.sources import compression_of_head
from airflow_vllm_batch.batchfile.structured import STRUCTURED_URLS

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

BOM = b"\xef\xbb\xbf"
BOM_MESSAGE = "line starts with a UTF-8 byte order mark (BOM), which vLLM cannot read — save the file as UTF-8 without BOM"
COMPRESSED_MESSAGE = "the file is "
#: Problems found on line 1 that are the whole file's (how it was saved), not one request's.
FILE_WIDE_ON_LINE_1 = (BOM_MESSAGE, COMPRESSED_MESSAGE)

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


def too_long_message(size: int, limit: int) -> str:
    """
    Return the message for a line of ``size`` bytes, over ``max_line_bytes``.

    :param size: the line's length as read (``limit + 1`` when the reader cut it there).
    :param limit: ``max_line_bytes``.
    """
    # A reader given the same limit cuts a longer line to limit + 1 bytes, so
    # that size means "longer than the limit, true size unknown".
    found = f"more than {limit:,} bytes" if size == limit + 1 else f"{size:,} bytes"
    return (
        f"line is {found}, over max_line_bytes={limit:,} — check that every request ends with a newline; "
        "for longer requests raise the limit (limits=InputLimits(max_line_bytes=...) on the operator, "
        "or --max-line-bytes in the CLI)"
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
    if raw.startswith(BOM):
        return None, BOM_MESSAGE
    compression = compression_of_head(raw) if lineno == 1 else None
    if compression is not None:
        return None, (
            f"{COMPRESSED_MESSAGE}{compression}-compressed but was read without decompressing it — "
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
