"""What a run's checkpoint parts answer: the parts a retry resumes from, their custom_ids, the requests they answer.

Read by both engines when a try resumes (:mod:`~airflow_vllm_batch.engines.server`,
:mod:`~airflow_vllm_batch.engines.runner`) and by the run after a failed results check, which
drops only the parts :func:`invalid_parts` names (Durability: every other part holds valid answers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from airflow_vllm_batch.batchfile import CustomIdIndex
from airflow_vllm_batch.batchfile.models import decode_custom_id

if TYPE_CHECKING:
    from airflow_vllm_batch.log_groups import TaskLog
    from airflow_vllm_batch.storage.staging import RunStaging


def answered_ids(staging: RunStaging, parts: list[str]) -> CustomIdIndex:
    """The custom_ids the checkpoint parts answer, as preflight's compact index (12 bytes each, 24 once looked up)."""
    index = CustomIdIndex()
    if not parts:
        return index
    with staging.open_parts(parts) as lines:
        for number, raw in enumerate(lines, start=1):
            if raw.strip():
                index.add(decode_custom_id(raw).custom_id, number)
    return index


def resumable_parts(
    staging: RunStaging, wanted: CustomIdIndex | None, log: TaskLog
) -> tuple[list[str], CustomIdIndex]:
    """The checkpoint parts a retry resumes from, and the custom_ids they answer (as :func:`answered_ids`).

    A part holding a line no results check accepts (unreadable, or no answer to a request of
    the input: a try that died before its check left it) is dropped first, as that check
    would drop it (:func:`invalid_parts`); its requests are sent again. Reading it as answers
    would fail every retry on the same line (simulator seed 106 of issue 34), or skip requests
    whose answers the check then drops.

    :param staging: the run's staging (the try holds the lease: the drop is fenced).
    :param wanted: the input's custom_ids (preflight's index); None: only unreadable lines count.
    :param log: where the drop is told.
    """
    index = CustomIdIndex()
    kept: list[str] = []
    bad: list[str] = []
    number = 0
    for key in staging.list_parts():
        ids: list[tuple[str, int]] = []
        count = 0
        with staging.open_parts([key]) as lines:
            for raw in lines:
                count += 1
                if not raw.strip():
                    continue
                if not _valid_answer(raw, wanted):
                    bad.append(key)
                    break
                ids.append((decode_custom_id(raw).custom_id, number + count))
            else:
                kept.append(key)
                for custom_id, line in ids:
                    index.add(custom_id, line)
                number += count
    if bad:
        log.warning(
            "Dropping %d checkpoint part(s) that hold a line no results check accepts (a try ended before its check): "
            "%s; their requests are sent again.",
            len(bad),
            ", ".join(bad),
        )
        staging.drop_parts(bad)
    return kept, index


def answered_requests(wanted: CustomIdIndex | None, answered: CustomIdIndex, total: int) -> int:
    """How many of the input's requests the checkpoint parts answer: each once, however often it was answered.

    :param wanted: the input's custom_ids (preflight's index); None when unknown.
    :param answered: the parts' custom_ids (:func:`answered_ids`).
    :param total: the input's requests, when ``wanted`` is unknown.
    """
    if not len(answered):
        return 0
    if wanted is None:
        # No input index to compare with: never claim more than the parts' distinct ids.
        return min(total, sum(len(set(hs)) for hs in answered.hashes))
    return wanted.found_in(answered)


def invalid_parts(staging: RunStaging, wanted: CustomIdIndex | None) -> list[str]:
    """The checkpoint parts that hold a line no results check can accept: unreadable, or no answer to a request of the input.

    Only these may be dropped after a failed results check: every other part holds valid
    answers that a retry resumes from (Durability).

    :param staging: the run's staging.
    :param wanted: the input's custom_ids (preflight's index); None: only unreadable lines count.
    """
    bad = []
    for key in staging.list_parts():
        with staging.open_parts([key]) as lines:
            if any(raw.strip() and not _valid_answer(raw, wanted) for raw in lines):
                bad.append(key)
    return bad


def _valid_answer(raw: bytes, wanted: CustomIdIndex | None) -> bool:
    try:
        line = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return False
    if not isinstance(line, dict) or not isinstance(line.get("custom_id"), str):
        return False
    if "response" not in line and "error" not in line:
        return False
    return wanted is None or wanted.line_of(line["custom_id"]) is not None
