"""A batch's OpenAI status, mapped from its DAG run, its task and what the task left in S3.

Free of Airflow imports: the caller reads the run, the task instances, the manifest, the
failure record and the cancel request, and :func:`batch_object` turns them into the
fields of OpenAI's Batch object.

============================================  =====================================
DAG run / task                                 OpenAI status
============================================  =====================================
a published manifest, every request 404        ``failed`` (the model does not serve the endpoint)
a published manifest                           its ``status``: ``completed``, ``expired``
                                               or ``cancelled`` (whatever the run's state)
task failed, its failure record                ``failed`` with ``errors.data`` (a cancel too)
run succeeded                                  ``completed``
cancel asked, run not ended                    ``cancelling``
cancel asked, run ended                        ``cancelled``
run ended after ``expires_at``, failed,        ``expired`` (no files: the try could not publish)
no record
run failed                                     ``failed``
task not started, ``expires_at`` passed        ``finalizing`` (its task publishes it ``expired``
                                               when it runs)
run queued, task not started                   ``validating``
task running (preflight, then the engine)      ``in_progress``
task ended, run not yet ended                  ``finalizing``
============================================  =====================================

The rows are tried in order. A batch stops itself at ``expires_at`` or on a cancel, under
its lease, and publishes a manifest saying so; its task succeeds
(:class:`~airflow_vllm_batch.openai_api.batch_dag.OpenAIBatchOperator`).

OpenAI's state machine: a batch reaches one terminal status (``completed``, ``failed``,
``expired``, ``cancelled``) and keeps it. So the terminal rows read only what never changes
once the batch ended: the published manifest (final: nothing publishes over it, and a file
its owner deleted does not unpublish it), the failure record of the try that failed, and
when the run ended (not the clock: a batch that failed stays ``failed`` when ``expires_at``
passes later). ``expires_at`` is the signed ``created_at`` plus the signed ``window_s``. A
published batch's times (``completed_at`` or the other ending, and ``finalizing_at``) are when
its manifest was written (``published_at``, the object's time in S3): the same on every read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

#: Task instance states in which the task has not started yet.
_NOT_STARTED = (None, "none", "scheduled", "queued", "removed")
_SECONDS = {"h": 3600, "d": 86400}


def window_seconds(completion_window: str) -> int:
    """The seconds of a completion window such as ``"24h"``.

    :raises ValueError: the window is not ``<n>h`` or ``<n>d`` with n >= 1.
    """
    unit = completion_window[-1:]
    number = completion_window[:-1]
    if unit not in _SECONDS or not number.isdigit() or int(number) < 1:
        raise ValueError(f"completion_window {completion_window!r} is not a number of hours such as '24h'")
    return int(number) * _SECONDS[unit]


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


@dataclass
class BatchDagRun:
    """The DAG run of one batch as the API sees it: what the database and S3 say of it.

    Not :class:`airflow_vllm_batch.run.batch.BatchRun` (the run itself, which the batch task executes).

    :param conf: the batch as the API shows it: its verified spec's fields and the API's record (``total``, ``model``, ``metadata``, ``completion_window``), never an unsigned conf field.
    :param run_state: the DAG run's state (``queued``, ``running``, ``success``, ``failed``).
    :param task_states: the states of the run's task instances.
    :param task_start: when the first task started.
    :param task_end: when the last task ended.
    :param run_end: when the DAG run ended.
    :param manifest: the published manifest (a dict), when there is one whose files still have its ETags.
    :param failure: the failure record the batch task wrote when it failed for good (``{"errors": [...], "stage": ...}``).
    :param cancelling_at: when a cancel was asked (seconds since the epoch), if one was.
    :param progress: ``{"completed": n, "failed": m}`` answered so far: the progress record the task writes at each checkpoint.
    :param published_at: when the manifest was published (its object's time in S3), when there is one.
    """

    conf: Mapping[str, Any]
    run_state: str | None
    task_states: list[str | None] = field(default_factory=list)
    task_start: datetime | None = None
    task_end: datetime | None = None
    run_end: datetime | None = None
    manifest: Mapping[str, Any] | None = None
    failure: Mapping[str, Any] | None = None
    cancelling_at: int | None = None
    progress: Mapping[str, int] | None = None
    published_at: datetime | None = None


def batch_status(run: BatchDagRun, now: float) -> str:
    """The OpenAI status of a batch.

    A published manifest decides, whatever the run's state (``status`` ``expired`` or
    ``cancelled``, else ``completed``), unless the batch task failed after it and said why
    (a model that does not serve the endpoint). Per-request failures never fail a batch.

    :param run: the batch's run.
    :param now: the current time, seconds since the epoch.
    """
    ended = run.run_state in ("success", "failed")
    task_failed = run.run_state == "failed" or "failed" in run.task_states
    if run.manifest is not None:
        if endpoint_not_served(run.manifest):
            return "failed"
        return str(run.manifest.get("status") or "completed")
    if task_failed and run.failure is not None:
        return "failed"
    if run.run_state == "success":
        return "completed"
    if run.cancelling_at is not None:
        return "cancelled" if ended else "cancelling"
    if run.run_state == "failed":
        # A try stopped without publishing (killed past its backstop timeout, say): no files, the window had
        # passed when the run ended. When it ended, not now: a failed batch stays failed.
        end = run.run_end or run.task_end
        return "expired" if end is not None and end.timestamp() >= expires_at(run.conf) else "failed"
    states = [str(s) if s is not None else None for s in run.task_states]
    if not states or all(s in _NOT_STARTED for s in states):
        # Past its window, a batch whose task waits in the queue (never started, or a retry) has
        # ended: its task, when it runs, publishes it expired (the answers made durable so far, the
        # rest batch_expired). Not "expired" until then: a terminal status comes with its files and
        # counts and keeps them, and none is published yet (the chaos campaign saw the files of a
        # batch shown "expired" appear afterwards: docs/reliability.md).
        return "finalizing" if now >= expires_at(run.conf) else "validating"
    if all(s in ("success", "skipped", "failed", "upstream_failed") for s in states):
        return "finalizing"
    return "in_progress"


def expires_at(conf: Mapping[str, Any]) -> int:
    """When the batch's completion window passes: the signed ``created_at`` plus the signed ``window_s``."""
    return int(conf["created_at"]) + int(conf["window_s"])


def window_name(conf: Mapping[str, Any]) -> str:
    """The batch's ``completion_window`` as created (``24h``): the conf's name when it is the signed ``window_s``."""
    name = str(conf.get("completion_window") or "")
    try:
        if window_seconds(name) == int(conf["window_s"]):
            return name
    except ValueError:
        pass
    return f"{int(conf['window_s']) // 3600}h"


def endpoint_not_served(manifest: Mapping[str, Any]) -> bool:
    """Whether every request of a published batch was answered HTTP 404: its model does not serve the endpoint.

    That is the batch's failure, not its requests': the batch task fails it, and its status is
    ``failed`` from the moment the manifest is published (not only once the task has said so).
    """
    counts = manifest.get("request_counts") or {}
    total = int(counts.get("total") or 0)
    return bool(
        total
        and not counts.get("completed")
        and (manifest.get("failed_by_reason") or {}) == {"not_found": total}
    )


def request_counts(run: BatchDagRun) -> dict[str, int]:
    """Total, completed and failed requests.

    The published manifest's; while the run goes, the input's line count and the progress
    record the batch task writes at each checkpoint.
    """
    if run.manifest is not None:
        counts = run.manifest.get("request_counts") or {}
        return {
            "total": int(counts.get("total", 0)),
            "completed": int(counts.get("completed", 0)),
            "failed": int(counts.get("failed", 0)),
        }
    progress = run.progress or {}
    return {
        "total": int(run.conf.get("total") or 0),
        "completed": int(progress.get("completed", 0)),
        "failed": int(progress.get("failed", 0)),
    }


def _usage(manifest: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if manifest is None:
        return None
    usage = manifest.get("usage") or {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": int(usage.get("total_tokens", prompt + completion)),
    }


def _errors(run: BatchDagRun, status: str) -> dict[str, Any] | None:
    if status != "failed":
        return None
    data = list((run.failure or {}).get("errors") or [])
    if not data and run.manifest is not None:
        # Published, its task not yet failed (it writes the record a moment later): the same reason.
        data = [
            {
                "code": "endpoint_not_served",
                "line": None,
                "param": "endpoint",
                "message": f"Every request was answered HTTP 404: the model does not serve {run.conf['endpoint']}.",
            }
        ]
    if not data:
        data = [
            {
                "code": "batch_failed",
                "line": None,
                "param": None,
                "message": "The batch's DAG run failed; its task log says why.",
            }
        ]
    return {"object": "list", "data": data}


def batch_object(batch_id: str, run: BatchDagRun, now: float) -> dict[str, Any]:
    """The OpenAI Batch object of a batch (``openai.types.Batch`` parses it).

    :param batch_id: the batch's id (its DAG run's run_id).
    :param run: the batch's run.
    :param now: the current time, seconds since the epoch.
    """
    status = batch_status(run, now)
    conf = run.conf
    published = run.manifest is not None
    # A published batch ended when its manifest was written: the same on every read, whereas the
    # task's and the run's ends are recorded a moment later (and a clear changes them).
    published_at = _ts(run.published_at) if published else None
    # The run ends a moment after its task: until then the task's end is the batch's.
    ended_at = published_at or _ts(run.run_end) or (_ts(run.task_end) if published else None)
    if ended_at is None and published:
        # The manifest decides the ending a moment before the task's end is recorded: the batch
        # ended when it published, its try's start plus the manifest's duration.
        # Without a recorded start the time is unknown: None, never the clock, which would move an
        # ended batch's time from one read to the next.
        start = _ts(run.task_start)
        ended_at = (
            start + int(float((run.manifest or {}).get("duration_s") or 0)) if start is not None else None
        )
    preflight_failed = (run.failure or {}).get("stage") == "preflight"
    started = run.task_start is not None and not preflight_failed
    in_progress_at = _ts(run.task_start) if started else None
    duration = (run.manifest or {}).get("duration_s")
    if published_at is not None and duration is not None:
        # The start of the try that published: its manifest's time less its duration. The task's
        # start is the latest try's, which a clear after the end would move.
        in_progress_at = max(int(conf["created_at"]), published_at - int(float(duration)))
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": conf["endpoint"],
        "errors": _errors(run, status),
        "input_file_id": conf["input_file_id"],
        "completion_window": window_name(conf),
        "status": status,
        # As OpenAI's: a batch stopped (or failed) before any request completed has no output file.
        "output_file_id": conf.get("output_file_id")
        if published and (status == "completed" or request_counts(run)["completed"])
        else None,
        "error_file_id": conf.get("error_file_id")
        if published and (run.manifest or {}).get("error_uri")
        else None,
        "created_at": int(conf["created_at"]),
        "in_progress_at": in_progress_at,
        "expires_at": expires_at(conf),
        "finalizing_at": published_at
        or (_ts(run.task_end) if status in ("finalizing", "completed") or published else None),
        "completed_at": ended_at if status == "completed" else None,
        "failed_at": ended_at if status == "failed" else None,
        "expired_at": ended_at if status == "expired" else None,
        "cancelling_at": run.cancelling_at,
        "cancelled_at": ended_at if status == "cancelled" else None,
        "request_counts": request_counts(run),
        "usage": _usage(run.manifest),
        "model": (run.manifest or {}).get("model") or conf.get("model"),
        "metadata": dict(conf.get("metadata") or {}) or None,
    }
