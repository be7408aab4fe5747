"""Read a batch's answers back as Python values, for the task that uses them.

The results file holds vLLM's whole response per request; a downstream task usually
wants one value per ``custom_id``. :func:`read_answers` streams the published results
(and the error file) of a :class:`VLLMBatchOperator` run and yields one typed record per
request, each unpacking as a pair. In a task, read them from S3 with the storage layer's
wrapper, which opens ``s3://`` through Airflow's ``S3Hook`` and calls this reader::

    from airflow_vllm_batch.batchfile import Failed
    from airflow_vllm_batch.storage import read_answers

    @task
    def use(manifest: dict) -> dict:
        answers = {}
        for answer in read_answers(manifest):  # the operator's XCom
            if isinstance(answer, Failed):
                raise ValueError(f"{answer.custom_id}: {answer.error}")
            custom_id, text = answer
            answers[custom_id] = text
        return answers

- :class:`Text` ``(custom_id, text)``: a chat completion's first choice (its message's
  content), or a completion's (``/v1/completions``: its ``text``);
- :class:`Vector` ``(custom_id, vector)``: an embedding (a list of floats; a list of
  vectors when the request embedded several inputs; a base64 string when it asked for
  ``encoding_format="base64"``);
- :class:`Scores` ``(custom_id, scores)``: ``/v1/score`` scores, or ``/v1/rerank``
  relevance scores, in the order of the request's documents;
- :class:`Failed` ``(custom_id, error)``: a failed request and its message (from the
  error file, where ``custom_id`` is ``None`` for a line preflight could not read);
- :class:`Parsed` ``(custom_id, value)``: with ``output_type=`` (a Pydantic model, as given
  to the operator), a chat completion's or completion's text parsed into an instance of it.
  A text that does not fit comes as :class:`Failed` with an ``invalid_output: ...`` message
  (an output published without ``output_type``); the operator's own ``invalid_output``
  answers are in the error file already, and come as :class:`Failed` too.

Given the manifest, the reader keeps the results check's promise: it reads the output and
error file the manifest names, and at the end checks that they answered every request of
the manifest exactly once (no custom_id twice, the counts equal), raising
:class:`~airflow_vllm_batch.exceptions.ResultsCheckError` if the files changed since (a
later run over the same output). Memory stays flat but for one 8-byte hash per request.
Plain Python (msgspec): this module reads local paths and http(s) URLs itself and any
other URI through the ``open_uri`` it is given, so it never imports an S3 client or Airflow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import msgspec

from airflow_vllm_batch.batchfile.models import error_message
from airflow_vllm_batch.batchfile.sources import open_lines
from airflow_vllm_batch.batchfile.structured import (
    INVALID_OUTPUT,
    ModelClass,
    OutputSchema,
    resolve_output_type,
)
from airflow_vllm_batch.exceptions import ConfigurationError, ResultsCheckError
from airflow_vllm_batch.manifest import schema_version

#: Opens a results or error file by URI and yields its lines (bytes, no newline).
OpenURI = Callable[[str], contextlib.AbstractContextManager[Iterable[bytes]]]


class Text(NamedTuple):
    """A chat completion or a completion: ``(custom_id, text)`` of its first choice (``None`` when the model returned no content)."""

    custom_id: str | None
    text: str | None


class Vector(NamedTuple):
    """An embedding: ``(custom_id, vector)``."""

    custom_id: str | None
    vector: Any


class Scores(NamedTuple):
    """Scores of ``/v1/score`` or relevance scores of ``/v1/rerank``: ``(custom_id, scores)``, in the documents' order."""

    custom_id: str | None
    scores: list[float | None]


class Parsed(NamedTuple):
    """A chat completion or a completion whose text fits ``output_type``: ``(custom_id, value)``, a model instance."""

    custom_id: str | None
    value: Any


class Failed(NamedTuple):
    """A failed request: ``(custom_id, error)``, the error's message."""

    custom_id: str | None
    error: str


class _Message(msgspec.Struct, gc=False):
    content: Any = None


class _Choice(msgspec.Struct, gc=False):
    index: int = 0
    message: _Message | None = None
    # A /v1/completions choice has its text here, and no message.
    text: str | None = None


class _Datum(msgspec.Struct, gc=False):
    index: int = 0
    embedding: Any = None
    score: float | None = None


class _Ranked(msgspec.Struct, gc=False):
    index: int = 0
    relevance_score: float | None = None


class _Body(msgspec.Struct, gc=False):
    object: str | None = None
    choices: list[_Choice] | None = None
    data: list[_Datum] | None = None
    results: list[_Ranked] | None = None


class _Response(_Body, gc=False):
    # The current shape nests the body; the older one is the body itself.
    status_code: int | None = None
    body: _Body | None = None


class _Line(msgspec.Struct, gc=False):
    custom_id: str | None = None
    response: _Response | None = None
    error: Any = None


_decode = msgspec.json.Decoder(_Line).decode

Answer = Text | Parsed | Vector | Scores | Failed


def iter_answers(
    lines: Iterable[bytes], *, source: str = "results", output_type: ModelClass | None = None
) -> Iterator[Answer]:
    """
    Yield one answer per result line (blank lines skipped).

    :param lines: result lines (vLLM's output, the published results or error file).
    :param source: the file's name, for error messages.
    :param output_type: a Pydantic model: text answers come as :class:`Parsed` instances of it.
    :raises ResultsCheckError: a line is not a result line of a known kind.
    """
    schema = OutputSchema(output_type) if output_type is not None else None
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            line = _decode(raw)
        except msgspec.DecodeError as err:
            raise ResultsCheckError(f"{source} line {number} is not a result line ({err}).") from None
        answer = _answer(line, number, source)
        yield _parsed(answer, schema) if schema is not None and isinstance(answer, Text) else answer


def _parsed(answer: Text, schema: OutputSchema) -> Parsed | Failed:
    value, problem = schema.parse(answer.text)
    if problem is not None:
        return Failed(answer.custom_id, f"{INVALID_OUTPUT}: {problem}")
    return Parsed(answer.custom_id, value)


def _answer(line: _Line, number: int, source: str) -> Answer:
    response = line.response
    status = response.status_code if response is not None else None
    if line.error is not None or response is None or status not in (None, 200):
        message = error_message(line.error) if line.error is not None else None
        return Failed(line.custom_id, message or f"the engine answered with HTTP status {status}")
    body = response.body if response.body is not None else response
    cid = line.custom_id
    if body.choices:
        first = min(body.choices, key=lambda c: c.index)
        content = first.message.content if first.message is not None else first.text
        return Text(cid, content if isinstance(content, str) or content is None else str(content))
    if body.results is not None:
        return Scores(cid, [r.relevance_score for r in sorted(body.results, key=lambda r: r.index)])
    if body.data:
        data = sorted(body.data, key=lambda d: d.index)
        if data[0].embedding is not None:
            return Vector(cid, data[0].embedding if len(data) == 1 else [d.embedding for d in data])
        if data[0].score is not None:
            return Scores(cid, [d.score for d in data])
    raise ResultsCheckError(
        f"{source} line {number} (custom_id {cid!r}) holds no chat choice, embedding or score; read it as JSON instead."
    )


def read_answers(
    source: Mapping[str, Any] | str,
    *,
    open_uri: OpenURI | None = None,
    errors: bool = True,
    output_type: type | str | None = None,
) -> Iterator[Answer]:
    """
    Stream the answers of a batch: its results, then (``errors``) its failed requests.

    :param source: the operator's manifest (its XCom: ``output_uri``, ``error_uri``,
        ``request_counts``), or one results or error file's URI or local path.
    :param open_uri: opens a URI and yields its lines; default: local paths and http(s)
        URLs only. :func:`airflow_vllm_batch.storage.read_answers` passes one that reads
        ``s3://`` through an Airflow connection.
    :param errors: with a manifest, also yield its error file's :class:`Failed` records. Default True.
    :param output_type: a Pydantic ``BaseModel`` subclass (or its import path): text answers
        come as :class:`Parsed` ``(custom_id, value)`` with ``value`` an instance of it.
    :raises ResultsCheckError: with a manifest, the files do not answer its requests exactly once.
    :raises ConfigurationError: an ``s3://`` URI without an ``open_uri`` that reads it.
    :raises ManifestVersionError: the manifest is of a newer schema than this package reads.
    """
    opener = open_uri or _open_local
    model = resolve_output_type(output_type)
    if isinstance(source, str):
        with opener(source) as lines:
            yield from iter_answers(lines, source=source, output_type=model)
        return
    schema_version(source, f"the manifest of {source.get('output_uri')}")
    uris = [source["output_uri"]] + ([source["error_uri"]] if errors and source.get("error_uri") else [])
    seen: set[int] = set()
    found = {"completed": 0, "failed": 0}
    for number, uri in enumerate(uris):
        with opener(uri) as lines:
            for answer in iter_answers(lines, source=uri, output_type=model):
                # Counted by file: a results-file answer that does not fit output_type is still a completed request.
                found["failed" if number else "completed"] += 1
                if answer.custom_id is not None:
                    key = hash(answer.custom_id)
                    if key in seen:
                        raise ResultsCheckError(f"{uri}: custom_id {answer.custom_id!r} is answered twice.")
                    seen.add(key)
                yield answer
    counts = source.get("request_counts") or {}
    expected = {
        k: counts.get(k) for k in ("completed", "failed") if k in counts and (errors or k == "completed")
    }
    if any(found[k] != v for k, v in expected.items()):
        raise ResultsCheckError(
            f"{source['output_uri']} does not match its manifest: {found} answers, the manifest says {expected}. "
            "The output was written again after this manifest: read the output's current manifest instead."
        )


@contextlib.contextmanager
def _open_local(uri: str) -> Iterator[Iterable[bytes]]:
    if uri.startswith("s3://"):
        # The batch-file core holds no S3 client: the storage layer opens S3 and passes the lines down.
        raise ConfigurationError(
            f"{uri}: this reader opens local paths and http(s) URLs only. Read S3 with "
            "airflow_vllm_batch.storage.read_answers(manifest, aws_conn_id=...), or pass open_uri."
        )
    with open_lines(uri) as lines:
        yield lines
