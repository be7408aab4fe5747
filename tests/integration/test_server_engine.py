"""The server engine end to end: one real vLLM server (CPU, tiny model) reached through a ``vllm`` connection.

The pipeline and sharded example DAGs run against it (``AIRFLOW_VLLM_BATCH_VLLM_CONN_ID``);
then a 2,000-request task is SIGKILLed at about half (once a checkpoint part is in S3) and run again as the same task
instance: every custom_id is answered exactly once, and the server answered no more than
the batch plus what was in flight plus one checkpoint interval's worth. And a worker whose
``results_dir`` (a 4 MiB tmpfs, mounted by the test; skipped where ``mount`` is not allowed) fills
up mid-run: the try fails as retryable naming the directory, publishes nothing, and the next try
answers every request once.

Fresh processes: none but the session's warm server; the runner test checks that the runner is
refused before it starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pytest
from openai.types.chat import ChatCompletion
from pydantic import BaseModel

from airflow_vllm_batch.engines import VLLMRunner, WarmVLLMServer
from airflow_vllm_batch.run import AnswerCacheOptions
from tests.integration.dagrun import REPO, error_lines as _error_lines, load_dag, run_dag
from tests.integration.vllm_metrics import requests_answered
from tests.small_disk import small_tmpfs
from vllm_batch_embedded.demo import BUCKET, CPU_ENGINE_ARGS

if TYPE_CHECKING:
    from airflow_vllm_batch.engines.vllm.server_process import VLLMServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.engine]

CONN_ID = "vllm_tiny"
#: Structured decoding without free whitespace between JSON tokens: the tiny random model, left
#: any whitespace, writes "{" and then whitespace until max_tokens (measured: 0 of 10 answers closed
#: at 40 tokens); compact, every answer closes. Server-wide in vLLM 0.32 (xgrammar reads it from the
#: engine's config, not per request), and it changes nothing for requests without a schema.
STRUCTURED_ARGS = [
    "--structured-outputs-config",
    json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
]
N_KILL = 2000
MAX_IN_FLIGHT = 128
INTERVAL_S = 2.0


@pytest.fixture(scope="module")
def warm(embedded, airflow_db, warm_vllm) -> Iterator[VLLMServerProcess]:
    """The session's warm server with structured outputs (``warm_vllm``), behind connection ``vllm_tiny``; the example DAGs use it."""
    server = warm_vllm(*STRUCTURED_ARGS)
    assert server.hook is not None
    host, port = server.hook.base_url.removeprefix("http://").split(":")
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(
        {"conn_type": "vllm", "host": host, "port": int(port), "password": server.hook.api_key}
    )
    os.environ["AIRFLOW_VLLM_BATCH_VLLM_CONN_ID"] = CONN_ID
    try:
        yield server
    finally:
        os.environ.pop("AIRFLOW_VLLM_BATCH_VLLM_CONN_ID", None)
        os.environ.pop(f"AIRFLOW_CONN_{CONN_ID.upper()}", None)


def _s3_lines(seaweed, uri: str) -> list[dict]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    body = seaweed.client().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def test_the_pipeline_dag_runs_through_the_warm_server(warm, embedded):
    before = requests_answered(warm.hook.base_url)
    run = run_dag(
        load_dag("vllm_batch_pipeline.py", "pipeline_dag"), run_conf={"n_requests": 12, "max_tokens": 8}
    )
    assert run.state == "success", run.output[-4000:]
    manifest = run.xcom("vllm_batch")
    assert manifest["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert manifest["identity"]["engine"] == "vllm_connection"
    assert "Starting the vLLM" not in run.output  # no engine start: the warm server answered
    for line in _s3_lines(embedded, manifest["output_uri"]):
        ChatCompletion.model_validate(line["response"]["body"])
    assert requests_answered(warm.hook.base_url) - before == 12
    assert warm.hook.api_key not in run.output
    assert _error_lines(run.output) == []


def test_the_sharded_dag_runs_every_shard_through_one_warm_server(warm, embedded):
    before = requests_answered(warm.hook.base_url)
    run = run_dag(
        load_dag("vllm_batch_sharded.py", "sharded_dag"),
        run_conf={"n_requests": 90, "shard_size": 30, "max_tokens": 4},
    )
    assert run.state == "success", run.output[-4000:]
    assert run.output.count("Server engine done: 30 requests") == 3
    assert "Starting the vLLM" not in run.output
    merged = run.xcom("merge")
    for line in _s3_lines(embedded, merged["output_uri"]):
        ChatCompletion.model_validate(line["response"]["body"])
    assert requests_answered(warm.hook.base_url) - before == 90
    assert _error_lines(run.output) == []  # a successful split, shards and merge log no error


def test_the_taskflow_dag_runs_its_decorated_task_through_the_warm_server(warm, embedded):
    before = requests_answered(warm.hook.base_url)
    run = run_dag(load_dag("vllm_batch_taskflow.py", "taskflow_dag"))
    assert run.state == "success", run.output[-4000:]
    manifest = run.xcom("classify")
    assert manifest["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert manifest["identity"]["engine"] == "vllm_connection"
    assert "Starting the vLLM" not in run.output
    requests = _s3_lines(embedded, manifest["input_uri"])
    assert [r["body"]["messages"][0]["role"] for r in requests] == ["system"] * 3
    answers = run.xcom("use_answers")
    assert answers == {
        line["custom_id"]: line["response"]["body"]["choices"][0]["message"]["content"]
        for line in _s3_lines(embedded, manifest["output_uri"])
    }
    assert sorted(answers) == ["request-0", "request-1", "request-2"]
    assert requests_answered(warm.hook.base_url) - before == 3
    assert _error_lines(run.output) == []


TASK_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from datetime import datetime, timezone
from airflow.sdk import DAG
from airflow_vllm_batch.engines import WarmVLLMServer
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from tests.integration.dagrun import register_dag

when = datetime(2026, 3, 1, tzinfo=timezone.utc)
with DAG("server_engine_sigkill", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    VLLMBatchOperator(
        task_id="vllm_batch",
        input_uri={input_uri!r},
        output_uri={output_uri!r},
        model={model!r},
        engine=WarmVLLMServer(conn_id={conn_id!r}, max_in_flight={max_in_flight}, checkpoint_interval={interval}),
    )
register_dag(dag)
dr = dag.test(logical_date=when, run_after=when)
print("DAGRUN STATE", dr.state, flush=True)
"""


def _chat_lines(model: str, n: int, max_tokens: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"k{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"Count to {i}"}],
                    "max_completion_tokens": max_tokens,
                    "ignore_eos": True,
                },
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


def _parts(client) -> list[str]:
    """The checkpoint parts the task has made durable in S3 so far."""
    return [
        o["Key"]
        for o in client.list_objects_v2(Bucket=BUCKET, Prefix="server-kill/").get("Contents", [])
        if "/parts/" in o["Key"]
    ]


def test_sigkill_at_half_then_the_same_task_instance_again_answers_each_request_once(
    warm, embedded, tiny_model, tmp_path
):
    client = embedded.client()
    client.put_object(
        Bucket=BUCKET, Key="server-kill/input.jsonl", Body=_chat_lines(str(tiny_model), N_KILL, 24)
    )
    script = tmp_path / "task.py"
    script.write_text(
        TASK_SCRIPT.format(
            repo=str(REPO),
            input_uri=f"s3://{BUCKET}/server-kill/input.jsonl",
            output_uri=f"s3://{BUCKET}/server-kill/results.jsonl",
            model=str(tiny_model),
            conn_id=CONN_ID,
            max_in_flight=MAX_IN_FLIGHT,
            interval=INTERVAL_S,
        )
    )
    base = warm.hook.base_url
    before = requests_answered(base)

    window: dict[str, float] = {}

    def run_task(kill_at: int | None) -> str:
        log = tmp_path / f"task-{kill_at}.log"
        with open(log, "wb") as out:
            task = subprocess.Popen(
                [sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ)
            )
            try:
                while kill_at is not None and task.poll() is None:
                    answered = requests_answered(base) - before
                    if answered and "first" not in window:
                        window["first"] = time.monotonic()
                    # At about half, once a part is durable: the kill tests resuming, so it waits
                    # for the first checkpoint (sealed one interval after the first answer), which a
                    # fast machine may not have uploaded by the 1,000th answer (a CI run killed first).
                    if answered >= kill_at and _parts(client):
                        task.send_signal(signal.SIGKILL)  # the OOM killer, a reclaimed spot node
                        window["kill"] = time.monotonic()
                        break
                    time.sleep(0.1)
                task.wait(timeout=600)
            finally:
                if task.poll() is None:
                    task.kill()
        return log.read_text(errors="replace")

    first = run_task(kill_at=N_KILL // 2)
    assert "DAGRUN STATE" not in first, first[-3000:]
    answered_first = requests_answered(base) - before
    parts = _parts(client)
    assert parts, "the killed try left no checkpoint"
    part_lines = [len(_s3_lines(embedded, f"s3://{BUCKET}/{key}")) for key in sorted(parts)]
    time.sleep(1)  # requests the killed try left in the server finish or are aborted
    second = run_task(kill_at=None)
    assert "DAGRUN STATE success" in second, second[-3000:]
    resumed = re.search(
        r"Resuming from \d+ checkpoint part\(s\) at \S+: (\d+) of 2000 requests are answered already", second
    )
    assert resumed, second[-3000:]
    results = _s3_lines(embedded, f"s3://{BUCKET}/server-kill/results.jsonl")
    ids = [r["custom_id"] for r in results]
    assert len(ids) == N_KILL
    assert set(ids) == {f"k{i}" for i in range(N_KILL)}
    for line in results[:50]:
        ChatCompletion.model_validate(line["response"]["body"])
    total = requests_answered(base) - before
    rate = answered_first / max(window["kill"] - window["first"], 0.1)
    checkpointed = int(resumed.group(1))
    # What one checkpoint interval holds, measured: the largest part (a part is sealed one interval
    # after its first answer). A kill can find one part open and the previous one still uploading.
    interval_worth = max(part_lines)
    print(
        f"killed after {answered_first:.0f} answers (mean {rate:.0f}/s); parts {part_lines} = {checkpointed} "
        f"checkpointed; the server answered {total:.0f} in all, {total - N_KILL:.0f} twice "
        f"(interval {INTERVAL_S:g}s, {MAX_IN_FLIGHT} in flight)"
    )
    assert checkpointed == sum(part_lines)
    assert total - N_KILL <= MAX_IN_FLIGHT + 2 * interval_worth


def _mixed_chat_and_completion_lines(model: str) -> bytes:
    """Chat lines, and completion lines with a prompt string and a token-id list (issue 21)."""
    lines = [
        {
            "custom_id": "chat-0",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Hello"}], "max_completion_tokens": 5},
        },
        {
            "custom_id": "text-0",
            "url": "/v1/completions",
            "body": {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0},
        },
        {
            "custom_id": "ids-0",
            "url": "/v1/completions",
            "body": {"prompt": [5, 6, 7, 8, 9], "max_tokens": 4},
        },
        {
            "custom_id": "chat-1",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Count"}], "max_completion_tokens": 3},
        },
        {
            "custom_id": "text-1",
            "url": "/v1/completions",
            "body": {"prompt": "Count to three:", "max_tokens": 5, "echo": False},
        },
    ]
    return b"".join(
        json.dumps(
            {
                "custom_id": line["custom_id"],
                "method": "POST",
                "url": line["url"],
                "body": {"model": model, **line["body"]},
            }
        ).encode()
        + b"\n"
        for line in lines
    )


def _warm_dag(dag_id: str, model: str, input_key: str, output_key: str, **options):
    """A registered DAG of one task that runs ``input_key`` into ``output_key``: through the warm server unless ``options`` say otherwise."""
    from datetime import datetime, timezone

    from airflow.sdk import DAG

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
    from tests.integration.dagrun import register_dag

    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
        VLLMBatchOperator(
            task_id="vllm_batch",
            input_uri=f"s3://{BUCKET}/{input_key}",
            output_uri=f"s3://{BUCKET}/{output_key}",
            model=model,
            **{"engine": WarmVLLMServer(conn_id=CONN_ID), **options},
        )
    register_dag(dag)
    return dag


def _completions_dag(dag_id: str, model: str, **engine):
    return _warm_dag(
        dag_id, model, "completions/input.jsonl", f"completions/{dag_id}/results.jsonl", **engine
    )


def test_chat_and_completion_lines_in_one_file_are_all_answered_through_the_server_engine(
    warm, embedded, tiny_model
):
    from openai.types import Completion

    from airflow_vllm_batch.batchfile import Text
    from airflow_vllm_batch.storage import read_answers

    model = str(tiny_model)
    embedded.client().put_object(
        Bucket=BUCKET, Key="completions/input.jsonl", Body=_mixed_chat_and_completion_lines(model)
    )
    before = requests_answered(warm.hook.base_url)
    run = run_dag(
        _completions_dag(
            "completions_server", model, engine=WarmVLLMServer(conn_id=CONN_ID, gpu_hour_cost=2.5)
        )
    )
    assert run.state == "success", run.output[-4000:]
    manifest = run.xcom("vllm_batch")
    assert manifest["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert requests_answered(warm.hook.base_url) - before == 5
    results = {line["custom_id"]: line for line in _s3_lines(embedded, manifest["output_uri"])}
    for custom_id in ("text-0", "ids-0", "text-1"):
        assert results[custom_id]["response"]["status_code"] == 200
        assert results[custom_id]["error"] is None
        body = Completion.model_validate(results[custom_id]["response"]["body"])
        assert body.object == "text_completion"
        assert body.usage.completion_tokens > 0
    assert Completion.model_validate(results["ids-0"]["response"]["body"]).usage.prompt_tokens == 5
    for custom_id in ("chat-0", "chat-1"):
        ChatCompletion.model_validate(results[custom_id]["response"]["body"])
    usage = [results[c]["response"]["body"]["usage"] for c in results]
    assert manifest["usage"]["prompt_tokens"] == sum(u["prompt_tokens"] for u in usage)
    assert manifest["usage"]["completion_tokens"] == sum(u["completion_tokens"] for u in usage)
    answers = {answer.custom_id: answer for answer in read_answers(manifest)}
    assert answers["text-0"] == Text("text-0", results["text-0"]["response"]["body"]["choices"][0]["text"])
    assert isinstance(answers["ids-0"].text, str)
    assert answers["ids-0"].text
    print({custom_id: answer.text for custom_id, answer in answers.items()})


def test_a_real_runs_manifest_and_summary_carry_its_engine_time_and_cost(warm, embedded, tiny_model):
    model = str(tiny_model)
    embedded.client().put_object(
        Bucket=BUCKET, Key="completions/input.jsonl", Body=_mixed_chat_and_completion_lines(model)
    )
    run = run_dag(
        _completions_dag(
            "cost_connection", model, engine=WarmVLLMServer(conn_id=CONN_ID, gpu_hour_cost="2.5")
        )
    )
    assert run.state == "success", run.output[-4000:]
    manifest = run.xcom("vllm_batch")
    cost = manifest["cost"]
    print(cost, manifest["per_model"])
    assert cost["device"] == "vllm_connection"
    assert cost["gpu_hour_cost"] == 2.5
    assert 0 < cost["engine_s"] <= manifest["duration_s"] + 1
    assert cost["tokens_per_engine_s"] == pytest.approx(
        manifest["usage"]["total_tokens"] / cost["engine_s"], rel=0.01
    )
    assert cost["cost"] == pytest.approx(cost["engine_s"] / 3600 * 2.5, abs=1e-5)
    assert [entry["cost"] for entry in manifest["per_model"].values()] == [pytest.approx(cost["cost"])]
    assert re.search(
        r"\| engine time +\| vllm connection: [\d.]+ s of the task .*tokens/s; cost [\d.e-]+ at 2.5/server-hour",
        run.output,
    )


def test_two_client_processes_answer_each_request_once_through_the_real_server_and_leave_no_worker(
    warm, embedded, tiny_model
):
    import psutil

    n = 60
    model = str(tiny_model)
    embedded.client().put_object(
        Bucket=BUCKET, Key="completions/input.jsonl", Body=_chat_lines(model, n, max_tokens=3)
    )
    before = requests_answered(warm.hook.base_url)
    run = run_dag(
        _completions_dag(
            "two_clients",
            model,
            engine=WarmVLLMServer(conn_id=CONN_ID, client_processes=2, checkpoint_interval=1.0),
        )
    )
    assert run.state == "success", run.output[-4000:]
    assert "The client spreads the requests over 2 processes" in run.output
    manifest = run.xcom("vllm_batch")
    assert manifest["request_counts"] == {"total": n, "completed": n, "failed": 0}
    ids = [line["custom_id"] for line in _s3_lines(embedded, manifest["output_uri"])]
    assert sorted(ids) == sorted(f"k{i}" for i in range(n))
    assert requests_answered(warm.hook.base_url) - before == n  # nothing sent twice by the two workers
    # The workers run multiprocessing's spawn_main (its resource tracker lives on with this process, by design).
    workers = [p for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
    assert workers == []


def test_the_same_file_for_the_runner_fails_preflight_naming_the_server_engine_and_starts_no_engine(
    embedded, airflow_db, tiny_model
):
    model = str(tiny_model)
    embedded.client().put_object(
        Bucket=BUCKET, Key="completions/input.jsonl", Body=_mixed_chat_and_completion_lines(model)
    )
    # Retries allowed: a failed task (not up_for_retry) says preflight's error is not retried.
    run = run_dag(
        _completions_dag(
            "completions_runner", model, engine=VLLMRunner(args=CPU_ENGINE_ARGS.split()), retries=2
        )
    )
    assert run.state == "failed", run.output[-4000:]
    assert run.task_states["vllm_batch"] == "failed", run.output[-4000:]
    assert "failed preflight" in run.output, run.output[-4000:]
    assert "AirflowFailException" in run.output, run.output[-4000:]
    for lineno, custom_id in ((2, "text-0"), (3, "ids-0"), (5, "text-1")):
        assert re.search(
            rf"line {lineno} \(custom_id '{custom_id}'\): \"url\" '/v1/completions' is not served by this engine .*engine=VLLMServer",
            run.output,
        ), run.output[-4000:]
    assert "Starting the vLLM" not in run.output


class Mood(BaseModel):
    """A short answer: the schema the tiny model must fit (two fields of a few tokens each)."""

    sentiment: Literal["positive", "negative"]
    sure: bool


def _mood_lines(model: str) -> bytes:
    """8 chat and 2 completion requests, greedy, with room for the schema's JSON (about 20 tokens)."""
    chat = [
        {
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": f"Review {i}: fine food"}],
                "max_completion_tokens": 40,
            },
        }
        for i in range(8)
    ]
    text = [
        {"url": "/v1/completions", "body": {"prompt": f"Review {i}: slow service", "max_tokens": 40}}
        for i in range(2)
    ]
    return b"".join(
        json.dumps(
            {
                "custom_id": f"m{i}",
                "method": "POST",
                "url": line["url"],
                "body": {"model": model, "temperature": 0, **line["body"]},
            }
        ).encode()
        + b"\n"
        for i, line in enumerate(chat + text)
    )


def test_structured_outputs_through_the_real_engine_every_answer_fits_and_without_the_schema_none_does(
    warm, embedded, tiny_model
):
    from airflow_vllm_batch.batchfile import Failed, Parsed
    from airflow_vllm_batch.storage import read_answers

    model = str(tiny_model)
    embedded.client().put_object(Bucket=BUCKET, Key="structured/input.jsonl", Body=_mood_lines(model))
    manifests = {}
    for name, output_type in (("with_schema", Mood), ("without_schema", None)):
        run = run_dag(
            _warm_dag(
                f"structured_{name}",
                model,
                "structured/input.jsonl",
                f"structured/{name}/results.jsonl",
                output_type=output_type,
            )
        )
        assert run.state == "success", run.output[-4000:]
        manifests[name] = run.xcom("vllm_batch")
    structured = manifests["with_schema"]
    assert structured["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
    assert "invalid_output" not in structured  # 0: omitted
    parsed = list(read_answers(structured, output_type=Mood))
    assert len(parsed) == 10
    assert all(isinstance(a, Parsed) and isinstance(a.value, Mood) for a in parsed)
    # The same requests without the schema: the random model's text is no Mood.
    free = list(read_answers(manifests["without_schema"], output_type=Mood))
    assert len(free) == 10
    assert all(isinstance(a, Failed) and a.error.startswith("invalid_output") for a in free)
    print({a.custom_id: a.value.model_dump() for a in parsed[:3]}, free[0])


def test_structured_answers_cut_off_at_the_token_limit_fail_saying_so_and_naming_the_requests_limit(
    warm, embedded, tiny_model
):
    model = str(tiny_model)
    chat = [
        {
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"Review {i}"}], "max_completion_tokens": 3},
        }
        for i in range(3)
    ]
    text = [{"url": "/v1/completions", "body": {"prompt": "Review: slow", "max_tokens": 3}}]
    data = b"".join(
        json.dumps(
            {
                "custom_id": f"t{i}",
                "method": "POST",
                "url": line["url"],
                "body": {"model": model, "temperature": 0, **line["body"]},
            }
        ).encode()
        + b"\n"
        for i, line in enumerate(chat + text)
    )
    embedded.client().put_object(Bucket=BUCKET, Key="structured/short.jsonl", Body=data)
    run = run_dag(
        _warm_dag(
            "structured_short",
            model,
            "structured/short.jsonl",
            "structured/short/results.jsonl",
            output_type=Mood,
            max_failed_ratio=1,
        )
    )
    assert run.state == "success", run.output[-4000:]
    manifest = run.xcom("vllm_batch")
    assert manifest["request_counts"] == {"total": 4, "completed": 0, "failed": 4}
    messages = {
        line["custom_id"]: line["error"]["message"] for line in _s3_lines(embedded, manifest["error_uri"])
    }
    print(messages)
    for custom_id, message in messages.items():
        assert 'cut off at the token limit (finish_reason "length", 3 tokens)' in message, message
        limit = "max_tokens," if custom_id == "t3" else "max_completion_tokens (or max_tokens)"
        assert f"raise the request's {limit}" in message, message


def _cache_dag(dag_id: str, model: str, input_key: str, cache_uri: str):
    return _warm_dag(
        dag_id,
        model,
        input_key,
        f"answer-cache-it/{dag_id}/results.jsonl",
        answer_cache=AnswerCacheOptions(uri=cache_uri),
    )


def test_a_second_run_through_the_answer_cache_sends_only_the_changed_requests(warm, embedded, tiny_model):
    import uuid

    model, n = str(tiny_model), 40
    cache_uri = f"s3://{BUCKET}/answer-cache-it/cache-{uuid.uuid4().hex[:8]}/"

    def lines(changed: set[int]) -> bytes:
        return b"".join(
            json.dumps(
                {
                    "custom_id": f"c{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": model,
                        "temperature": 0,
                        "max_tokens": 4,
                        "messages": [{"role": "user", "content": f"{'New' if i in changed else 'Old'} {i}"}],
                    },
                }
            ).encode()
            + b"\n"
            for i in range(n)
        )

    client = embedded.client()
    client.put_object(Bucket=BUCKET, Key="answer-cache-it/night1.jsonl", Body=lines(set()))
    client.put_object(Bucket=BUCKET, Key="answer-cache-it/night2.jsonl", Body=lines({3, 17}))
    before = requests_answered(warm.hook.base_url)
    first = run_dag(_cache_dag("answer_cache_night1", model, "answer-cache-it/night1.jsonl", cache_uri))
    assert first.state == "success", first.output[-4000:]
    assert requests_answered(warm.hook.base_url) - before == n
    before = requests_answered(warm.hook.base_url)
    second = run_dag(_cache_dag("answer_cache_night2", model, "answer-cache-it/night2.jsonl", cache_uri))
    assert second.state == "success", second.output[-4000:]
    assert requests_answered(warm.hook.base_url) - before == 2
    manifest = second.xcom("vllm_batch")
    assert manifest["from_cache"] == n - 2
    assert manifest["request_counts"] == {
        "total": n,
        "completed": n,
        "failed": 0,
    }

    def raw(uri: str) -> dict[str, bytes]:
        body = client.get_object(Bucket=BUCKET, Key=uri.removeprefix(f"s3://{BUCKET}/"))["Body"].read()
        return {json.loads(line)["custom_id"]: line for line in body.splitlines() if line.strip()}

    night1, night2 = raw(first.xcom("vllm_batch")["output_uri"]), raw(manifest["output_uri"])
    assert sorted(night2) == sorted(night1)
    assert {c for c in night1 if night1[c] != night2[c]} == {"c3", "c17"}  # the rest byte for byte


def test_the_nightly_cache_benchmark_sends_only_the_changed_rows_and_keeps_the_unchanged_answers_byte_equal(
    warm,
):
    """``benchmarks/answer_cache.py nightly`` runs here small against the warm server, so the script cannot rot.

    What is asserted is what does not depend on the machine's speed: night 2 sent exactly the
    changed rows (the script reads the server's own counter), answered every row once, and
    its unchanged rows' result lines are night 1's bytes. The wall-time ratio is the
    benchmark's figure (docs/benchmarks.md), not asserted here.
    """
    argv = [
        sys.executable,
        str(REPO / "benchmarks" / "answer_cache.py"),
        "nightly",
        "--rows",
        "400",
        "--changed",
        "0.05",
    ]
    argv += ["--max-tokens", "8", "--server-url", warm.hook.base_url]
    env = {**os.environ, "PYTHONPATH": str(REPO), "BENCH_VLLM_API_KEY": warm.hook.api_key}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))
    assert (figures["rows"], figures["changed"]) == (400, 20)
    assert figures["night1_sent"] == 400
    assert figures["night2_sent"] == 20
    assert figures["night2_from_cache"] == 380
    assert figures["night2_answers_every_row_once"]
    assert figures["unchanged_rows_byte_equal"]


N_FULL = 600


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for the test (a worker's scratch disk that fills up); skipped where ``mount`` is not allowed."""
    with small_tmpfs(tmp_path / "small-disk") as disk:
        yield disk


def _fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` until ``leave`` bytes are free; return the filler file."""
    filler = disk / "filler"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(filler, "wb") as out:
        out.write(b"\0" * max(free - leave, 0))
    return filler


def test_a_full_scratch_disk_fails_the_try_retryably_naming_the_directory_and_the_retry_loses_nothing(
    warm, embedded, tiny_model, small_disk
):
    """The worker's ``results_dir`` fills up while the answers stream in: the try fails as retryable, naming the directory; nothing is published; the next try (space freed) answers every request once."""
    from airflow_vllm_batch.scratch import owned_dir

    client = embedded.client()
    client.put_object(
        Bucket=BUCKET, Key="scratch-full/input.jsonl", Body=_chat_lines(str(tiny_model), N_FULL, 8)
    )
    # Room for the try's scratch and its first checkpoint part, not for all 600 answers.
    filler = _fill(small_disk, 160 * 1024)
    dag = _warm_dag(
        "scratch_full",
        str(tiny_model),
        "scratch-full/input.jsonl",
        "scratch-full/results.jsonl",
        engine=WarmVLLMServer(conn_id=CONN_ID, checkpoint_interval=0.5),
        results_dir=str(small_disk),
    )
    first = run_dag(dag)
    assert first.state == "failed", first.output[-3000:]
    full = re.search(
        r"ScratchFullError: The worker's disk is full at (\S+?): No space left on device", first.output
    )
    assert full, first.output[-3000:]
    assert full.group(1) == str(owned_dir(str(small_disk)))
    assert "AirflowFailException" not in first.output, "a full disk must be retried"
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix="scratch-full/").get("Contents", [])
    published = [
        o["Key"] for o in listed if o["Key"].endswith(("results.jsonl", "errors.jsonl", ".manifest.json"))
    ]
    assert published == [], published
    parts = [o["Key"] for o in listed if "/parts/" in o["Key"]]
    in_parts = sum(len(_s3_lines(embedded, f"s3://{BUCKET}/{key}")) for key in parts)

    filler.unlink()
    second = run_dag(dag)
    assert second.state == "success", second.output[-3000:]
    # A part sealed before the disk filled (here 1 part of 60 answers) is resumed from, not sent again.
    if parts:
        resumed = re.search(r"Resuming from \d+ checkpoint part\(s\) at \S+: (\d+) of", second.output)
        assert resumed, second.output[-3000:]
        assert int(resumed.group(1)) == in_parts
    ids = [r["custom_id"] for r in _s3_lines(embedded, f"s3://{BUCKET}/scratch-full/results.jsonl")]
    assert sorted(ids) == sorted(f"k{i}" for i in range(N_FULL))
