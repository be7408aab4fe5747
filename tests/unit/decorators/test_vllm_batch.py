"""``@task.vllm_batch``: the function's return value is the requests, the task's is the manifest (real S3, the engine stand-in)."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone

import pytest

from airflow_vllm_batch.decorators.vllm_batch import _VLLMBatchDecoratedOperator, vllm_batch_task
from airflow_vllm_batch.engines import VLLMRunner
from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.get_provider_info import get_provider_info
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.operators.test_vllm_batch_runs import FAKE_RUNNER, Batch, FakeTI


@pytest.fixture
def batch(s3, bucket, tmp_path) -> Batch:
    return Batch(s3, bucket, tmp_path)


def _decorated(batch: Batch, function, *args, **settings) -> _VLLMBatchDecoratedOperator:
    """The task ``function`` decorated with the stand-in engine's settings makes in a DAG, called with ``args``."""
    from airflow.sdk import DAG

    defaults = {
        "task_id": "vllm_batch",
        "output_uri": batch.output_uri,
        "model": "m",
        "engine": VLLMRunner(
            command=[sys.executable, str(FAKE_RUNNER)], env={"FAKE_ENGINE_CALLS": str(batch.calls)}
        ),
        "results_dir": str(batch.results_dir),
    }
    with DAG("taskflow", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
        vllm_batch_task(**{**defaults, **settings})(function)(*args)
    (task,) = dag.tasks
    return task


def _run(task: _VLLMBatchDecoratedOperator) -> dict:
    return task.execute({"ti": FakeTI(), "outlet_events": {}})


def _written_requests(batch: Batch) -> list[dict]:
    (key,) = [k for k in batch.keys("out/") if k.startswith("out/results.requests/")]
    return [json.loads(line) for line in batch.get(key).splitlines()]


def test_the_provider_registers_the_decorator_as_task_vllm_batch():
    from airflow.sdk import task

    (entry,) = get_provider_info()["task-decorators"]
    assert entry == {
        "class-name": "airflow_vllm_batch.decorators.vllm_batch.vllm_batch_task",
        "name": "vllm_batch",
    }
    assert task.vllm_batch is vllm_batch_task


def test_the_functions_return_value_is_run_as_the_requests_and_the_task_returns_the_manifest(batch):
    def classify(reviews: list[str]) -> list[list[dict]]:
        return [[{"role": "system", "content": "One word."}, {"role": "user", "content": r}] for r in reviews]

    task = _decorated(batch, classify, ["good", "bad"], default_body={"max_completion_tokens": 4})
    manifest = _run(task)
    assert manifest["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    lines = _written_requests(batch)
    assert manifest["input_uri"].endswith(".jsonl")
    assert "/out/results.requests/" in manifest["input_uri"]
    assert [
        (x["custom_id"], x["body"]["messages"][1]["content"], x["body"]["max_completion_tokens"])
        for x in lines
    ] == [
        ("request-0", "good", 4),
        ("request-1", "bad", 4),
    ]
    assert batch.engine_runs == 1


def test_a_prompt_that_looks_like_a_template_is_sent_as_written(batch):
    task = _decorated(batch, lambda: ["Explain {{ ds }} in Jinja"])
    task.render_template_fields({"ds": "2026-11-21", "run_id": "r"})
    _run(task)
    assert _written_requests(batch)[0]["body"]["messages"][0]["content"] == "Explain {{ ds }} in Jinja"


def test_the_operators_settings_are_rendered_as_usual(batch):
    task = _decorated(batch, lambda: ["hi"], output_uri=f"s3://{batch.bucket}/out/{{{{ ds }}}}.jsonl")
    task.render_template_fields({"ds": "2026-11-21", "run_id": "r"})
    assert task.output_uri == f"s3://{batch.bucket}/out/2026-11-21.jsonl"


def test_the_engines_options_are_rendered_too(batch):
    engine = VLLMRunner(
        command=[sys.executable, str(FAKE_RUNNER)], args=["--max-model-len", "{{ params.len }}"]
    )
    task = _decorated(batch, lambda: ["hi"], engine=engine)
    task.render_template_fields({"params": {"len": "64"}, "run_id": "r"})
    assert task.engine.args == ["--max-model-len", "64"]
    assert engine.args == ["--max-model-len", "{{ params.len }}"]  # the DAG file's object is left as written


@pytest.mark.parametrize("returned", ["one prompt", {"custom_id": "a"}, None, 3])
def test_a_function_that_returns_no_list_fails_without_retry_naming_it_and_starts_no_engine(batch, returned):
    def prompts():
        return returned

    with pytest.raises(
        AirflowFailException, match=r"@task.vllm_batch function 'prompts' must return the requests: a list"
    ):
        _run(_decorated(batch, prompts))
    assert batch.engine_runs == 0
    assert batch.keys("out/") == []


def test_an_empty_list_fails_without_retry_naming_the_function(batch):
    def prompts() -> list[str]:
        return []

    with pytest.raises(
        AirflowFailException, match="function 'prompts' returned no requests: there is nothing to run"
    ):
        _run(_decorated(batch, prompts))
    assert batch.engine_runs == 0


@pytest.mark.parametrize("given", [{"requests": ["a"]}, {"input_uri": "s3://b/in.jsonl"}])
def test_requests_or_an_input_file_given_to_the_decorator_fail_at_parse_time(batch, given):
    with pytest.raises(ConfigurationError, match="takes its requests from the function's return value"):
        _decorated(batch, lambda: ["a"], **given)


def test_the_manifest_is_one_xcom_whatever_the_functions_annotation(batch):
    def bodies() -> dict:  # a wrong annotation must not unroll the manifest into XComs
        return [{"messages": [{"role": "user", "content": "x"}]}]

    assert _decorated(batch, bodies).multiple_outputs is False


def test_a_retry_calls_the_function_again_and_the_same_requests_resume_the_same_run(batch):
    # Each try is a new operator object (a new task process), as in Airflow.
    first = _decorated(batch, lambda: ["a", "b"]).execute({"ti": FakeTI(), "outlet_events": {}})
    again = _decorated(batch, lambda: ["a", "b"]).execute({"ti": FakeTI(try_number=2), "outlet_events": {}})
    assert again["fingerprint"] == first["fingerprint"]
    assert batch.engine_runs == 1
