"""A third engine plugs in through ``register_engine``: no change to the operator or the run layer."""

from __future__ import annotations

import json
from functools import cached_property

import pytest

from airflow_vllm_batch.batchfile import open_lines
from airflow_vllm_batch.engines import _ENGINES, register_engine
from airflow_vllm_batch.engines.base import Engine, EngineJob, EngineResults
from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.engines.vllm.model_names import ServedModels, served_models
from airflow_vllm_batch.engines.base import EngineInfo, EngineRun
from airflow_vllm_batch.engines.vllm.command import FALLBACK_SUPPORTED_URLS
from tests.unit.operators.test_vllm_batch_runs import Batch, FakeTI


class EchoEngine(Engine):
    """Answers every chat request with its own last message, through the run's staging like any engine."""

    name = "echo"
    produced = 0

    @cached_property
    def served(self) -> ServedModels:
        return served_models(self.settings.model)

    def inspect(self) -> EngineInfo:
        return EngineInfo(vllm_version="echo-1", supported_urls=FALLBACK_SUPPORTED_URLS)

    def produce(self, info: EngineInfo, job: EngineJob) -> EngineResults:
        type(self).produced += 1
        path = job.work / "echo.jsonl"
        with job.request_lines() as lines, open(path, "w") as out:
            for raw in lines:
                request = json.loads(raw)
                body = {"choices": [{"message": {"role": "assistant", "content": request["body"]["messages"][-1]["content"]}}]}
                out.write(json.dumps({"id": "e", "custom_id": request["custom_id"], "response": {"status_code": 200, "request_id": "e", "body": body}, "error": None}) + "\n")
        job.lease.ensure_held(verify=True)
        job.staging.put_results(path)
        return EngineResults(
            run=EngineRun(returncode=0, duration_s=0.0, vllm_version=info.vllm_version),
            open_results=lambda: open_lines(str(path)),
            staged_results=True,
        )


@pytest.fixture
def echo():
    register_engine("echo", EchoEngine)
    EchoEngine.produced = 0
    yield EchoEngine
    _ENGINES.pop("echo", None)


def test_a_registered_engine_runs_through_the_operator_unchanged(s3, bucket, tmp_path, echo):
    batch = Batch(s3, bucket, tmp_path)
    manifest = batch.run(engine="echo", engine_command=None)
    assert manifest["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert manifest["vllm_version"] == "echo-1"
    answers = {json.loads(line)["custom_id"]: json.loads(line) for line in batch.get("out/results.jsonl").splitlines()}
    assert answers["r3"]["response"]["body"]["choices"][0]["message"]["content"] == "hi 3"
    # The run layer's resume holds for it too: the same run again does not call the engine.
    assert batch.run(FakeTI(try_number=2), engine="echo", engine_command=None) == manifest
    assert echo.produced == 1


def test_an_unregistered_engine_name_fails_at_parse_time_listing_the_known_ones(s3, bucket, tmp_path):
    batch = Batch(s3, bucket, tmp_path)
    with pytest.raises(ConfigurationError, match=r"engine must be one of \('runner', 'server'"):
        batch.operator(engine="echo")
