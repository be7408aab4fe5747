"""The answers of a stopped batch, and OpenAI's shape of result and error lines.

Plain Python (msgspec, no Airflow, no S3), like the rest of :mod:`airflow_vllm_batch.batchfile`:

* :func:`split_stopped` turns what a stopped run has answered (its durable answers, of a
  custom_id answered twice a success rather than a failure, else the first answer, as the
  results check keeps them) and the input's custom_ids into a results file and an
  error file, every request in exactly one of them, the unanswered ones as
  ``batch_expired`` or ``batch_cancelled`` lines (OpenAI's codes);
* :func:`to_openai_line` rewrites one line of the run's results or error file into the
  shape of OpenAI's batch output: a line id ``batch_req_…``; an HTTP failure as
  ``response.status_code`` >= 400 with ``response.body.error {message, type, param, code}``
  and ``error: null``; ``error`` only where no response exists.

The operator's own files keep vLLM's shape; the OpenAI API's batch task asks the run layer
for OpenAI's (``BatchSettings.result_shape``), which converts its local files right before
publishing them (:meth:`airflow_vllm_batch.run.BatchRun.publish_files`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import IO, Any

import msgspec

from airflow_vllm_batch.batchfile.models import CustomIdOnly, ResultLine, error_message, error_object

_decode = msgspec.json.Decoder(ResultLine).decode
_decode_request = msgspec.json.Decoder(CustomIdOnly).decode

#: The error of a request left unanswered when its batch stopped, by why it stopped (OpenAI's codes and words).
STOPPED_ERRORS = {
    "expired": {
        "code": "batch_expired",
        "message": "This request could not be executed before the completion window expired.",
    },
    "cancelled": {
        "code": "batch_cancelled",
        "message": "This request was not executed because the batch was cancelled.",
    },
}


#: How an answer ranks among the answers of one custom_id (two tries' checkpoints): the highest is
#: kept, the first of equals (as :func:`~airflow_vllm_batch.batchfile.results.check_results` keeps them).
SUCCESS, FINAL_FAILURE, OTHER_FAILURE = 2, 1, 0


def answer_rank(raw: bytes) -> tuple[str, int] | None:
    """The custom_id of a result line and its rank; None for a line that is no answer.

    :data:`SUCCESS` (a 200 without an error), :data:`FINAL_FAILURE` (a 4xx) or
    :data:`OTHER_FAILURE` (a 5xx, an ``engine_crash``, no response).

    :param raw: one line of vLLM's batch output shape (a checkpoint part, staged results).
    """
    if not raw.strip():
        return None
    try:
        line = _decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    if line.custom_id is None or (line.response is msgspec.UNSET and line.error is msgspec.UNSET):
        return None
    response = None if line.response is msgspec.UNSET else line.response
    error = None if line.error is msgspec.UNSET else line.error
    status = response.status_code if response is not None else None
    if error is None and response is not None and status in (None, 200):
        return line.custom_id, SUCCESS
    return line.custom_id, FINAL_FAILURE if isinstance(status, int) and 400 <= status < 500 else OTHER_FAILURE


def answer_outcome(raw: bytes) -> tuple[str, bool] | None:
    """The custom_id of a result line and whether it completed; None for a line that is no answer.

    :param raw: one line of vLLM's batch output shape (a checkpoint part, staged results).
    """
    found = answer_rank(raw)
    return None if found is None else (found[0], found[1] == SUCCESS)


def request_ids(lines: Iterable[bytes]) -> Iterable[str]:
    """The custom_ids of request lines (lines without a string custom_id are skipped: preflight refused them)."""
    for raw in lines:
        if not raw.strip():
            continue
        try:
            custom_id = _decode_request(raw).custom_id
        except (msgspec.DecodeError, UnicodeDecodeError):
            continue
        if isinstance(custom_id, str):
            yield custom_id


def stopped_line(custom_id: str, reason: str) -> bytes:
    """The error line of a request a stopped batch left unanswered (no response exists: ``error`` only)."""
    line = {
        "id": _line_id(custom_id, reason),
        "custom_id": custom_id,
        "response": None,
        "error": dict(STOPPED_ERRORS[reason]),
    }
    return msgspec.json.encode(line) + b"\n"


def split_stopped(
    answers: Iterable[bytes],
    requests: Iterable[str],
    results_out: IO[bytes],
    errors_out: IO[bytes],
    reason: str,
) -> dict[str, int]:
    """Write the files of a stopped batch; return its ``request_counts``.

    Exactly once: each of the input's custom_ids is written once, to one file: its best
    durable answer (:func:`answer_rank`: a success rather than a failure, whatever their
    order, else the first: Durability) (completed to ``results_out`` as it was, failed to
    ``errors_out`` with its ``error`` in the error file's shape), or, unanswered, a
    ``batch_<reason>`` line. An answer to a custom_id not in the input is left out.

    :param answers: every durable answer of the run, in the order the results check reads them.
    :param requests: the input's custom_ids, in input order.
    :param results_out: the results file.
    :param errors_out: the error file.
    :param reason: ``"expired"`` or ``"cancelled"``.
    """
    best: dict[str, tuple[int, bytes]] = {}
    for raw in answers:
        found = answer_rank(raw)
        if found is not None and (found[0] not in best or found[1] > best[found[0]][0]):
            best[found[0]] = (found[1], raw.rstrip(b"\r\n"))
    completed = failed = 0
    written: set[str] = set()
    for custom_id in requests:
        if custom_id in written:
            continue
        written.add(custom_id)
        chosen = best.get(custom_id)
        if chosen is None:
            errors_out.write(stopped_line(custom_id, reason))
            failed += 1
            continue
        rank, kept = chosen
        if rank == SUCCESS:
            results_out.write(kept + b"\n")
            completed += 1
        else:
            line = msgspec.json.decode(kept)
            response = line.get("response")
            status = response.get("status_code") if isinstance(response, dict) else None
            line["error"] = error_object(line.get("error"), status, None)
            errors_out.write(msgspec.json.encode(line) + b"\n")
            failed += 1
    return {"total": completed + failed, "completed": completed, "failed": failed}


def to_openai_line(raw: bytes) -> bytes:
    """One line of the run's results or error file in the shape of OpenAI's batch output (with its newline).

    :param raw: a line in vLLM's shape, as the results check and :func:`split_stopped` write them.
    """
    line = msgspec.json.decode(raw)
    if not isinstance(line, dict):
        return raw.rstrip(b"\r\n") + b"\n"
    custom_id = line.get("custom_id")
    line["id"] = _openai_id(line.get("id"), custom_id)
    response = line.get("response")
    error = line.get("error")
    status = response.get("status_code") if isinstance(response, dict) else None
    if isinstance(response, dict) and isinstance(status, int) and status >= 400:
        # An HTTP failure: the error is the response's body, as OpenAI's API answered it.
        message = error_message(error) or error_message(response.get("body")) or f"HTTP status {status}"
        code = error.get("code") if isinstance(error, dict) and isinstance(error.get("code"), str) else None
        kind = "server_error" if status >= 500 else "invalid_request_error"
        response["body"] = {"error": {"message": message, "type": kind, "param": None, "code": code}}
        line["response"] = response
        line["error"] = None
    elif error is not None:
        # No HTTP response exists (an engine crash, a line preflight refused, a stopped batch): ``error`` only.
        line["response"] = None
        line["error"] = {
            "code": error.get("code") if isinstance(error, dict) else None,
            "message": error_message(error) or "",
        }
    return msgspec.json.encode(line) + b"\n"


def _openai_id(current: Any, custom_id: Any) -> str:
    if isinstance(current, str) and current.startswith("batch_req_"):
        return current
    if isinstance(current, str) and current.startswith("vllm-"):
        return "batch_req_" + current.removeprefix("vllm-")
    return _line_id(str(custom_id), str(current))


def _line_id(custom_id: str, salt: str) -> str:
    """A line id that is the same for the same line (a retry publishing again writes the same bytes)."""
    return "batch_req_" + hashlib.sha256(f"{custom_id}\0{salt}".encode()).hexdigest()[:32]
