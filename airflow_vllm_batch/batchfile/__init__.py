"""The OpenAI batch file format as vLLM reads and writes it: models, streaming readers, checks.

Plain Python (msgspec, no Airflow), so the operator, the ``airflow-vllm-batch``
CLI and the tests share one implementation::

    from airflow_vllm_batch.batchfile import PreflightOptions, preflight, check_results, open_lines

    with open_lines("input.jsonl.gz") as lines:  # gzip is recognised by content
        report = preflight(lines, PreflightOptions(model="my-model", model_kind="generate"))
    report.raise_for_problems("input.jsonl.gz")

    with open_lines("results.jsonl") as results, open("ok.jsonl", "wb") as ok, open("errors.jsonl", "wb") as bad:
        # preflight's index: the input is not read a third time
        summary = check_results(results, input_index=report.custom_ids, results_out=ok, errors_out=bad)
    summary.raise_for_mismatch()

The result files (one contract, as in OpenAI's Batch API)
----------------------------------------------------------

A request either succeeded or failed, and it is in exactly one of two files:

* **results file** — the successful answers only: lines whose ``error`` is null and
  whose ``response.status_code`` is 200, byte for byte as vLLM wrote them. Every
  line's ``response.body`` is an OpenAI response object (``ChatCompletion``,
  ``CreateEmbeddingResponse``, ...), so a consumer may parse every line with the
  OpenAI SDK's types. With no failures the file is the engine's output unchanged.
* **error file** — every failed request: lines preflight left out
  (``invalid_lines="skip"``) and lines the engine answered with an error. One shape::

    {"id": "vllm-..." | null, "custom_id": "request-7" | null,
     "response": {"status_code": 400, "request_id": ... | null, "body": null} | null,
     "error": {"code": "invalid_request", "message": "what went wrong", "line": 7 | null}}

  ``id`` and ``response`` are the engine's (null for a line preflight left out).
  ``error.code`` is ``"invalid_request"`` for preflight's lines and, for the
  engine's, follows the HTTP status (``invalid_request`` for 400/422,
  ``rate_limited`` for 429, ``engine_error`` for 5xx or when only ``error`` says
  it failed, ``http_<status>`` otherwise), and ``invalid_output`` for an answer that
  does not fit the operator's ``output_type`` (its text is kept in ``error.raw``;
  see :mod:`~airflow_vllm_batch.batchfile.structured`). ``error.message`` is the text vLLM or
  preflight wrote. ``error.line`` is the request's line number: in the input file
  for preflight's lines, in the file the engine read for the engine's (the same
  file unless preflight rewrote it), ``null`` when unknown.

Every request of the input is counted in exactly one of the two files, so
``completed + failed`` is the number of requests.

Answers for the next task
-------------------------

:func:`read_answers` streams both files of a run (given its manifest, the operator's
XCom) and yields ``(custom_id, text)`` (:class:`Text`), ``(custom_id, vector)``
(:class:`Vector`), ``(custom_id, scores)`` (:class:`Scores`) or ``(custom_id, error)``
(:class:`Failed`) per request (with ``output_type=``, ``(custom_id, model instance)``:
:class:`Parsed`); see :mod:`~airflow_vllm_batch.batchfile.answers`. It reads
local paths and http(s) URLs; :func:`airflow_vllm_batch.storage.read_answers` reads
``s3://`` too (through an Airflow connection) and passes the lines down, because this
package imports neither Airflow nor an S3 client, not even lazily.
"""

from __future__ import annotations

from airflow_vllm_batch.batchfile.answers import (
    Failed,
    Parsed,
    Scores,
    Text,
    Vector,
    iter_answers,
    read_answers,
)
from airflow_vllm_batch.batchfile.index import CustomIdIndex
from airflow_vllm_batch.batchfile.line_checks import (
    DEFAULT_MAX_LINE_BYTES,
    RUNNER_URL_ADVICE,
    PreflightOptions,
    diagnose_line,
)
from airflow_vllm_batch.batchfile.models import (
    DEFAULT_SUPPORTED_URLS,
    SAMPLING_FIELDS,
    RequestLine,
    ResultLine,
    endpoint_kind,
    error_message,
    error_object,
    line_kind,
)
from airflow_vllm_batch.batchfile.preflight import preflight
from airflow_vllm_batch.batchfile.preflight_report import PreflightReport, error_line
from airflow_vllm_batch.batchfile.problems import Problem
from airflow_vllm_batch.batchfile.results import ENGINE_DEAD_MESSAGE, check_results
from airflow_vllm_batch.batchfile.results_report import ResultsReport
from airflow_vllm_batch.batchfile.sources import (
    Lines,
    describe_source,
    is_compressed,
    iter_lines,
    open_lines,
    redact_url,
    redact_urls,
    source_size,
    url_secrets,
)
from airflow_vllm_batch.batchfile.structured import OutputSchema

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_SUPPORTED_URLS",
    "ENGINE_DEAD_MESSAGE",
    "RUNNER_URL_ADVICE",
    "SAMPLING_FIELDS",
    "CustomIdIndex",
    "Failed",
    "Lines",
    "OutputSchema",
    "Parsed",
    "PreflightOptions",
    "PreflightReport",
    "Problem",
    "RequestLine",
    "ResultLine",
    "ResultsReport",
    "Scores",
    "Text",
    "Vector",
    "check_results",
    "describe_source",
    "diagnose_line",
    "endpoint_kind",
    "error_line",
    "error_message",
    "error_object",
    "is_compressed",
    "iter_answers",
    "iter_lines",
    "line_kind",
    "open_lines",
    "preflight",
    "read_answers",
    "redact_url",
    "redact_urls",
    "source_size",
    "url_secrets",
]
