"""A batch's OpenAI status follows its DAG run, its task and what the task left in S3; the SDK parses the object."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from openai.types import Batch

from airflow_vllm_batch.openai_api.status import BatchDagRun, batch_object, batch_status, window_seconds

CREATED = 1_800_000_000
CONF = {
    "owner": "alice",
    "input_file_id": "file-0123456789",
    "endpoint": "/v1/chat/completions",
    "completion_window": "24h",
    "metadata": {"team": "search"},
    "created_at": CREATED,
    "window_s": 86400,
    "total": 3,
    "output_file_id": "file-abcdefabout",
    "error_file_id": "file-abcdefaberr",
    "output_uri": "s3://b/files/o/file-abcdefabout.jsonl",
}
T = datetime.fromtimestamp(CREATED + 10, tz=timezone.utc)
MANIFEST = {
    "request_counts": {"total": 3, "completed": 2, "failed": 1},
    "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
    "error_uri": "s3://b/e.jsonl",
    "model": "m",
}
NOW = CREATED + 60
UNSERVED = {
    **MANIFEST,
    "request_counts": {"total": 3, "completed": 0, "failed": 3},
    "failed_by_reason": {"not_found": 3},
}


@pytest.mark.parametrize(
    ("run", "status"),
    [
        (BatchDagRun(CONF, "queued"), "validating"),
        (BatchDagRun(CONF, "running", ["scheduled"]), "validating"),
        (BatchDagRun(CONF, "running", ["running"], task_start=T), "in_progress"),
        (BatchDagRun(CONF, "running", ["up_for_retry"], task_start=T), "in_progress"),
        (BatchDagRun(CONF, "running", ["success"], task_start=T, task_end=T), "finalizing"),
        (
            BatchDagRun(CONF, "success", ["success"], task_start=T, task_end=T, run_end=T, manifest=MANIFEST),
            "completed",
        ),
        (BatchDagRun(CONF, "failed", ["failed"], failure={"stage": "preflight", "errors": []}), "failed"),
        (BatchDagRun(CONF, "running", ["running"], cancelling_at=CREATED + 20), "cancelling"),
        (BatchDagRun(CONF, "failed", ["failed"], run_end=T, cancelling_at=CREATED + 20), "cancelled"),
        # A published manifest decides, whatever the run's state.
        (BatchDagRun(CONF, "running", ["success"], task_start=T, task_end=T, manifest=MANIFEST), "completed"),
        (BatchDagRun(CONF, "running", ["running"], task_start=T, manifest=MANIFEST), "completed"),
        (
            BatchDagRun(
                CONF,
                "success",
                ["success"],
                manifest={**MANIFEST, "status": "cancelled"},
                cancelling_at=CREATED + 20,
            ),
            "cancelled",
        ),
        (BatchDagRun(CONF, "success", ["success"], manifest={**MANIFEST, "status": "expired"}), "expired"),
        (BatchDagRun(CONF, "failed", ["failed"], manifest=MANIFEST), "completed"),
        # Every request 404 (a model that does not serve the endpoint): failed from the publish on, not
        # "completed" until the task fails and writes its record.
        (BatchDagRun(CONF, "running", ["running"], task_start=T, manifest=UNSERVED), "failed"),
        (
            BatchDagRun(
                CONF, "failed", ["failed"], manifest=UNSERVED, failure={"stage": "run", "errors": []}
            ),
            "failed",
        ),
        # A batch that failed for good (preflight, say) after a cancel was asked: failed, saying why.
        (
            BatchDagRun(
                CONF,
                "failed",
                ["failed"],
                run_end=T,
                failure={"stage": "preflight", "errors": []},
                cancelling_at=CREATED + 5,
            ),
            "failed",
        ),
    ],
)
def test_status_follows_the_run(run, status):
    assert batch_status(run, NOW) == status


def test_a_run_that_ended_failed_after_its_window_without_a_failure_record_is_expired():
    late = datetime.fromtimestamp(CREATED + 24 * 3600, tz=timezone.utc)
    assert batch_status(BatchDagRun(CONF, "failed", ["failed"], run_end=late), NOW) == "expired"


@pytest.mark.parametrize("failure", [None, {"stage": "run", "errors": []}])
def test_a_failed_batch_stays_failed_when_the_clock_passes_its_expires_at(failure):
    run = BatchDagRun(CONF, "failed", ["failed"], task_start=T, task_end=T, run_end=T, failure=failure)
    assert batch_status(run, NOW) == "failed"
    assert batch_status(run, CREATED + 30 * 24 * 3600) == "failed"
    assert batch_object("batch_abcdefab", run, CREATED + 30 * 24 * 3600)["failed_at"] == int(T.timestamp())


@pytest.mark.parametrize("tis", [[], ["scheduled"], ["queued"]])
def test_a_batch_still_queued_when_its_window_passes_is_finalizing_until_its_task_publishes_it_expired(tis):
    """Not ``expired`` before the manifest: a terminal status must not gain its files and counts later."""
    run = BatchDagRun(CONF, "queued" if not tis else "running", tis)
    assert batch_status(run, CREATED + 86400 - 1) == "validating"
    shown = batch_object("batch_abcdefab", run, CREATED + 86400)
    assert shown["status"] == "finalizing"
    assert shown["expired_at"] is None
    published = BatchDagRun(CONF, "running", tis, manifest={**MANIFEST, "status": "expired"}, published_at=T)
    assert batch_status(published, CREATED + 86400) == "expired"


def test_a_retry_queued_past_the_window_is_not_shown_expired_before_it_publishes():
    """Chaos campaign (--expiring): a try failed, its retry was queued when the window passed."""
    run = BatchDagRun(CONF, "running", ["queued"], task_start=T)
    assert batch_status(run, CREATED + 86400 + 5) == "finalizing"


def test_the_window_and_expiry_are_the_signed_ones_not_the_confs_display_fields():
    """``completion_window`` in the conf is unsigned: a re-triggered conf could say 72h; ``window_s`` is signed."""
    conf = {**CONF, "completion_window": "72h"}
    batch = batch_object("batch_abcdefab", BatchDagRun(conf, "queued"), CREATED + 86400)
    assert batch["expires_at"] == CREATED + 86400
    assert batch["completion_window"] == "24h"
    assert batch["status"] == "finalizing"
    assert (
        batch_object("batch_abcdefab", BatchDagRun(conf, "queued"), CREATED + 86400 - 1)["status"]
        == "validating"
    )


def test_a_batch_failed_because_its_model_does_not_serve_the_endpoint_says_so_before_its_record_is_written():
    run = BatchDagRun(CONF, "running", ["running"], task_start=T, manifest=UNSERVED)
    batch = Batch.model_validate(batch_object("batch_abcdefab", run, NOW))
    assert batch.status == "failed"
    assert [e.code for e in batch.errors.data] == ["endpoint_not_served"]


def test_a_completed_batch_names_its_output_and_error_files_and_counts():
    batch = Batch.model_validate(
        batch_object("batch_abcdefab", BatchDagRun(CONF, "success", ["success"], T, T, T, MANIFEST), NOW)
    )
    assert batch.status == "completed"
    assert batch.output_file_id == CONF["output_file_id"]
    assert batch.error_file_id == CONF["error_file_id"]
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        3,
        2,
        1,
    )
    assert batch.usage.total_tokens == 12
    assert batch.completed_at == int(T.timestamp())
    assert batch.metadata == {"team": "search"}


def test_a_completed_batch_without_failures_has_no_error_file():
    manifest = {**MANIFEST, "error_uri": None}
    batch = Batch.model_validate(
        batch_object("batch_abcdefab", BatchDagRun(CONF, "success", ["success"], T, T, T, manifest), NOW)
    )
    assert batch.error_file_id is None


def test_a_preflight_failure_names_its_lines_and_never_was_in_progress():
    errors = [{"code": "invalid_request", "line": 2, "param": None, "message": "not JSON"}]
    batch = Batch.model_validate(
        batch_object(
            "batch_abcdefab",
            BatchDagRun(
                CONF, "failed", ["failed"], T, T, T, failure={"stage": "preflight", "errors": errors}
            ),
            NOW,
        )
    )
    assert batch.status == "failed"
    assert [e.line for e in batch.errors.data] == [2]
    assert batch.in_progress_at is None
    assert batch.output_file_id is None
    assert batch.failed_at == int(T.timestamp())


def test_a_running_batch_counts_its_input_lines():
    batch = Batch.model_validate(
        batch_object("batch_abcdefab", BatchDagRun(CONF, "running", ["running"], task_start=T), NOW)
    )
    assert batch.request_counts.total == 3
    assert batch.in_progress_at == int(T.timestamp())
    assert batch.expires_at == CREATED + 86400


@pytest.mark.parametrize("window", ["", "24", "h", "0h", "24m", "-1h"])
def test_a_window_that_is_not_hours_or_days_is_refused(window):
    with pytest.raises(ValueError, match="completion_window"):
        window_seconds(window)


def test_a_running_batch_reports_what_its_checkpoints_answered_so_far():
    run = BatchDagRun(CONF, "running", ["running"], task_start=T, progress={"completed": 2, "failed": 1})
    batch = Batch.model_validate(batch_object("batch_abcdefab", run, NOW))
    assert batch.status == "in_progress"
    assert (
        batch.request_counts.completed,
        batch.request_counts.failed,
    ) == (2, 1)


@pytest.mark.parametrize("status", ["expired", "cancelled"])
def test_a_stopped_batch_keeps_its_counts_and_files(status):
    run = BatchDagRun(CONF, "success", ["success"], T, T, T, manifest={**MANIFEST, "status": status})
    batch = Batch.model_validate(batch_object("batch_abcdefab", run, NOW))
    assert batch.status == status
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    assert (batch.output_file_id, batch.error_file_id) == (CONF["output_file_id"], CONF["error_file_id"])
    assert getattr(batch, f"{status}_at") == int(T.timestamp())
    assert batch.errors is None


def test_a_batch_stopped_before_any_request_completed_has_no_output_file():
    manifest = {
        **MANIFEST,
        "status": "cancelled",
        "request_counts": {"total": 3, "completed": 0, "failed": 3},
    }
    batch = Batch.model_validate(
        batch_object("batch_abcdefab", BatchDagRun(CONF, "success", ["success"], T, T, T, manifest), NOW)
    )
    assert batch.status == "cancelled"
    assert batch.output_file_id is None
    assert batch.error_file_id == CONF["error_file_id"]


def test_a_batch_published_before_its_task_ended_has_its_ending_time_in_order():
    # The manifest is out, the task is still returning: completed, and completed_at is not missing.
    batch = Batch.model_validate(
        batch_object(
            "batch_abcdefab", BatchDagRun(CONF, "running", ["running"], task_start=T, manifest=MANIFEST), NOW
        )
    )
    assert batch.status == "completed"
    assert batch.created_at <= batch.in_progress_at <= batch.completed_at


def test_a_published_batch_ended_when_its_manifest_was_written_on_every_read():
    """completed_at and finalizing_at do not move once the manifest is out: not when the task ends, nor the run, nor a clear.

    Seen on the real stack (tests/integration/test_openai_api.py, a cancel as the batch
    publishes): read as the manifest landed, then once the run had ended, completed_at moved
    by 7 s and finalizing_at went from None to a time.
    """
    published = datetime.fromtimestamp(CREATED + 20, tz=timezone.utc)
    later = datetime.fromtimestamp(CREATED + 27, tz=timezone.utc)
    reads = [
        BatchDagRun(CONF, "running", ["running"], task_start=T, manifest=MANIFEST, published_at=published),
        BatchDagRun(CONF, "running", ["success"], T, later, manifest=MANIFEST, published_at=published),
        BatchDagRun(CONF, "success", ["success"], T, later, later, MANIFEST, published_at=published),
        # Cleared after it ended: a new try started, and returned the same manifest.
        BatchDagRun(CONF, "success", ["success"], later, later, later, MANIFEST, published_at=published),
    ]
    seen = [batch_object("batch_abcdefab", run, NOW) for run in reads]
    assert {(b["status"], b["completed_at"], b["finalizing_at"]) for b in seen} == {
        ("completed", int(published.timestamp()), int(published.timestamp()))
    }


def test_a_published_batch_started_when_its_publishing_try_did_whatever_try_came_after():
    """in_progress_at of an ended batch is its manifest's time less its duration: a clear's new try does not move it."""
    published = datetime.fromtimestamp(CREATED + 20, tz=timezone.utc)
    later = datetime.fromtimestamp(CREATED + 500, tz=timezone.utc)
    manifest = {**MANIFEST, "duration_s": 8.7}
    reads = [
        BatchDagRun(CONF, "running", ["running"], task_start=T, manifest=manifest, published_at=published),
        BatchDagRun(CONF, "success", ["success"], T, later, later, manifest, published_at=published),
        # Cleared after it ended: a new try started much later, and returned the same manifest.
        BatchDagRun(CONF, "running", ["running"], later, manifest=manifest, published_at=published),
        BatchDagRun(CONF, "success", ["success"], later, later, later, manifest, published_at=published),
    ]
    seen = {batch_object("batch_abcdefab", run, NOW)["in_progress_at"] for run in reads}
    assert seen == {CREATED + 20 - 8}
    # Never before the batch was created (a worker's clock behind the API's).
    early = BatchDagRun(
        CONF, "success", ["success"], T, later, later, {**manifest, "duration_s": 99}, published_at=published
    )
    assert batch_object("batch_abcdefab", early, NOW)["in_progress_at"] == CREATED
