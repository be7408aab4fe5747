"""What counts as progress of vLLM's batch runner, and the stall bound's setting (see engines/stall.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from airflow_vllm_batch.engines import VLLMRunner
from airflow_vllm_batch.engines.stall import StallWatch
from airflow_vllm_batch.exceptions import ConfigurationError

REPORT = "Running batch: {pct}% Completed | {n}/10 [00:04<00:06, 1.00req/s]"
WAITING = "WARNING 11-27 23:00:00 [shm_broadcast.py:1] No available shared memory broadcast block found in 60 seconds."


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_higher_count_in_the_progress_report_is_progress_and_the_same_count_again_is_not():
    clock = Clock()
    watch = StallWatch(10, clock=clock)
    clock.now = 8
    watch.line(REPORT.format(pct=20, n=2))
    clock.now = 17
    watch.line(REPORT.format(pct=20, n=2))  # tqdm's monitor prints a stalled bar again
    assert watch.silent_s() == 9
    assert not watch.stalled()
    clock.now = 18
    assert watch.stalled()
    watch.line(REPORT.format(pct=30, n=3))
    assert watch.silent_s() == 0


def test_vllms_warning_that_it_waits_for_a_hung_process_is_no_progress_and_another_log_line_is():
    clock = Clock()
    watch = StallWatch(10, clock=clock)
    clock.now = 10
    watch.line(WAITING)
    assert watch.stalled()
    watch.line("INFO 11-27 23:00:00 [loader.py:1] Loading weights took 312.40 seconds")
    assert not watch.stalled()


def test_a_change_of_the_local_output_is_progress(tmp_path):
    clock = Clock()
    output = tmp_path / "engine-results.jsonl"
    output.write_bytes(b"an earlier run's output\n")
    watch = StallWatch(10, output=output, clock=clock)
    clock.now = 5
    assert watch.silent_s() == 5  # what was there at the start is no progress
    output.write_bytes(b"")  # the engine truncates it
    clock.now = 6
    assert watch.silent_s() == 0
    with output.open("ab") as f:
        f.write(b'{"custom_id": "a"}\n')
    clock.now = 12
    assert watch.silent_s() == 0
    clock.now = 22
    assert watch.stalled()


@pytest.mark.parametrize("value", [-1, "soon", timedelta(seconds=-5), True])
def test_a_bad_stall_timeout_is_refused_naming_it(value):
    with pytest.raises(ConfigurationError, match="stall_timeout must be"):
        VLLMRunner(stall_timeout=value).check({})


def test_the_stall_bound_defaults_to_30_minutes_from_config_and_0_turns_it_off(monkeypatch):
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__STALL_TIMEOUT", raising=False)
    assert VLLMRunner().rendered().stall_timeout_s == 1800
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__STALL_TIMEOUT", "600")
    assert VLLMRunner().rendered().stall_timeout_s == 600
    assert VLLMRunner(stall_timeout=timedelta(minutes=5)).rendered().stall_timeout_s == 300  # the task's wins
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__STALL_TIMEOUT", "0")
    assert VLLMRunner().rendered().stall_timeout_s is None
    assert VLLMRunner(stall_timeout=0).rendered().stall_timeout_s is None


def test_a_bad_configured_stall_timeout_fails_before_any_engine_naming_the_option(monkeypatch):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__STALL_TIMEOUT", "30m")
    with pytest.raises(
        ConfigurationError, match=r"\[vllm_batch\] stall_timeout must be a number of seconds"
    ) as err:
        VLLMRunner().rendered()
    assert not err.value.retryable
