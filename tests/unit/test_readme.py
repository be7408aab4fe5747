"""The README's operator snippet renders as written for every kind of DAG run, and the guides' snippets it sent to docs/ build what they say.

Every python block is also run by tests/unit/test_doc_snippets.py; these tests check what each builds."""

from __future__ import annotations

import re
import urllib.parse
from datetime import datetime, timezone
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
#: The guides the README's sections moved to (issue 43).
BATCHES = REPO / "docs" / "batches.md"
ENGINES = REPO / "docs" / "engines.md"
ANSWER_CACHE = REPO / "docs" / "answer-cache.md"


def _snippet() -> str:
    text = README.read_text()
    section = text[text.index("## Use it") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


# Airflow 3 gives a logical date (and so ds) only to scheduled runs and backfills.
RUNS = {
    "scheduled": {
        "run_id": "scheduled__2026-11-21T00:00:00+00:00",
        "ds": "2026-11-21",
        "logical_date": datetime(2026, 11, 21, tzinfo=timezone.utc),
    },
    "manual": {"run_id": "manual__2026-11-22T10:00:00+00:00"},
    "asset_triggered": {"run_id": "asset_triggered__2026-11-22T10:00:00+00:00"},
}


@pytest.mark.parametrize("kind", RUNS)
def test_the_readme_snippet_renders_for_every_kind_of_run(kind):
    from airflow.sdk import DAG

    with DAG("readme", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
        exec(_snippet(), {})
    (task,) = dag.tasks
    context = dict(RUNS[kind])
    task.render_template_fields(context)
    assert task.input_uri == f"s3://my-bucket/batches/{context['run_id']}/input.jsonl"
    assert task.output_uri == f"s3://my-bucket/batches/{context['run_id']}/results.jsonl"


def _section_snippet(title: str, page: Path = README) -> str:
    text = page.read_text()
    section = text[text.index(title) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_structured_outputs_snippet_builds_its_dag_and_its_error_message_is_the_real_one():
    import json

    from airflow.sdk import DAG, task

    from airflow_vllm_batch.batchfile import OutputSchema, check_results
    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    @task
    def prompts() -> list[str]:
        return ["Review: great"]

    namespace = {"task": task, "prompts": prompts, "VLLMBatchOperator": VLLMBatchOperator}
    with DAG("readme_structured", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
        # Compiled apart from this module's `from __future__ import annotations`, as a DAG file would be.
        code = compile(
            _section_snippet("## Structured outputs: answers with a schema", BATCHES),
            "docs/batches.md",
            "exec",
            dont_inherit=True,
        )
        exec(code, {**namespace, "__name__": "readme_dag"})
    (op,) = [t for t in dag.tasks if isinstance(t, VLLMBatchOperator)]
    assert op.output_type.__name__ == "Review"
    assert "stars" in op.output_type.model_fields
    answer = {
        "custom_id": "a",
        "response": {
            "status_code": 200,
            "request_id": "r",
            "body": {
                "choices": [
                    {"index": 0, "message": {"content": '{"sentiment": "positive", "stars": "many"}'}}
                ]
            },
        },
        "error": None,
    }
    errors = []
    check_results(
        [json.dumps(answer).encode()],
        errors_out=type("W", (), {"write": staticmethod(errors.append)})(),
        output_schema=OutputSchema(op.output_type),
    )
    message = json.loads(errors[0])["error"]["message"]
    assert message.startswith("does not fit Review: stars: Input should be a valid integer")
    assert "does not fit Review: stars: Input should be a valid integer" in BATCHES.read_text()


def test_the_answer_cache_snippet_builds_an_operator_with_the_cache():
    from airflow.sdk import DAG

    text = ANSWER_CACHE.read_text()
    section = text[text.index("# Answer cache") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    with DAG("readme_cache", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
        exec(snippet, {})
    (task,) = dag.tasks
    task.render_template_fields({"ds": "2026-11-21", "run_id": "scheduled__2026-11-21T00:00:00+00:00"})
    settings = task.settings()
    assert settings.answer_cache_uri == "s3://my-bucket/answer-cache/"
    assert settings.answer_cache_sampled is False


def test_the_completions_snippet_builds_a_server_task_whose_lines_are_prompts():
    import json

    from airflow.sdk import DAG

    from airflow_vllm_batch.batchfile.requests import build_batch_file
    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    with DAG(
        "readme_completions", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)
    ) as dag:
        exec(_section_snippet("## Completions: `/v1/completions` lines", BATCHES), {})
    (op,) = [t for t in dag.tasks if isinstance(t, VLLMBatchOperator)]
    assert op.requests_url == "/v1/completions"
    assert type(op.engine).__name__ == "VLLMServer"
    settings = op.settings()
    data = build_batch_file(
        settings.requests, model=settings.model, url=settings.requests_url, default_body=settings.default_body
    )
    lines = [json.loads(line) for line in data.splitlines()]
    assert {line["url"] for line in lines} == {"/v1/completions"}
    assert [line["body"]["prompt"] for line in lines] == [
        "Once upon a time",
        "The ship left the harbour",
        "Dear customer,",
    ]
    assert all(line["body"]["max_tokens"] == 32 for line in lines)


def test_the_taskflow_snippet_builds_a_decorated_task_whose_function_returns_conversations():
    import json

    from airflow.sdk import DAG

    from airflow_vllm_batch.batchfile.requests import build_batch_file
    from airflow_vllm_batch.decorators.vllm_batch import _VLLMBatchDecoratedOperator

    with DAG("readme_taskflow", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
        code = compile(
            _section_snippet("## TaskFlow: `@task.vllm_batch`", BATCHES),
            "docs/batches.md",
            "exec",
            dont_inherit=True,
        )
        exec(code, {"__name__": "readme_dag"})
    op = dag.get_task("classify")
    assert isinstance(op, _VLLMBatchDecoratedOperator)
    assert op.upstream_task_ids == {"reviews"}
    settings = op.settings()
    requests = op.python_callable(["great", "awful"])
    data = build_batch_file(
        requests, model=settings.model, url=settings.requests_url, default_body=settings.default_body
    )
    lines = [json.loads(line) for line in data.splitlines()]
    assert [line["body"]["messages"][1]["content"] for line in lines] == ["great", "awful"]
    assert all(
        line["body"]["max_completion_tokens"] == 16 and line["body"]["model"] == "Qwen/Qwen2.5-7B-Instruct"
        for line in lines
    )
    assert op.output_uri == "s3://my-bucket/batches/{{ run_id }}/answers.jsonl"


def test_the_openai_sdk_snippet_compiles_and_points_at_the_plugins_prefix():
    from airflow_vllm_batch.openai_api.settings import URL_PREFIX

    snippet = _section_snippet("## Use the OpenAI SDK")
    compile(snippet, "README.md", "exec", dont_inherit=True)
    base_url = re.search(r'base_url="([^"]+)"', snippet).group(1)
    assert urllib.parse.urlsplit(base_url).path == URL_PREFIX


def test_the_docs_build_each_engine_with_its_own_options():
    """The README's example builds the runner (*Use it*); docs/batches.md the task-started server (*Completions*); docs/engines.md a warm server (*Two engines*)."""
    from airflow.sdk import DAG

    from airflow_vllm_batch.engines import VLLMRunner, VLLMServer, WarmVLLMServer

    built = {}
    for page, title in (
        (README, "## Use it"),
        (BATCHES, "## Completions: `/v1/completions` lines"),
        (ENGINES, "```bash\nexport AIRFLOW_CONN_VLLM_DEFAULT"),
    ):
        with DAG(
            f"readme_{len(built)}", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)
        ) as dag:
            snippet = _section_snippet(title, page)
            exec(compile(snippet, page.name, "exec", dont_inherit=True), {"__name__": "readme_dag"})
        (task,) = dag.tasks
        built[title] = task.engine
    runner, server, warm = built.values()
    assert isinstance(runner, VLLMRunner)
    assert runner.args == ["--max-model-len", "8192"]
    assert isinstance(server, VLLMServer)
    assert isinstance(warm, WarmVLLMServer)
    assert warm.conn_id == "vllm_default"
    assert warm.checkpoint_interval_s == 60


def test_the_yield_to_interactive_snippet_builds_an_operator_whose_engine_yields():
    from airflow.sdk import DAG

    from airflow_vllm_batch.engines import YieldToInteractive

    with DAG("readme_yield", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
        exec(_section_snippet("### Beside interactive users", ENGINES), {})
    (task,) = dag.tasks
    assert task.engine.yielding == YieldToInteractive(min_in_flight=8)
    assert task.engine.max_in_flight == 256
