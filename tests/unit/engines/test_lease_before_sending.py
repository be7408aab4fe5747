"""A try reads the lease after its reads of staging and before its engine sends anything (Durability, Fencing).

A try paused between reading the staging and starting its engine (a zombie) may find, when it
wakes, that its successor took the lease over and staged answers it never read: it must send
nothing (the simulator's seeds 6820, 12992 for the server and 17716, 18186 for the runner).
"""

from __future__ import annotations

import logging
from pathlib import Path
from unittest import mock

import pytest

from airflow_vllm_batch.engines.base import EngineInfo
from airflow_vllm_batch.engines.options import VLLMRunner, WarmVLLMServer
from airflow_vllm_batch.engines.runner import RunnerEngine
from airflow_vllm_batch.engines.server import ConnectionEngine
from airflow_vllm_batch.exceptions import OutputBusyError
from airflow_vllm_batch.lease import TaskTry
from airflow_vllm_batch.run.settings import BatchSettings


def _taken_over_lease() -> mock.Mock:
    """A lease whose heartbeat has not noticed yet; reading it from S3 shows another try holds it."""

    def ensure_held(verify: bool = False) -> None:
        if verify:
            raise OutputBusyError("run-1/try-3 took over the lease")

    return mock.Mock(ensure_held=mock.Mock(side_effect=ensure_held))


def _job(tmp_path: Path) -> mock.Mock:
    staging = mock.Mock()
    staging.list_parts.return_value = []
    staging.has_results.return_value = False
    staging.read_deaths.return_value = []
    job = mock.MagicMock(
        staging=staging,
        lease=_taken_over_lease(),
        work=tmp_path,
        kept_results=tmp_path / "kept.jsonl",
        task=TaskTry(dag_id="d", run_id="r", task_id="t"),
    )
    job.report.valid_lines = 2
    job.report.needs_rewrite = False
    job.input.in_s3 = False
    job.input.uri = str(tmp_path / "in.jsonl")
    return job


def test_a_runner_try_that_lost_its_lease_since_reading_staging_starts_no_engine(tmp_path):
    settings = BatchSettings.from_rendered(
        input_uri="s3://b/in.jsonl", output_uri="s3://b/out/results.jsonl", model="m", engine=VLLMRunner()
    )
    engine = RunnerEngine(settings, logging.getLogger(__name__))
    engine.__dict__["hook"] = hook = mock.Mock()
    hook.run.side_effect = AssertionError("the engine started although the lease was taken over")
    with (
        mock.patch.object(RunnerEngine, "engine_arguments", return_value=[]),
        mock.patch.object(RunnerEngine, "leased_gpus", return_value=mock.MagicMock()),
        pytest.raises(OutputBusyError),
    ):
        engine.produce(EngineInfo("0.32.0", frozenset({"/v1/chat/completions"})), _job(tmp_path))
    hook.run.assert_not_called()


def test_a_server_try_that_lost_its_lease_since_reading_the_parts_sends_no_request(tmp_path):
    settings = BatchSettings.from_rendered(
        input_uri="s3://b/in.jsonl",
        output_uri="s3://b/out/results.jsonl",
        model="m",
        engine=WarmVLLMServer(conn_id="c"),
    )
    engine = ConnectionEngine(settings, logging.getLogger(__name__))
    engine.__dict__["server"] = server = mock.Mock()
    server.run.side_effect = AssertionError("requests were sent although the lease was taken over")
    with mock.patch.object(ConnectionEngine, "before_stream"), pytest.raises(OutputBusyError):
        engine.produce(EngineInfo("0.32.0", frozenset({"/v1/chat/completions"})), _job(tmp_path))
    server.run.assert_not_called()
