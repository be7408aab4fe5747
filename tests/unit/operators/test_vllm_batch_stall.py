"""Bounded: a wedged runner is stopped after stall_timeout without progress and the try fails as retryable, in seconds.

Real S3 (SeaweedFS) and the runner stand-in (``fake_runner.py``): ``FAKE_ENGINE_WEDGE_AFTER`` answers
that many requests and then wedges (its last progress report again and vLLM's waiting-for-a-hung-process
warning, never an answer); ``FAKE_ENGINE_SLOW`` answers slowly but steadily. Without the stall bound a
wedged engine holds its GPUs until ``execution_timeout`` (here: the test's timeout).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from airflow_vllm_batch.engines.runner import RunnerEngine
from airflow_vllm_batch.exceptions import EngineStalledError
from tests.unit.operators import test_vllm_batch_runner_deaths as deaths
from tests.unit.operators.test_vllm_batch_runner_deaths import VERSIONS, ids, sent, staged
from tests.unit.operators.test_vllm_batch_runs import Batch, FakeTI

#: The stall bound of these tests, in seconds.
BOUND = 1.5


@pytest.fixture
def batch(s3, bucket, tmp_path, monkeypatch) -> Batch:
    monkeypatch.setattr(RunnerEngine, "inspect", deaths._inspect_as_0_33_when_asked)
    return Batch(s3, bucket, tmp_path)


def run(
    batch: Batch, version: str, ti: FakeTI | None = None, stall_timeout: float | None = None, **env: str
) -> dict:
    """The batch on the runner stand-in playing ``version``, with this stall bound (None: the default)."""
    engine_env = {
        "FAKE_ENGINE_VLLM": version,
        "FAKE_ENGINE_SENT": str(batch.calls.with_name("sent.txt")),
        **env,
    }
    return batch.run(ti, env=engine_env, stall_timeout=stall_timeout)


def pid_gone(path) -> bool:
    """Whether the engine whose pid the stand-in wrote is gone (reaped, not a zombie)."""
    pid = int(path.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", VERSIONS)
def test_a_wedged_runner_is_stopped_within_the_bound_and_the_try_fails_as_retryable(batch, version, tmp_path):
    pid = tmp_path / "engine.pid"
    started = time.monotonic()
    with pytest.raises(
        EngineStalledError, match=rf"made no progress for {BOUND:g} s .*raise VLLMRunner\(stall_timeout"
    ) as err:
        run(batch, version, stall_timeout=BOUND, FAKE_ENGINE_WEDGE_AFTER="0", FAKE_ENGINE_PID=str(pid))
    # The bound, a poll, the kill grace and the run's own S3 work on a loaded machine: not the test's 90 s timeout.
    assert time.monotonic() - started < BOUND + 20
    assert err.value.retryable
    assert pid_gone(pid)
    assert not batch.keys("out/results.manifest.json")


@pytest.mark.timeout(60)
def test_a_runner_that_stalls_after_some_answers_keeps_them_for_the_retry(batch, tmp_path):
    # vLLM 0.33 writes its answers as it goes: the three written before the stall are staged as a checkpoint part.
    with pytest.raises(EngineStalledError, match="the 3 answer"):
        run(batch, "0.33", stall_timeout=BOUND, FAKE_ENGINE_WEDGE_AFTER="3")
    assert len(staged(batch, "parts")) == 1
    assert not staged(batch, "deaths")
    manifest = run(batch, "0.33", FakeTI(try_number=2))
    assert manifest["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    # The retry sends only what the stalled engine had not answered.
    assert sent(batch) == [ids(0, 1, 2, 3, 4), ids(3, 4)]
    assert sorted(
        r["custom_id"] for r in map(json.loads, batch.get("out/results.jsonl").splitlines())
    ) == ids(0, 1, 2, 3, 4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", VERSIONS)
def test_a_slow_but_steady_runner_is_not_stopped(batch, version):
    # Five answers 0.6 s apart: 3 s in all, twice the bound, but never a bound without progress.
    manifest = run(batch, version, stall_timeout=BOUND, FAKE_ENGINE_SLOW="0.6")
    assert manifest["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert len(sent(batch)) == 1


@pytest.mark.timeout(60)
def test_no_stall_bound_with_stall_timeout_0(batch):
    # 0 turns the bound off: a runner slower than any short bound is left alone.
    manifest = run(batch, "0.32", stall_timeout=0, FAKE_ENGINE_SLOW="0.3")
    assert manifest["request_counts"]["completed"] == 5
