"""The runner engine when its engine dies mid-run, as vLLM 0.32 and 0.33 report it, in seconds.

Real S3 (SeaweedFS) and the runner stand-in (``fake_runner.py``): ``FAKE_ENGINE_VLLM`` picks
how a death is reported (0.32: exit 0 with engine-dead 500 lines, written at the end; 0.33:
the answers written so far, in input order, then exit 1 with ``EngineDeadError``).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from airflow_vllm_batch.engines import runner as runner_module
from airflow_vllm_batch.engines.runner import RunnerEngine
from airflow_vllm_batch.exceptions import EngineError
from tests.unit.operators.test_vllm_batch_runs import Batch, FakeTI, chat_lines

VERSIONS = ["0.32", "0.33"]


@pytest.fixture
def batch(s3, bucket, tmp_path, monkeypatch) -> Batch:
    monkeypatch.setattr(RunnerEngine, "inspect", _inspect_as_0_33_when_asked)
    return Batch(s3, bucket, tmp_path)


def _inspect_as_0_33_when_asked(self):
    """The probe's answer for a custom command, with 0.33's --max-inflight when the stand-in plays 0.33."""
    info = RunnerEngine.__mro__[1].inspect(self)
    if self.options.env.get("FAKE_ENGINE_VLLM") == "0.33":
        info = dataclasses.replace(info, runner_options=frozenset({"output_tmp_dir", "max_inflight"}))
    return info


def sent(batch: Batch) -> list[list[str]]:
    """The custom_ids each engine start was given."""
    path = batch.calls.with_name("sent.txt")
    return [line.split(",") for line in path.read_text().splitlines()] if path.exists() else []


def run(batch: Batch, version: str, ti: FakeTI | None = None, **env: str) -> dict:
    engine_env = {
        "FAKE_ENGINE_VLLM": version,
        "FAKE_ENGINE_SENT": str(batch.calls.with_name("sent.txt")),
        **env,
    }
    # A request answered as failed must not fail the task here: max_failed_ratio is the user's call.
    return batch.run(ti, env=engine_env, max_failed_ratio=0.5)


def ids(*numbers: int) -> list[str]:
    return [f"r{i}" for i in numbers]


def staged(batch: Batch, kind: str) -> list[str]:
    return [k for k in batch.keys("out/results.jsonl.staging/") if f"/{kind}/" in k]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_runner_that_dies_midway_has_its_answers_staged_and_only_the_rest_runs_again(batch, version):
    manifest = run(batch, version, FAKE_ENGINE_DIES_AFTER="3")
    assert manifest["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    # The second start gets only what the first did not answer: nothing is computed twice.
    assert sent(batch) == [ids(0, 1, 2, 3, 4), ids(3, 4)]
    assert sorted(
        r["custom_id"] for r in map(json.loads, batch.get("out/results.jsonl").splitlines())
    ) == ids(0, 1, 2, 3, 4)
    assert not staged(batch, "parts")
    assert not staged(batch, "deaths")


@pytest.mark.parametrize("version", VERSIONS)
def test_a_transient_death_before_any_answer_has_the_next_starts_answers_staged_and_published(
    batch, version, tmp_path
):
    # The real engine showed it: killed at once, then the suspects' isolated run lives.
    manifest = run(batch, version, FAKE_ENGINE_DIES_AFTER="0", FAKE_ENGINE_DIES_ONCE=str(tmp_path / "died"))
    assert manifest["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert sent(batch) == [ids(0, 1, 2, 3, 4), ids(0, 1, 2, 3, 4)]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_retry_after_a_death_sends_only_what_no_checkpoint_answers(batch, version, monkeypatch):
    monkeypatch.setattr(runner_module, "MAX_STARTS_PER_TRY", 1)
    with pytest.raises(EngineError, match=r"died in this try and was started 1 time\(s\)") as err:
        run(batch, version, FAKE_ENGINE_DIES_AFTER="3")
    assert err.value.retryable
    assert len(staged(batch, "parts")) == 1
    assert len(staged(batch, "deaths")) == 1
    assert not batch.keys("out/results.manifest.json")
    manifest = run(batch, version, FakeTI(try_number=2))
    assert manifest["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert sent(batch)[1] == ids(3, 4)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_retry_counts_requests_not_answers_when_two_tries_parts_answer_the_same_requests(
    batch, version, monkeypatch
):
    # Simulator seed 2169 (at fdc20fc): 13 answers of 7 requests in the parts were taken for all 10 requests;
    # every try then published nothing and skipped the engine, so the task could never finish (fix 5, in the runner).
    monkeypatch.setattr(runner_module, "MAX_STARTS_PER_TRY", 1)
    with pytest.raises(EngineError):
        run(batch, version, FAKE_ENGINE_DIES_AFTER="3")
    (part,) = staged(batch, "parts")
    token = part.rsplit("-", 1)[1].removesuffix(".jsonl")
    for other in ("0000aaaa", "0000bbbb"):  # zombies' parts that answered the same three requests
        batch.put(part.replace(token, other), batch.get(part))
    manifest = run(batch, version, FakeTI(try_number=2))
    assert manifest["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert sent(batch)[1] == ids(3, 4)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_request_that_kills_the_engine_is_answered_as_engine_crash_and_the_rest_completes(batch, version):
    batch.put("in/input.jsonl", chat_lines(12))
    manifest = run(batch, version, FAKE_ENGINE_KILLER="r5")
    assert manifest["request_counts"] == {"total": 12, "completed": 11, "failed": 1}
    assert manifest["failed_by_reason"] == {"engine_crash": 1}
    (failed,) = map(json.loads, batch.get("out/results.errors.jsonl").splitlines())
    assert failed["custom_id"] == "r5"
    assert failed["error"]["code"] == "engine_crash"
    assert failed["error"]["line"] == 6
    # 1: all, dies in the group r4-r7; 2: its suspects alone, one at a time, dies at r5; 3: the rest.
    assert sent(batch) == [ids(*range(12)), ids(*range(4, 12)), ids(*range(6, 12))]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_isolated_run_bounds_what_is_in_flight_with_the_runners_own_flag(batch, version, capfd):
    batch.put("in/input.jsonl", chat_lines(12))
    run(batch, version, FAKE_ENGINE_KILLER="r5")
    out = capfd.readouterr().out
    expected, other = (
        ("--max-inflight 1", "--max-num-seqs 1")
        if version == "0.33"
        else ("--max-num-seqs 1", "--max-inflight 1")
    )
    assert expected in out
    assert other not in out


@pytest.mark.parametrize("version", VERSIONS)
def test_a_request_that_kills_the_engine_on_every_try_is_answered_as_failed_by_the_third_try(
    batch, version, monkeypatch
):
    monkeypatch.setattr(runner_module, "MAX_STARTS_PER_TRY", 1)
    batch.put("in/input.jsonl", chat_lines(12))
    for try_number in (1, 2):
        with pytest.raises(EngineError):
            run(batch, version, FakeTI(try_number=try_number), FAKE_ENGINE_KILLER="r5")
    manifest = run(batch, version, FakeTI(try_number=3), FAKE_ENGINE_KILLER="r5")
    assert manifest["request_counts"] == {"total": 12, "completed": 11, "failed": 1}
    assert manifest["failed_by_reason"] == {"engine_crash": 1}


def test_a_non_zero_exit_before_any_output_is_the_trys_failure_and_records_no_death(batch):
    with pytest.raises(EngineError, match="exited with code 3; nothing was published"):
        run(batch, "0.33", FAKE_ENGINE_EXIT="3")
    assert not staged(batch, "parts")
    assert not staged(batch, "deaths")


def test_an_error_that_only_mentions_enginecore_is_an_answer_not_a_death(batch):
    # A model's own error text may say "EngineCore"; only vLLM's dead-engine error is a death.
    manifest = run(
        batch, "0.32", FAKE_ENGINE_FAIL="1", FAKE_ENGINE_FAIL_MESSAGE="EngineCore busy: request rejected"
    )
    assert manifest["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
    assert len(sent(batch)) == 1
