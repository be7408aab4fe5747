"""msgspec models of one line of an OpenAI-format batch file, as vLLM 0.32 reads and writes it.

The models are deliberately *narrow*: they name only the fields this package
checks or counts. msgspec skips every other field without building Python
objects for it, which is what makes validating a million lines take seconds.
vLLM's own pydantic models (``vllm.entrypoints.launchers.run_batch``) remain the
authority on everything else in a request body.

Request line (input)::

    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [{"role": "user", "content": "..."}]}}

Result line (output), current shape written by vLLM 0.32::

    {"id": "vllm-...", "custom_id": "request-1",
     "response": {"status_code": 200, "request_id": "vllm-batch-...", "body": {...}},
     "error": null}

and the older shape in vLLM's early documentation, where ``response`` is the
completion itself (``{"id", "object", "choices", "usage", ...}``). ``error`` is
``null``, a string (vLLM's own request errors, e.g. an unsupported URL) or an
object (vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import msgspec

#: The endpoints ``vllm run-batch`` 0.32 serves for text models
#: (``build_endpoint_registry`` in ``vllm/entrypoints/launchers/run_batch.py``): what the
#: operator's default engine (``VLLMRunner``) accepts when its environment cannot be
#: asked, and what the CLI, which runs no engine, checks by default. The one list both use.
#: vLLM also matches any URL *ending* in ``/score`` or ``/rerank`` and serves
#: ``/v1/audio/transcriptions`` and ``/v1/audio/translations``; which of them a
#: given model supports is for the caller to ask the engine.
DEFAULT_SUPPORTED_URLS: frozenset[str] = frozenset(
    {"/v1/chat/completions", "/v1/embeddings", "/v1/score", "/v1/rerank", "/score", "/rerank"}
)

NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]


# -- request lines -------------------------------------------------------------------


# gc=False on every model: decoded lines never form reference cycles, and
# structs the garbage collector does not track decode about 20% faster.


class RequestLine(msgspec.Struct, gc=False):
    """The envelope of one request; ``body`` is kept as raw JSON, to be decoded per ``url``."""

    custom_id: NonEmptyStr
    method: Literal["POST"]
    url: str
    body: msgspec.Raw


class CustomIdOnly(msgspec.Struct, gc=False):
    """Just the ``custom_id`` of a request line, for matching results to requests."""

    custom_id: Any = None


class CustomId(msgspec.Struct, gc=False):
    """The ``custom_id`` of a line that has one: a checked request line, or a result line the package wrote."""

    custom_id: str


#: Decodes a line to its :class:`CustomId`; raises on a line without a string ``custom_id``.
decode_custom_id = msgspec.json.Decoder(CustomId).decode


class ChatMessage(msgspec.Struct, gc=False):
    """One chat message; only its ``role`` is checked."""

    role: str


class RequestBody(msgspec.Struct, gc=False):
    """Fields every body may carry and preflight checks."""

    model: str | None = None
    stream: bool | None = None


#: The OpenAI sampling fields of a chat body that preflight checks: name -> (type, what
#: is allowed, in words). The types and ranges are the OpenAI API's, narrowed where
#: vLLM 0.32 is stricter (``top_p`` > 0, ``top_k`` and ``min_tokens`` are vLLM's own;
#: ``SamplingParams._verify_args`` and ``ChatCompletionRequest``). Every field but
#: ``min_tokens`` may be null, which vLLM reads as "not set".
_INT64 = msgspec.Meta(ge=-(2**63), le=2**63 - 1)
SAMPLING_FIELDS: dict[str, tuple[Any, str]] = {
    "temperature": (Annotated[float, msgspec.Meta(ge=0, le=2)], "a number from 0 to 2"),
    "top_p": (Annotated[float, msgspec.Meta(gt=0, le=1)], "a number greater than 0 and at most 1"),
    "max_tokens": (Annotated[int, msgspec.Meta(ge=1)], "an integer >= 1"),
    "max_completion_tokens": (Annotated[int, msgspec.Meta(ge=1)], "an integer >= 1"),
    "n": (Annotated[int, msgspec.Meta(ge=1)], "an integer >= 1"),
    "presence_penalty": (Annotated[float, msgspec.Meta(ge=-2, le=2)], "a number from -2 to 2"),
    "frequency_penalty": (Annotated[float, msgspec.Meta(ge=-2, le=2)], "a number from -2 to 2"),
    "seed": (Annotated[int, _INT64], "a 64-bit integer"),
    "stop": (str | list[str], "a string or a list of strings"),
    "logprobs": (bool, "true or false"),
    "top_logprobs": (Annotated[int, msgspec.Meta(ge=0, le=20)], "an integer from 0 to 20"),
    "top_k": (Annotated[int, msgspec.Meta(ge=-1)], "an integer: 0 or -1 (no limit), or at least 1"),
    "min_tokens": (Annotated[int, msgspec.Meta(ge=0)], "an integer >= 0"),
}
#: Sampling fields vLLM does not accept as null.
NOT_NULLABLE = frozenset({"min_tokens"})

#: The sampling fields of a ``/v1/completions`` body (vLLM 0.32's ``CompletionRequest``): the
#: chat ones but ``max_completion_tokens`` and ``top_logprobs``, which completions do not have,
#: and with ``logprobs`` a count of alternatives per token (OpenAI allows 0 to 5; vLLM more)
#: rather than a switch; ``echo`` repeats the prompt in the answer.
COMPLETION_SAMPLING_FIELDS: dict[str, tuple[Any, str]] = {
    **{
        k: v
        for k, v in SAMPLING_FIELDS.items()
        if k not in ("max_completion_tokens", "top_logprobs", "logprobs")
    },
    "logprobs": (
        Annotated[int, msgspec.Meta(ge=0)],
        "an integer >= 0 (log probabilities of that many alternatives per token)",
    ),
    "echo": (bool, "true or false"),
}


def _sampling_field_type(name: str, fields: dict[str, tuple[Any, str]] = SAMPLING_FIELDS) -> Any:
    """Return the msgspec type of a sampling field as a request may give it (null for all but NOT_NULLABLE)."""
    kind = fields[name][0]
    return kind if name in NOT_NULLABLE else kind | None


if TYPE_CHECKING:
    # msgspec.defstruct makes these two at runtime (below); the type checker sees what they hold.
    class ChatBody(RequestBody, kw_only=True):
        messages: list[ChatMessage]

    class CompletionBody(RequestBody, kw_only=True):
        prompt: str | list[str | int | list[int]]


# Built from SAMPLING_FIELDS so that the checks and their messages cannot drift
# apart; msgspec checks the types and ranges while decoding (the fast path). An
# absent field is UNSET: a third cheaper to decode than a None default (measured).
if not TYPE_CHECKING:
    ChatBody = msgspec.defstruct(
        "ChatBody",
        [("messages", Annotated[list[ChatMessage], msgspec.Meta(min_length=1)])]
        + [(name, _sampling_field_type(name) | msgspec.UnsetType, msgspec.UNSET) for name in SAMPLING_FIELDS],
        bases=(RequestBody,),
        kw_only=True,
        gc=False,
        module=__name__,
    )
ChatBody.__doc__ = (
    """Body of ``/v1/chat/completions``: ``messages`` and the sampling fields of :data:`SAMPLING_FIELDS`."""
)


def sampling_problem(
    body: dict[str, Any], fields: dict[str, tuple[Any, str]] = SAMPLING_FIELDS
) -> str | None:
    """
    Return what is wrong with the first bad sampling field of a generation body, or ``None``.

    :param body: the decoded ``body`` object of a chat or completion request.
    :param fields: the sampling fields of its URL: :data:`SAMPLING_FIELDS` (chat, the default)
        or :data:`COMPLETION_SAMPLING_FIELDS`.
    """
    for name in fields:
        if name not in body:
            continue
        value = body[name]
        try:
            msgspec.convert(value, _sampling_field_type(name, fields))
        except msgspec.ValidationError:
            found = msgspec.json.encode(value).decode("utf-8", "replace")
            if len(found) > 60:
                found = found[:60] + "..."
            return f'"body.{name}" is {found}, but it must be {fields[name][1]} — fix the value or remove the field'
    return None


#: A completion prompt as vLLM 0.32 takes it: a text, or a non-empty list of texts, of token
#: ids, or of lists of token ids (several prompts in one request). msgspec allows one list type
#: in a union, so the list's items are a union and :func:`completion_body_complete` checks
#: that they are all of one kind.
_TokenId = Annotated[int, msgspec.Meta(ge=0)]
CompletionPrompt = (
    Annotated[str, msgspec.Meta(min_length=1)]
    | Annotated[
        list[str | _TokenId | Annotated[list[_TokenId], msgspec.Meta(min_length=1)]],
        msgspec.Meta(min_length=1),
    ]
)

if not TYPE_CHECKING:
    CompletionBody = msgspec.defstruct(
        "CompletionBody",
        [("prompt", CompletionPrompt)]
        + [
            (name, _sampling_field_type(name, COMPLETION_SAMPLING_FIELDS) | msgspec.UnsetType, msgspec.UNSET)
            for name in COMPLETION_SAMPLING_FIELDS
        ],
        bases=(RequestBody,),
        kw_only=True,
        gc=False,
        module=__name__,
    )
CompletionBody.__doc__ = """Body of ``/v1/completions``: ``prompt`` and the sampling fields of :data:`COMPLETION_SAMPLING_FIELDS`."""


class EmbeddingsBody(RequestBody):
    """Body of ``/v1/embeddings``: ``input`` (text or tokens), or chat-style ``messages``."""

    input: str | list[Any] | msgspec.UnsetType = msgspec.UNSET
    messages: list[Any] | msgspec.UnsetType = msgspec.UNSET


class ScoreBody(RequestBody):
    """Body of ``/v1/score``: one of vLLM 0.32's four pairs of fields."""

    text_1: Any = msgspec.UNSET
    text_2: Any = msgspec.UNSET
    queries: Any = msgspec.UNSET
    documents: Any = msgspec.UNSET
    items: Any = msgspec.UNSET
    data_1: Any = msgspec.UNSET
    data_2: Any = msgspec.UNSET


class RerankBody(RequestBody):
    """Body of ``/v1/rerank``."""

    query: Any = msgspec.UNSET
    documents: Any = msgspec.UNSET


#: The pairs of fields vLLM 0.32's ``ScoreRequest`` union accepts, in its order.
SCORE_FIELD_PAIRS: tuple[tuple[str, str], ...] = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)


def chat_body_complete(body: ChatBody) -> bool:
    """Return True: the struct itself requires a non-empty ``messages``."""
    return True


def completion_body_complete(body: CompletionBody) -> bool:
    """Return whether a list ``prompt`` holds one kind of item: texts, token ids, or lists of token ids."""
    prompt = body.prompt
    if prompt.__class__ is str:
        return True
    kind = prompt[0].__class__
    return all(item.__class__ is kind for item in prompt)


def embeddings_body_complete(body: EmbeddingsBody) -> bool:
    """Return whether the body has ``input`` or ``messages``."""
    return body.input is not msgspec.UNSET or body.messages is not msgspec.UNSET


def score_body_complete(body: ScoreBody) -> bool:
    """Return whether the body has one complete pair of score fields."""
    unset = msgspec.UNSET
    return any(
        getattr(body, first) is not unset and getattr(body, second) is not unset
        for first, second in SCORE_FIELD_PAIRS
    )


def rerank_body_complete(body: RerankBody) -> bool:
    """Return whether the body has ``query`` and ``documents``."""
    return body.query is not msgspec.UNSET and body.documents is not msgspec.UNSET


#: url -> (body struct, completeness check, human description of what the body needs).
BODY_SPECS: dict[str, tuple[type[RequestBody], Any, str]] = {
    "/v1/chat/completions": (
        ChatBody,
        None,
        '"messages": a non-empty list of objects, each with a "role"',
    ),
    "/v1/completions": (
        CompletionBody,
        completion_body_complete,
        '"prompt": a non-empty string, or a non-empty list of strings, of token ids (integers >= 0) '
        "or of lists of token ids (one kind per list)",
    ),
    "/v1/embeddings": (
        EmbeddingsBody,
        embeddings_body_complete,
        '"input" (a string or a list) or "messages"',
    ),
    "/v1/score": (
        ScoreBody,
        score_body_complete,
        '"text_1" and "text_2" (or "queries" and "documents", "queries" and "items", "data_1" and "data_2")',
    ),
    "/v1/rerank": (
        RerankBody,
        rerank_body_complete,
        '"query" and "documents"',
    ),
}


class LineKey(msgspec.Struct, gc=False):
    """The ``custom_id`` and ``url`` of a request line, for locating repeats in a second pass."""

    custom_id: Any = None
    url: Any = None


def request_struct(
    body: type[RequestBody], url: str | None = None, model: str | None = None
) -> type[msgspec.Struct]:
    """
    Return a request-line model whose ``body`` is decoded as ``body``.

    Decoding a whole line with it is one pass, about twice as fast as the
    envelope (:class:`RequestLine`) followed by the body. With ``url`` and
    ``model``, the model is *strict*: it only accepts that URL, that
    ``body.model`` and a ``body.stream`` that is not true, so that a valid
    line needs no check in Python (msgspec fails fast on anything else).

    :param body: the body model for the line's URL.
    :param url: the only URL accepted, or ``None`` for any string.
    :param model: the only ``body.model`` accepted, or ``None`` for any (or none).
    """
    if model is not None:
        # A subclass of ``body`` (its base), which defstruct's return type cannot say.
        body = cast(
            "type[RequestBody]",
            msgspec.defstruct(
                f"{body.__name__}Strict",
                [("model", Literal[model]), ("stream", Literal[False] | None, None)],
                bases=(body,),
                kw_only=True,
                gc=False,
            ),
        )
    return msgspec.defstruct(
        f"{body.__name__}Request",
        [
            ("custom_id", NonEmptyStr),
            ("method", Literal["POST"]),
            ("url", str if url is None else Literal[url]),
            ("body", body),
        ],
        gc=False,
    )


#: Endpoints served by a generation model; everything vLLM routes to its pooling
#: handlers (embeddings, any URL ending in /score or /rerank) needs a pooling model.
GENERATE_URLS: frozenset[str] = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/audio/transcriptions", "/v1/audio/translations"}
)


def endpoint_kind(url: str) -> Literal["generate", "pooling"] | None:
    """
    Return the kind of model that serves ``url``: ``"generate"``, ``"pooling"``, or ``None`` when unknown.

    :param url: a request line's ``url``.
    """
    if url in GENERATE_URLS:
        return "generate"
    if url == "/v1/embeddings" or url.endswith(("/score", "/rerank")):
        return "pooling"
    return None


def body_spec_for(url: str) -> tuple[type[RequestBody], Any, str]:
    """
    Return the body model for a URL, following vLLM's matching rules.

    vLLM routes any URL ending in ``/score`` or ``/rerank`` to the scoring
    handlers; an unknown URL gets the most lenient model (only model/stream).

    :param url: the request line's ``url``.
    """
    spec = BODY_SPECS.get(url)
    if spec is not None:
        return spec
    if url.endswith("/score"):
        return BODY_SPECS["/v1/score"]
    if url.endswith("/rerank"):
        return BODY_SPECS["/v1/rerank"]
    return (RequestBody, None, "an object")


# -- result lines --------------------------------------------------------------------


class Usage(msgspec.Struct, gc=False):
    """Token usage of one response; vLLM may leave a count out or null."""

    prompt_tokens: int | None = 0
    completion_tokens: int | None = 0
    total_tokens: int | None = 0


class DataItem(msgspec.Struct, gc=False):
    """One element of a list response (an embedding, a score); only its type is read."""

    object: str | None = None


class ResponseBody(msgspec.Struct, gc=False):
    """The fields of a response body that are counted."""

    object: str | None = None
    usage: Usage | None = None
    data: list[DataItem] | None = None
    # Raw cannot sit in a union with None; an empty Raw means "absent".
    results: msgspec.Raw = msgspec.Raw()


class ResultResponse(msgspec.Struct, gc=False):
    """``response`` of a result line, in either shape.

    Current shape: ``status_code``, ``request_id``, ``body``. Older shape: the
    completion itself, so ``object`` and ``usage`` sit at this level.
    """

    status_code: int | None = None
    request_id: str | None = None
    body: ResponseBody | None = None
    object: str | None = None
    usage: Usage | None = None
    data: list[DataItem] | None = None
    # Raw cannot sit in a union with None; an empty Raw means "absent".
    results: msgspec.Raw = msgspec.Raw()


class ResultLine(msgspec.Struct, gc=False):
    """One line of vLLM's batch output (or of preflight's errors file, where custom_id may be null).

    ``response`` and ``error`` are UNSET when the key is absent: a line with neither
    is not a result line (a request line, or some other JSON object).
    """

    custom_id: str | None = None
    id: str | None = None
    response: ResultResponse | msgspec.UnsetType | None = msgspec.UNSET
    error: Any = msgspec.UNSET


def object_type(body: ResponseBody | ResultResponse | None) -> str | None:
    """
    Return a short name for the kind of response: ``chat.completion``, ``embedding``, ``score``, ``rerank``...

    A list response (``"object": "list"``) is named after its first element.

    :param body: the decoded response body (or the old-shape response).
    """
    if body is None:
        return None
    kind = body.object
    if kind == "list" and body.data:
        kind = body.data[0].object or kind
    elif kind is None and len(body.results):
        kind = "rerank"
    return kind


def line_kind(raw: bytes) -> Literal["blank", "text", "json", "object", "request", "result"]:
    """
    Return what one line looks like, to tell a request file from a results file.

    ``"result"``: an object with ``response`` or ``error``; ``"request"``: one with
    ``url``, ``method`` or ``body``; ``"object"``: another JSON object; ``"json"``:
    JSON but not an object; ``"text"``: not JSON; ``"blank"``: whitespace only.

    :param raw: one line, without its newline.
    """
    if not raw.strip():
        return "blank"
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return "text"
    if not isinstance(obj, dict):
        return "json"
    if "response" in obj or "error" in obj:
        return "result"
    if "url" in obj or "method" in obj or "body" in obj:
        return "request"
    return "object"


#: Response object type -> the endpoint that produces it, for per-endpoint counts.
OBJECT_TO_URL: dict[str, str] = {
    "chat.completion": "/v1/chat/completions",
    "text_completion": "/v1/completions",
    "embedding": "/v1/embeddings",
    "score": "/v1/score",
    "rerank": "/v1/rerank",
}


#: HTTP status of a failed result -> the ``code`` of its error object.
STATUS_ERROR_CODES: dict[int, str] = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    408: "timeout",
    413: "request_too_large",
    422: "invalid_request",
    429: "rate_limited",
}


def error_code(status_code: int | None) -> str:
    """
    Return the ``code`` of the error object of a failed result with this HTTP status.

    :param status_code: ``response.status_code`` (``None`` or 200 when only ``error`` says it failed).
    """
    if status_code in STATUS_ERROR_CODES:
        return STATUS_ERROR_CODES[status_code]
    if status_code is None or status_code == 200 or status_code >= 500:
        return "engine_error"
    return f"http_{status_code}"


def error_object(error: Any, status_code: int | None, line: int | None) -> dict[str, Any]:
    """
    Return a failed result's ``error`` in the one shape of the error file: ``{"code", "message", "line"}``.

    An error already in that shape (preflight's) keeps its code and line.

    :param error: the ``error`` as written: ``None``, a string, vLLM's ``ErrorResponse``, or ours.
    :param status_code: ``response.status_code``, when there is one.
    :param line: the input line of the request, when known.
    """
    if (
        isinstance(error, dict)
        and isinstance(error.get("code"), str)
        and isinstance(error.get("message"), str)
    ):
        kept = error.get("line")
        return {
            "code": error["code"],
            "message": error["message"],
            "line": kept if isinstance(kept, int) else line,
        }
    message = error_message(error) or f"the engine answered with HTTP status {status_code}"
    return {"code": error_code(status_code), "message": message, "line": line}


def error_message(error: Any) -> str | None:
    """
    Return the human message of a result line's ``error``, whatever its shape.

    :param error: ``None``, a string, ``{"message": ...}`` or ``{"error": {"message": ...}}``.
    """
    if error is None:
        return None
    if isinstance(error, str):
        return error
    if isinstance(error, dict):
        inner = error.get("error")
        message = inner.get("message") if isinstance(inner, dict) else None
        if isinstance(message, str):
            return message
        message = error.get("message")
        if isinstance(message, str):
            return message
    return msgspec.json.encode(error).decode("utf-8", "replace")
