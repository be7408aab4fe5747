"""VLLMBatchOperator against real S3 and a real engine process: bad input, skips, engine faults.

Fresh processes: ``VLLMRunner`` is the task's own child process, one per run; the fail-fast tests
check that none starts.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone

import pytest

from airflow_vllm_batch.engines import VLLMRunner
from tests.integration.dagrun import DagRunResult, register_dag, run_dag
from vllm_batch_embedded.demo import BUCKET

pytestmark = pytest.mark.integration


def _line(custom_id: str, model: str, **body) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def _put(seaweed, key: str, text: str) -> str:
    seaweed.client().put_object(Bucket=BUCKET, Key=key, Body=text.encode())
    return f"s3://{BUCKET}/{key}"


def _keys(seaweed, prefix: str) -> list[str]:
    listed = seaweed.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"][len(prefix) :] for o in listed)


def _read(seaweed, key: str) -> list[dict]:
    body = seaweed.client().get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def _seconds_between(log: str, first: str, then: str) -> float:
    """Seconds between the first log line containing ``first`` and the next containing ``then``."""
    stamps = {}
    for line in log.splitlines():
        for marker in (first, then):
            if marker in line and marker not in stamps and (marker == first or first in stamps):
                stamps[marker] = datetime.fromisoformat(line.split()[0].replace("Z", "+00:00"))
    return (stamps[then] - stamps[first]).total_seconds()


def _run_operator(name: str, **op_kwargs) -> DagRunResult:
    from airflow.sdk import DAG

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    with DAG(f"op_{name}", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
        VLLMBatchOperator(task_id="vllm_batch", **op_kwargs)
    register_dag(dag)
    return run_dag(dag)


def test_one_bad_line_fails_in_seconds_naming_the_line_and_starting_no_engine(
    embedded, airflow_db, tiny_model
):
    model = str(tiny_model)
    text = "\n".join(
        [
            _line("a", model),
            _line("b", model),
            '{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "'
            + model
            + '"}}',
        ]
    )
    uri = _put(embedded, "bad/input.jsonl", text + "\n")
    started = time.monotonic()
    result = _run_operator(
        "bad_line", input_uri=uri, output_uri=f"s3://{BUCKET}/bad/results.jsonl", model=model
    )
    elapsed = time.monotonic() - started
    assert result.state == "failed"
    assert "line 3 (custom_id 'c')" in result.output
    assert "messages" in result.output
    assert "Starting the vLLM engine" not in result.output
    # The task itself, from the runner's "Task started" to its failure (dag.test's own
    # in-process set-up before it is not the operator's time).
    assert _seconds_between(result.output, "Task started", "Task failed with exception") < 5
    # dag.test's own start-up included: only a guard against a hang (24 s once, beside a chaos
    # campaign on the two cores); the operator's claim is the task's bound above.
    assert elapsed < 60
    assert _keys(embedded, "bad/") == ["input.jsonl"]


@pytest.mark.engine
def test_skip_mode_on_a_local_file_runs_the_valid_lines_and_files_the_invalid_ones_with_reasons(
    embedded, airflow_db, tiny_model, tmp_path
):
    model = str(tiny_model)
    lines = [
        _line("ok-1", model),
        '{"custom_id": "broken", "method": "POST", "url": "/v1/chat/completions", "body": ',
        _line("ok-2", "some-other-name"),  # rewritten to `model`
        _line("get", model).replace('"POST"', '"GET"'),
        _line("ok-3", model, max_completion_tokens=3),
    ]
    local_input = tmp_path / "input.jsonl"  # a file on the worker, read by the engine directly
    local_input.write_text("\n".join(lines))  # no final newline
    uri = str(local_input)
    result = _run_operator(
        "skip",
        input_uri=uri,
        output_uri=f"s3://{BUCKET}/skip/results.jsonl",
        model=model,
        invalid_lines="skip",
        rewrite_model=True,
        default_body={"max_completion_tokens": 5},
        max_failed_ratio=0.5,
        engine=VLLMRunner(args=["--enforce-eager", "--max-model-len", "512"]),
    )
    assert result.state == "success", result.output[-3000:]
    manifest = result.xcom("vllm_batch")
    assert manifest["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    assert manifest["error_uri"] == f"s3://{BUCKET}/skip/results.errors.jsonl"
    results = _read(embedded, "skip/results.jsonl")
    assert sorted(r["custom_id"] for r in results) == ["ok-1", "ok-2", "ok-3"]
    tokens = {r["custom_id"]: r["response"]["body"]["usage"]["completion_tokens"] for r in results}
    assert tokens["ok-3"] <= 3
    assert tokens["ok-1"] <= 5
    errors = _read(embedded, "skip/results.errors.jsonl")
    assert len(errors) == 2
    assert [e["error"]["line"] for e in errors] == [2, 4]
    assert errors[1]["custom_id"] == "get"
    assert "POST" in errors[1]["error"]["message"]
    assert "not valid JSON" in errors[0]["error"]["message"]
    assert _keys(embedded, "skip/") == [
        "results.errors.jsonl",
        "results.jsonl",
        "results.manifest.json",
    ]


def test_engine_killed_by_sigkill_fails_the_task_and_publishes_nothing(embedded, airflow_db, tiny_model):
    uri = _put(embedded, "killed/input.jsonl", _line("a", str(tiny_model)) + "\n")
    suicide = [
        sys.executable,
        "-c",
        "import os, signal; print('engine up', flush=True); os.kill(os.getpid(), signal.SIGKILL)",
    ]
    result = _run_operator(
        "killed",
        input_uri=uri,
        output_uri=f"s3://{BUCKET}/killed/results.jsonl",
        model=str(tiny_model),
        engine=VLLMRunner(command=suicide),
    )
    assert result.state == "failed"
    assert "killed by signal 9" in result.output
    assert _keys(embedded, "killed/") == ["input.jsonl"]


def test_engine_that_exits_0_without_output_fails_the_task(embedded, airflow_db, tiny_model):
    uri = _put(embedded, "silent/input.jsonl", _line("a", str(tiny_model)) + "\n")
    result = _run_operator(
        "silent",
        input_uri=uri,
        output_uri=f"s3://{BUCKET}/silent/results.jsonl",
        model=str(tiny_model),
        engine=VLLMRunner(command=[sys.executable, "-c", "print('Failed to upload data (attempt 5)')"]),
    )
    assert result.state == "failed"
    assert "wrote no output" in result.output
    assert _keys(embedded, "silent/") == ["input.jsonl"]


def _try_number(result: DagRunResult, dag_id: str, task_id: str = "vllm_batch") -> int:
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        return session.scalar(
            select(TaskInstance.try_number).where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == result.run_id,
                TaskInstance.task_id == task_id,
            )
        )


def _mixed_endpoints(model: str) -> str:
    embed = json.dumps(
        {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"model": model, "input": "x"}}
    )
    return _line("c", model) + "\n" + embed + "\n"


# Each: what the user got wrong -> the fragment the task's error must show. With the real
# engine environment (probe, model check, engine argument parser), so a case that slipped
# past these checks would start an engine and be caught by the assertions.
MISTAKES = [
    (
        "runner_args_bad_value",
        {"engine": VLLMRunner(args=["--enforce-eager", "--max-model-len", "abc"])},
        None,
        "VLLMRunner(args=...): argument --max-model-len",
    ),
    (
        "runner_args_unknown",
        {"engine": VLLMRunner(args=["--no-such-flag"])},
        None,
        "VLLMRunner(args=...): unrecognized arguments: --no-such-flag. Fix args",
    ),
    (
        "model_dir_missing",
        {"model": "/nonexistent/model-dir"},
        None,
        "model: the local model directory '/nonexistent/model-dir'",
    ),
    (
        "chat_and_embeddings_for_a_chat_model",
        {},
        _mixed_endpoints,
        "is a generation model; /v1/embeddings needs a pooling model",
    ),
    ("temperature_hot", {}, lambda m: _line("c", m, temperature="hot") + "\n", '"body.temperature"'),
    (
        "max_completion_tokens_negative",
        {},
        lambda m: _line("c", m, max_completion_tokens=-5) + "\n",
        '"body.max_completion_tokens" is -5',
    ),
    ("missing_input_key", {"input_uri": f"s3://{BUCKET}/mistakes/typo.jsonl"}, None, "does not exist"),
    (
        "error_uri_local_path",
        {"error_uri": "/tmp/errors.jsonl"},
        None,
        "error_uri must be an s3://bucket/key URI",
    ),
    (
        "missing_output_bucket",
        {"output_uri": "s3://no-such-output-bucket/r.jsonl"},
        None,
        "output_uri: bucket 'no-such-output-bucket' does not exist",
    ),
    (
        "max_failed_ratio_not_a_number",
        {"max_failed_ratio": "abc"},
        None,
        "max_failed_ratio must be a number from 0 to 1",
    ),
]


@pytest.mark.engine
@pytest.mark.parametrize(("name", "kwargs", "lines", "fragment"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_fails_once_naming_the_fix_and_starts_no_engine(
    embedded, airflow_db, tiny_model, name, kwargs, lines, fragment
):
    from datetime import timedelta

    model = str(tiny_model)
    text = lines(model) if lines else _line("c", model) + "\n"
    args = {
        "input_uri": _put(embedded, f"mistakes/{name}/input.jsonl", text),
        "output_uri": f"s3://{BUCKET}/mistakes/{name}/results.jsonl",
        "model": model,
        "engine": VLLMRunner(args=["--enforce-eager"]),
        # A retryable error would show as a second try.
        "retries": 1,
        "retry_delay": timedelta(0),
        **kwargs,
    }
    result = _run_operator(f"mistake_{name}", **args)
    assert result.state == "failed"
    assert fragment in result.output, result.output[-3000:]
    if name.startswith("runner_args"):
        # vLLM's parser checks them in the engine's own process (its one import of vLLM), which stops
        # before it loads the model (issue 26 item 2): no model, no GPU memory taken. Once an engine on
        # this worker kept its parser's flags, an unknown flag is refused before any engine starts.
        assert (
            "stopping before the model loads" in result.output
            or "Starting the vLLM engine" not in result.output
        )
        assert "Loading safetensors checkpoint shards" not in result.output
        assert "Starting to load model" not in result.output
    else:
        assert "Starting the vLLM engine" not in result.output
    assert _try_number(result, f"op_mistake_{name}") == 1


def test_requests_from_a_mapped_task_fail_once_saying_to_flatten_them(embedded, airflow_db, tiny_model):
    """Airflow hands a mapped task's outputs over as one list per map index: not taken as requests by guess."""
    from datetime import timedelta

    from airflow.sdk import DAG, task

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    with DAG(
        "op_mapped_requests", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)
    ) as dag:

        @task
        def prompts(n: int) -> list[str]:
            return [f"prompt {n}.{i}" for i in range(2)]

        VLLMBatchOperator(
            task_id="vllm_batch",
            requests=prompts.expand(n=[1, 2]),
            output_uri=f"s3://{BUCKET}/mapped-requests/results.jsonl",
            model=str(tiny_model),
            retries=1,
            retry_delay=timedelta(0),
        )
    register_dag(dag)
    result = run_dag(dag)
    assert result.state == "failed"
    assert "requests[0] is list ['prompt 1.0', 'prompt 1.1']" in result.output, result.output[-3000:]
    assert "flatten it in a task first" in result.output
    assert "Starting the vLLM engine" not in result.output
    assert _try_number(result, "op_mapped_requests") == 1
    assert _keys(embedded, "mapped-requests/") == []


@pytest.mark.engine
def test_a_gzip_input_runs_and_the_engine_reads_an_uncompressed_copy(embedded, airflow_db, tiny_model):
    import gzip

    model = str(tiny_model)
    text = "".join(_line(f"g{i}", model, max_completion_tokens=2) + "\n" for i in range(3))
    embedded.client().put_object(Bucket=BUCKET, Key="gzip/input.jsonl.gz", Body=gzip.compress(text.encode()))
    result = _run_operator(
        "gzip",
        input_uri=f"s3://{BUCKET}/gzip/input.jsonl.gz",
        output_uri=f"s3://{BUCKET}/gzip/results.jsonl",
        model=model,
        engine=VLLMRunner(args=["--enforce-eager"]),
    )
    assert result.state == "success", result.output[-3000:]
    assert "The engine reads the cleaned copy" in result.output
    assert sorted(r["custom_id"] for r in _read(embedded, "gzip/results.jsonl")) == ["g0", "g1", "g2"]


@pytest.mark.engine
def test_the_runner_gets_only_the_requests_the_answer_cache_does_not_hold(embedded, airflow_db, tiny_model):
    """One runner start: the cache is filled beforehand under the very prefix and keys the run computes."""
    import logging
    import uuid

    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from airflow_vllm_batch.batchfile.cache_keys import request_key
    from airflow_vllm_batch.engines import make_engine
    from airflow_vllm_batch.lease import TaskTry
    from airflow_vllm_batch.run import AnswerCacheOptions, BatchRun, BatchSettings

    model = str(tiny_model)
    cache_uri = f"s3://{BUCKET}/answer-cache-runner/cache-{uuid.uuid4().hex[:8]}/"
    # a1..a3 share one body ("Say hi"), whose answer the cache holds; a0 (with a seed) is a miss.
    text = "".join(
        _line(f"a{i}", model, temperature=0, max_completion_tokens=2, **({"seed": 5} if i == 0 else {}))
        + "\n"
        for i in range(4)
    )
    kwargs = {
        "input_uri": _put(embedded, "answer-cache-runner/input.jsonl", text),
        "output_uri": f"s3://{BUCKET}/answer-cache-runner/results.jsonl",
        "model": model,
        "engine": VLLMRunner(args=["--enforce-eager"]),
        "answer_cache_uri": cache_uri,
    }
    settings = BatchSettings.from_rendered(**kwargs)
    log = logging.getLogger("test")
    engine = make_engine(settings, log)
    cache = BatchRun(
        settings, s3_hook=S3Hook(), engine=engine, task=TaskTry(dag_id="d", run_id="r", task_id="t"), log=log
    ).answer_cache(engine.inspect())
    assert cache is not None
    body = json.loads(_line("a1", model, temperature=0, max_completion_tokens=2))["body"]
    key = request_key(cache.model_digest, "/v1/chat/completions", json.dumps(body).encode())
    stored = json.dumps(
        {
            "id": "cached-1",
            "custom_id": "a1",
            "response": {
                "status_code": 200,
                "request_id": "r",
                "body": {
                    "id": "c",
                    "object": "chat.completion",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "from the cache"},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
                },
            },
            "error": None,
        },
        separators=(",", ":"),
    )
    embedded.client().put_object(
        Bucket=BUCKET,
        Key=f"{cache_uri.removeprefix(f's3://{BUCKET}/')}{cache.model_digest}/{key[0]}/seed.tsv",
        Body=f"{key}\t{stored}\n".encode(),
    )
    operator_kwargs = {k: v for k, v in kwargs.items() if k != "answer_cache_uri"}
    result = _run_operator(
        "answer_cache_runner", **operator_kwargs, answer_cache=AnswerCacheOptions(uri=cache_uri)
    )
    assert result.state == "success", result.output[-3000:]
    assert "3 of 4 requests answered from the cache" in result.output
    assert "The engine reads the cleaned copy" in result.output
    manifest = result.xcom("vllm_batch")
    assert manifest["from_cache"] == 3
    assert manifest["request_counts"] == {
        "total": 4,
        "completed": 4,
        "failed": 0,
    }
    lines = {line["custom_id"]: line for line in _read(embedded, "answer-cache-runner/results.jsonl")}
    assert [lines[f"a{i}"]["id"] for i in (1, 2, 3)] == ["cached-1"] * 3
    assert lines["a0"]["id"] != "cached-1"  # the runner answered the miss
    raw = embedded.client().get_object(Bucket=BUCKET, Key="answer-cache-runner/results.jsonl")["Body"].read()
    assert stored.encode() in raw.splitlines()  # a1's answer byte for byte


@pytest.mark.engine
def test_a_misspelled_engine_flag_after_one_check_on_the_worker_fails_in_seconds_with_did_you_mean(
    embedded, airflow_db, tiny_model, tmp_path
):
    model = str(tiny_model)
    common = {
        "input_uri": _put(embedded, "misspelled/input.jsonl", _line("c", model) + "\n"),
        "model": model,
        "results_dir": str(tmp_path),
    }
    # The first check on this worker imports vLLM's parser (seconds to tens of seconds) and keeps its flags.
    first = _run_operator(
        "misspelled_first",
        output_uri=f"s3://{BUCKET}/misspelled/a.jsonl",
        engine=VLLMRunner(args=["--max-model-len", "abc"]),
        **common,
    )
    assert first.state == "failed"
    assert "VLLMRunner(args=...): argument --max-model-len" in first.output
    second = _run_operator(
        "misspelled_second",
        output_uri=f"s3://{BUCKET}/misspelled/b.jsonl",
        engine=VLLMRunner(args=["--max-modle-len", "64"]),
        **common,
    )
    assert second.state == "failed"
    assert (
        "unrecognized arguments: --max-modle-len (did you mean --max-model-len for --max-modle-len?)"
        in second.output
    )
    assert _seconds_between(second.output, "Task started", "Task failed with exception") < 5


def test_the_engines_templated_options_render_in_a_real_dag_run_and_show_in_the_rendered_fields(
    embedded, airflow_db, tmp_path
):
    """dag.test() renders the options' template_fields (a nested object of ``engine``); the stored view shows them, the secret masked."""
    from pathlib import Path

    fake_runner = Path(__file__).resolve().parents[1] / "unit" / "operators" / "fake_runner.py"
    uri = _put(embedded, "rendered-engine/input.jsonl", _line("a", "m") + "\n")
    engine = VLLMRunner(
        command=[sys.executable, str(fake_runner)],
        args=["--max-model-len", "{{ params.max_len }}", "--hf-token", "{{ params.token }}"],
        env={"FAKE_ENGINE_CALLS": str(tmp_path / "calls.txt"), "RUN_MARKER": "{{ run_id }}"},
    )
    result = _run_operator(
        "rendered_engine",
        input_uri=uri,
        output_uri=f"s3://{BUCKET}/rendered-engine/results.jsonl",
        model="m",
        engine=engine,
        params={"max_len": "64", "token": "hf_RenderedInARealRun1"},
    )
    assert result.state == "success", result.output[-3000:]
    shown = result.rendered["vllm_batch"]["engine"]
    assert shown["engine"] == "VLLMRunner"
    assert shown["args"] == ["--max-model-len", "64", "--hf-token", "***"]
    assert shown["env"]["RUN_MARKER"].startswith("manual__")
    assert "hf_RenderedInARealRun1" not in json.dumps(result.rendered) + repr(result.xcoms)
