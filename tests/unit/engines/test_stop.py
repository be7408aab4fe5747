"""The engines poll a run's stop condition between requests; the server engine reports its counts at each checkpoint."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from airflow_vllm_batch.engines.base import EngineJob, StopPoll
from airflow_vllm_batch.engines.runner import RunnerEngine
from airflow_vllm_batch.engines.server import _CheckpointCounts
from airflow_vllm_batch.exceptions import BatchStopped


def test_the_stop_condition_is_polled_at_most_every_interval_and_a_stop_sticks():
    clock, calls, answer = [0.0], [], [None]

    def stop():
        calls.append(clock[0])
        return answer[0]

    poll = StopPoll(stop, every_s=5, clock=lambda: clock[0])
    assert poll() is None
    assert poll() is None
    assert calls == [0.0]
    clock[0] = 5.0
    answer[0] = "cancelled"
    assert poll() == "cancelled"
    answer[0] = None
    clock[0] = 20.0
    assert poll() == "cancelled"
    assert calls == [0.0, 5.0]


def test_a_stopped_feed_sends_nothing_more():
    seen = []
    poll = StopPoll(lambda: "expired" if len(seen) >= 2 else None, every_s=0)
    seen.extend(poll.lines(iter(range(10))))
    assert seen == [0, 1]
    assert poll.reason == "expired"


def test_no_stop_condition_never_stops():
    assert list(StopPoll(None).lines(iter("abc"))) == ["a", "b", "c"]


def job(**kwargs) -> EngineJob:
    return EngineJob(
        input=None,
        report=None,
        work=None,
        staging=None,
        identity=None,
        lease=None,
        task=None,
        kept_results=None,
        **kwargs,
    )  # type: ignore[arg-type]


def test_a_job_raises_batch_stopped_with_the_reason():
    with pytest.raises(BatchStopped) as stopped:
        job(stop=lambda: "cancelled").raise_if_stopped()
    assert stopped.value.reason == "cancelled"
    assert not stopped.value.retryable
    job().raise_if_stopped()


def _line(cid: str, status: int) -> bytes:
    return (
        json.dumps(
            {
                "custom_id": cid,
                "response": {"status_code": status, "body": {}},
                "error": None if status == 200 else {"message": "x"},
            }
        ).encode()
        + b"\n"
    )


def test_checkpoint_counts_count_each_request_once_with_the_earlier_tries_parts(tmp_path):
    reported = []

    class Staging:
        def open_parts(self, parts):
            import contextlib

            return contextlib.nullcontext(iter([_line("a", 200), _line("b", 400)]))

    counts = _CheckpointCounts(job(on_checkpoint=reported.append), Staging(), ["part-0"])
    part = tmp_path / "part-000001.jsonl"
    part.write_bytes(_line("c", 200) + _line("a", 400) + b"\n")
    counts.add(part)
    assert reported == [{"completed": 2, "failed": 1}]


def test_checkpoint_counts_count_a_request_completed_once_any_part_answers_it_with_a_success(tmp_path):
    # As the results check publishes it: a success over another try's failure, whatever their order.
    reported = []

    class Staging:
        def open_parts(self, parts):
            import contextlib

            return contextlib.nullcontext(iter([_line("a", 500), _line("b", 400)]))

    counts = _CheckpointCounts(job(on_checkpoint=reported.append), Staging(), ["part-0"])
    part = tmp_path / "part-000001.jsonl"
    part.write_bytes(_line("a", 200) + _line("b", 500))
    counts.add(part)
    assert reported == [{"completed": 1, "failed": 1}]


def test_a_failing_progress_report_does_not_fail_the_run(tmp_path):
    def broken(counts):
        raise ConnectionError("S3 is down")

    part = tmp_path / "p.jsonl"
    part.write_bytes(_line("a", 200))
    _CheckpointCounts(job(on_checkpoint=broken), None, []).add(part)


def test_the_runner_is_terminated_when_the_run_must_stop(monkeypatch):
    from airflow_vllm_batch.engines import base

    monkeypatch.setattr(base, "STOP_POLL_S", 0.01)
    terminated = threading.Event()
    engine = RunnerEngine.__new__(RunnerEngine)
    engine.log = SimpleNamespace(warning=lambda *a: None)
    engine.__dict__["hook"] = SimpleNamespace(terminate=terminated.set)
    asked = []
    with engine.stopped_by(
        job(stop=lambda: asked.append(1) or ("expired" if len(asked) >= 3 else None))
    ) as stop:
        assert terminated.wait(5)
    assert stop.reason == "expired"


def test_without_a_stop_condition_the_runner_has_no_watcher():
    engine = RunnerEngine.__new__(RunnerEngine)
    before = threading.active_count()
    with engine.stopped_by(job()) as stop:
        assert threading.active_count() == before
    assert stop.reason is None
