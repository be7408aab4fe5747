"""Structured outputs: answers that must fit a Pydantic model (the operator's ``output_type``).

Three steps share one :class:`OutputSchema`:

* **before the engine** (preflight): every chat and completions line without its own
  ``response_format`` gets :meth:`OutputSchema.response_format`, the OpenAI
  ``json_schema`` format vLLM turns into structured decoding (``/v1/completions`` takes
  ``response_format`` too in vLLM 0.32); a line of any other URL is refused, because
  an embedding or a score has no text to validate;
* **after the engine** (the results check): each successful answer's text
  (``choices[0].message.content``, or ``choices[0].text`` for a completion) is validated
  with ``model_validate_json``; one that does not fit goes to the error file with
  ``error.code`` ``"invalid_output"`` and its ``raw`` text (:func:`invalid_output_error`),
  its message naming the fix when the answer shows it (:func:`answer_misfit`: the token
  limit, or whitespace padding);
* **downstream** (:func:`~airflow_vllm_batch.batchfile.answers.read_answers` with
  ``output_type=``): answers come back as model instances.

The core never imports Pydantic: the model brings it. A model is recognised by what
it offers (``model_json_schema`` and ``model_validate_json``, Pydantic 2's ``BaseModel``),
and a failed validation is Pydantic's ``ValidationError``, a ``ValueError``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol, TypeGuard

import msgspec

from airflow_vllm_batch.exceptions import ConfigurationError

#: The URLs whose answers are text a schema can constrain and validate.
STRUCTURED_URLS: frozenset[str] = frozenset({"/v1/chat/completions", "/v1/completions"})
#: The error file's code for an answer that does not fit ``output_type``.
INVALID_OUTPUT = "invalid_output"
#: The longest validation message kept per failed answer (the raw text is kept whole).
MAX_MESSAGE_CHARS = 300
#: The engine flag that keeps structured decoding from padding JSON with whitespace until the token limit.
COMPACT_JSON_FLAG = (
    """--structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'"""
)
#: A trailing run of this much whitespace marks an answer padded by structured decoding.
_PADDING_RUN = 16


class ModelClass(Protocol):
    """A Pydantic 2 model class, as this module uses it (the core never imports Pydantic)."""

    __name__: str
    __module__: str
    __qualname__: str

    def model_json_schema(self) -> dict[str, Any]: ...
    def model_validate_json(self, json_data: str, /) -> Any: ...


def resolve_output_type(value: Any) -> ModelClass | None:
    """Return the Pydantic model ``output_type`` names: the class itself, or its import path.

    :param value: ``None``, a ``pydantic.BaseModel`` subclass, or ``"package.module.Model"``.
    :raises ConfigurationError: not a BaseModel subclass, or a path that does not import.
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = _import_path(value)
    if not is_model_class(value):
        raise ConfigurationError(
            f"output_type must be a pydantic BaseModel subclass (or its import path, 'my_pkg.models.Review'), "
            f"got {value!r}. Define the answer's shape as `class Review(BaseModel): ...` and pass the class."
        )
    try:
        value.model_json_schema()
    except Exception as err:
        raise ConfigurationError(
            f"output_type {value.__name__} has no JSON schema ({err}). Make every field's type importable where the "
            "model is defined and JSON-serialisable."
        ) from err
    return value


def is_model_class(value: object) -> TypeGuard[ModelClass]:
    """Whether ``value`` is a Pydantic 2 model class (not an instance)."""
    return (
        isinstance(value, type)
        and callable(getattr(value, "model_json_schema", None))
        and callable(getattr(value, "model_validate_json", None))
    )


def check_output_type_path(value: str) -> None:
    """Check the form of an import path at parse time; it is imported when the task runs.

    The scheduler that parses the DAG may not have the worker's packages, so the import
    waits for the worker.
    """
    module, _, _name = value.rpartition(".")
    if not module or not all(part.isidentifier() for part in value.split(".")):
        raise ConfigurationError(
            f"output_type {value!r} is not an import path: give the model's module and name, e.g. "
            "'my_pkg.models.Review', or the class itself."
        )


def _import_path(path: str) -> Any:
    check_output_type_path(path)
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigurationError(
            f"output_type {path!r} cannot be imported on this worker ({err}). Install the package that defines it "
            "in the worker's environment, or pass the class itself."
        ) from err


@dataclass(frozen=True)
class OutputSchema:
    """The answer's shape, from a Pydantic model.

    :param model: a ``pydantic.BaseModel`` subclass.
    """

    model: ModelClass

    @property
    def name(self) -> str:
        """The model's class name: the ``json_schema``'s name (OpenAI allows letters, digits, ``_`` and ``-``)."""
        return self.model.__name__

    @cached_property
    def schema(self) -> dict[str, Any]:
        """``model_json_schema()``."""
        return self.model.model_json_schema()

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the canonical schema: a changed field changes the run identity."""
        canonical = json.dumps(self.schema, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def identity(self) -> dict[str, str]:
        """The schema's part of the run identity."""
        return {"name": f"{self.model.__module__}.{self.model.__qualname__}", "schema_sha256": self.digest}

    def response_format(self) -> dict[str, Any]:
        """The ``response_format`` filled into chat and completions bodies that have none."""
        return {
            "type": "json_schema",
            "json_schema": {"name": self.name, "schema": self.schema, "strict": True},
        }

    def problem(self, text: str | None) -> str | None:
        """Why ``text`` does not fit the model (a short message), or None when it does."""
        return self.parse(text)[1]

    def parse(self, text: str | None) -> tuple[Any, str | None]:
        """``(instance, None)`` when ``text`` fits the model, else ``(None, why)``: one validation either way."""
        if text is None:
            return None, "the answer has no text (content is null)"
        try:
            return self.model.model_validate_json(text), None
        except ValueError as err:  # pydantic.ValidationError
            return None, short_validation_error(err, self.name)


def short_validation_error(err: ValueError, name: str) -> str:
    """Pydantic's errors on one line: ``field: message; ...``, at most :data:`MAX_MESSAGE_CHARS`."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        parts = [
            f"{'.'.join(str(p) for p in item.get('loc', ())) or 'answer'}: {item.get('msg', 'invalid')}"
            for item in errors(include_url=False, include_input=False)
        ]
    else:
        parts = [" ".join(str(err).split())]
    text = f"does not fit {name}: " + "; ".join(parts)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


class _Message(msgspec.Struct, gc=False):
    content: Any = None


class _Choice(msgspec.Struct, gc=False):
    index: int = 0
    message: _Message | None = None
    text: Any = None
    finish_reason: Any = None


class _Usage(msgspec.Struct, gc=False):
    completion_tokens: Any = None


class _Body(msgspec.Struct, gc=False):
    choices: list[_Choice] | None = None
    object: Any = None
    usage: _Usage | None = None


class _Response(msgspec.Struct, gc=False):
    body: _Body | None = None
    choices: list[_Choice] | None = None


class _AnswerLine(msgspec.Struct, gc=False):
    response: _Response | None = None


_decode_answer = msgspec.json.Decoder(_AnswerLine).decode


def answer_misfit(raw: bytes, schema: OutputSchema) -> tuple[str, str | None] | None:
    """``(message, text)`` when a successful result line's answer does not fit ``schema``, else None.

    The message says why, and, when the answer shows it, what to change: an answer cut off at
    the token limit (``finish_reason`` ``"length"``) names the request's ``max_completion_tokens``
    / ``max_tokens``; one padded with whitespace names :data:`COMPACT_JSON_FLAG`.
    """
    response = _decode_answer(raw).response
    if response is None:
        return None
    body = response.body
    choices = body.choices if body is not None else response.choices
    if not choices:
        return None
    first = min(choices, key=lambda c: c.index) if len(choices) > 1 else choices[0]
    text = first.message.content if first.message is not None else first.text
    text = text if isinstance(text, str) or text is None else str(text)
    problem = schema.problem(text)
    if problem is None:
        return None
    tokens = body.usage.completion_tokens if body is not None and body.usage is not None else None
    return problem + _fix_hint(text, first.finish_reason, tokens, completion=first.message is None), text


def _fix_hint(text: str | None, finish_reason: Any, tokens: Any, *, completion: bool) -> str:
    """What to change for an answer that does not fit, when its shape tells (else "")."""
    cut = ""
    if finish_reason == "length":
        cut = f' (finish_reason "length"{f", {tokens} tokens" if isinstance(tokens, int) else ""})'
    if text is not None and _padded(text):
        # More tokens only buy more whitespace: the decoder's grammar allows it between JSON tokens.
        where = f"cut off at the token limit{cut} while padding" if cut else "padded"
        return (
            f". The answer is {where} with whitespace: start the engine with {COMPACT_JSON_FLAG} "
            "(in the engine's args, or on the warm server's command line)"
        )
    if cut:
        limit = "max_tokens" if completion else "max_completion_tokens (or max_tokens)"
        return f". The answer was cut off at the token limit{cut}: raise the request's {limit}, e.g. in default_body"
    return ""


def _padded(text: str) -> bool:
    """Whether ``text`` is mostly whitespace, or ends in a long run of it: JSON padded by structured decoding."""
    spaces = sum(c.isspace() for c in text)
    return (len(text) >= 8 and spaces * 2 >= len(text)) or len(text) - len(text.rstrip()) >= _PADDING_RUN


def invalid_output_error(message: str, raw_text: str | None, line: int | None) -> dict[str, Any]:
    """The error file's ``error`` of an answer that does not fit: ``{"code", "message", "line", "raw"}``."""
    return {"code": INVALID_OUTPUT, "message": message, "line": line, "raw": raw_text}
