"""The example DAGs, end to end: real SeaweedFS, real vLLM (CPU, tiny model), ``dag.test()``.

Each DAG runs once per module (an engine start costs 25-90 s); the tests then assert
on that one run's result lines, XComs and logs.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.dagrun import DagRunResult, error_lines, load_dag, run_dag

pytestmark = [pytest.mark.integration, pytest.mark.engine]

N_CHAT = 5
N_EMBED = 4
N_PROMPTS = 4  # the reviews of dags/vllm_batch_prompts.py
SECRET_MARKERS = ("X-Amz-Signature", "Signature=", "X-Amz-Credential")


def _s3_lines(seaweed, uri: str) -> list[dict]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    body = seaweed.client().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    return [json.loads(line) for line in body.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def pipeline_run(embedded, airflow_db) -> DagRunResult:
    dag = load_dag("vllm_batch_pipeline.py", "pipeline_dag")
    return run_dag(dag, run_conf={"n_requests": N_CHAT, "max_tokens": 8})


@pytest.fixture(scope="module")
def embeddings_run(embedded, airflow_db) -> DagRunResult:
    dag = load_dag("vllm_batch_embeddings.py", "embeddings_dag")
    return run_dag(dag, run_conf={"n_requests": N_EMBED})


@pytest.fixture(scope="module")
def prompts_run(embedded, airflow_db) -> DagRunResult:
    dag = load_dag("vllm_batch_prompts.py", "prompts_dag")
    return run_dag(dag)


def test_pipeline_dag_succeeds(pipeline_run):
    assert pipeline_run.state == "success", pipeline_run.output[-5000:]
    assert set(pipeline_run.task_states.values()) == {"success"}


def test_pipeline_manifest_counts_match_the_uploaded_requests(pipeline_run):
    manifest = pipeline_run.xcom("vllm_batch")
    assert manifest["request_counts"] == {"total": N_CHAT, "completed": N_CHAT, "failed": 0}
    assert manifest["error_uri"] is None
    assert manifest["vllm_version"] == "0.32.0"
    assert manifest["usage"]["completion_tokens"] > 0
    assert (
        manifest["usage"]["total_tokens"]
        == manifest["usage"]["prompt_tokens"] + manifest["usage"]["completion_tokens"]
    )
    assert pipeline_run.xcom("vllm_batch", "output_uri") == manifest["output_uri"]


def test_pipeline_results_answer_every_request_once_with_tokens(pipeline_run, seaweed):
    manifest = pipeline_run.xcom("vllm_batch")
    lines = _s3_lines(seaweed, manifest["output_uri"])
    assert sorted(line["custom_id"] for line in lines) == sorted(f"request-{i}" for i in range(N_CHAT))
    for line in lines:
        assert line["error"] is None
        assert line["response"]["status_code"] == 200
        assert line["response"]["body"]["usage"]["completion_tokens"] > 0
    usage = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in lines)
    assert usage == manifest["usage"]["completion_tokens"]


def test_pipeline_leaves_no_staging_objects(pipeline_run, seaweed):
    manifest = pipeline_run.xcom("vllm_batch")
    bucket, _, key = manifest["output_uri"].removeprefix("s3://").partition("/")
    listed = seaweed.client().list_objects_v2(Bucket=bucket, Prefix=key.rsplit("/", 1)[0] + "/")
    names = sorted(o["Key"].rsplit("/", 1)[1] for o in listed.get("Contents", []))
    assert names == ["input.jsonl", "results.jsonl", "results.manifest.json"]


def test_pipeline_manifest_file_equals_the_xcom(pipeline_run, seaweed):
    manifest = pipeline_run.xcom("vllm_batch")
    bucket, _, key = manifest["manifest_uri"].removeprefix("s3://").partition("/")
    assert json.loads(seaweed.client().get_object(Bucket=bucket, Key=key)["Body"].read()) == manifest


def test_pipeline_validate_task_reports_the_counts(pipeline_run):
    assert pipeline_run.xcom("validate")["request_counts"]["completed"] == N_CHAT


def test_engine_log_is_streamed_with_urls_redacted(pipeline_run, seaweed):
    out = pipeline_run.output
    assert "Reading batch from" in out  # the engine's own log reached the task log
    assert "?<redacted>" in out
    for marker in SECRET_MARKERS:
        assert marker not in out
    assert seaweed.secret_key not in out


def test_no_presigned_url_or_secret_in_any_xcom_or_rendered_field(pipeline_run, embeddings_run, seaweed):
    for run in (pipeline_run, embeddings_run):
        assert run.xcoms
        assert run.rendered
        text = repr(run.xcoms) + repr(run.rendered)
        for marker in (*SECRET_MARKERS, seaweed.secret_key, "X-Amz-"):
            assert marker not in text


def test_rendered_fields_show_the_templated_uris(pipeline_run):
    fields = pipeline_run.rendered["vllm_batch"]
    assert fields["output_uri"].endswith("/results.jsonl")
    assert "{{" not in fields["output_uri"]


def test_embeddings_dag_returns_one_384_dim_vector_per_text(embeddings_run, seaweed):
    assert embeddings_run.state == "success", embeddings_run.output[-5000:]
    manifest = embeddings_run.xcom("vllm_embed")
    assert manifest["request_counts"] == {"total": N_EMBED, "completed": N_EMBED, "failed": 0}
    lines = _s3_lines(seaweed, manifest["output_uri"])
    assert sorted(line["custom_id"] for line in lines) == sorted(f"embed-{i}" for i in range(N_EMBED))
    for line in lines:
        (item,) = line["response"]["body"]["data"]
        assert len(item["embedding"]) == 384
    assert embeddings_run.xcom("check_vectors") == {"count": N_EMBED}


def test_every_published_result_body_parses_with_the_openai_sdk_types(pipeline_run, embeddings_run, seaweed):
    from openai.types import CreateEmbeddingResponse
    from openai.types.chat import ChatCompletion

    for run, task_id, sdk_type in (
        (pipeline_run, "vllm_batch", ChatCompletion),
        (embeddings_run, "vllm_embed", CreateEmbeddingResponse),
    ):
        lines = _s3_lines(seaweed, run.xcom(task_id)["output_uri"])
        assert lines
        for line in lines:
            sdk_type.model_validate(line["response"]["body"])


def test_pipeline_output_link_points_at_the_results_on_the_connections_own_endpoint(pipeline_run, seaweed):
    bucket, _, key = pipeline_run.xcom("vllm_batch")["output_uri"].removeprefix("s3://").partition("/")
    # Not the AWS console: the connection has an endpoint_url of its own (SeaweedFS).
    assert (
        pipeline_run.xcom("vllm_batch", "_link_VLLMBatchOutputLink")
        == f"{seaweed.endpoint_url}/{bucket}/{key}"
    )


def test_pipeline_emits_the_results_asset_event_with_the_counts(pipeline_run):
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        event = session.scalars(
            select(AssetEvent)
            .join(AssetModel, AssetEvent.asset_id == AssetModel.id)
            .where(
                AssetModel.name == "vllm_batch_pipeline_results",
                AssetEvent.source_run_id == pipeline_run.run_id,
            )
        ).one()
    assert event.extra["request_counts"] == {"total": N_CHAT, "completed": N_CHAT, "failed": 0}
    assert event.extra["output_uri"] == pipeline_run.xcom("vllm_batch")["output_uri"]


def test_prompts_dag_goes_from_a_list_of_prompts_to_a_task_that_gets_the_answers(prompts_run, seaweed):
    assert prompts_run.state == "success", prompts_run.output[-5000:]
    manifest = prompts_run.xcom("classify")
    assert manifest["request_counts"] == {"total": N_PROMPTS, "completed": N_PROMPTS, "failed": 0}
    answers = prompts_run.xcom("use_answers")
    assert sorted(answers) == sorted(f"request-{i}" for i in range(N_PROMPTS))
    lines = _s3_lines(seaweed, manifest["output_uri"])
    assert answers == {
        line["custom_id"]: line["response"]["body"]["choices"][0]["message"]["content"] for line in lines
    }
    assert all(isinstance(text, str) and text for text in answers.values())


def test_prompts_dag_writes_the_requests_beside_its_output(prompts_run, seaweed):
    manifest = prompts_run.xcom("classify")
    stem = manifest["output_uri"].removesuffix(".jsonl")
    assert manifest["input_uri"].startswith(stem + ".requests/")
    assert manifest["input_uri"].endswith(".jsonl")
    requests = _s3_lines(seaweed, manifest["input_uri"])
    assert [r["custom_id"] for r in requests] == [f"request-{i}" for i in range(N_PROMPTS)]
    assert all(r["body"]["messages"][0]["content"].startswith("Is this review positive") for r in requests)
    assert {(r["body"]["temperature"], r["body"]["max_completion_tokens"]) for r in requests} == {(0, 16)}


def test_pipeline_logs_no_error_and_folds_the_engines_output_keeping_its_warnings(pipeline_run):
    out = pipeline_run.output
    assert error_lines(out) == []
    start, end = (
        out.index("::group::vLLM engine output"),
        out.index("::endgroup::", out.index("::group::vLLM engine output")),
    )
    assert "Reading batch from" in out[start:end]
    warnings = [line for line in out[start:end].splitlines() if re.search(r"\bWARNING \d\d-\d\d ", line)]
    assert warnings
    assert all("[warning" in line for line in warnings)
