"""A secret in engine_args never reaches the task log, the identity, the manifest, XCom, S3 or an error (No secrets)."""

from __future__ import annotations

import json
import logging

import pytest

from airflow_vllm_batch.engines import VLLMRunner
from airflow_vllm_batch.exceptions import EngineError
from tests.unit.operators.test_vllm_batch_runs import Batch, FakeTI


@pytest.fixture
def batch(s3, bucket, tmp_path) -> Batch:
    return Batch(s3, bucket, tmp_path)


def _everything_in_s3(batch: Batch) -> str:
    return "\n".join(f"{key}\n{batch.get(key).decode()}" for key in batch.keys())


def test_an_hf_token_in_engine_args_is_in_no_log_line_manifest_xcom_or_object(batch, capfd, caplog):
    secret = "hf_SecretTokenForLogs1"
    ti = FakeTI()
    with caplog.at_level(logging.INFO):
        manifest = batch.run(
            ti,
            args=["--hf-token", secret],
            env={"FAKE_ENGINE_ECHO_ARGS": "1", "HF_TOKEN": "hf_EnvTokenForLogs1"},
        )
    out = capfd.readouterr()
    logged = out.out + out.err + caplog.text
    assert "Starting the vLLM engine" in logged
    assert "--hf-token ***" in logged
    assert "non-default args" in logged  # the engine's own line was relayed...
    for text in (logged, json.dumps(manifest), json.dumps(ti.xcoms, default=str), _everything_in_s3(batch)):
        assert secret not in text
        assert "hf_EnvTokenForLogs1" not in text
    assert manifest["identity"]["engine_args"] == ["--hf-token", "<secret>"]


def test_a_rotated_token_is_the_same_run(batch):
    first = batch.run(args=["--hf-token=hf_RotatedTokenOld1"])
    again = batch.run(args=["--hf-token=hf_RotatedTokenNew2"])
    assert again["fingerprint"] == first["fingerprint"]
    assert batch.engine_runs == 1  # the published output is returned: no engine for a new token


def test_an_engine_failure_message_quoting_the_token_masks_it(batch):
    secret = "hf_SecretTokenInError1"
    with pytest.raises(EngineError) as err:
        batch.run(args=["--hf-token", secret], env={"FAKE_ENGINE_ECHO_ARGS": "fail"})
    assert "unrecognized arguments: --hf-token ***" in str(err.value)
    assert secret not in str(err.value)


def test_a_rendered_secret_is_registered_with_the_masker_before_the_rendered_fields_are_stored():
    import jinja2

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
    from tests.airflow_compat import redact

    operator = VLLMBatchOperator(
        task_id="t",
        input_uri="s3://b/in.jsonl",
        output_uri="s3://b/out/results.jsonl",
        model="m",
        engine=VLLMRunner(args=["--hf-token", "{{ params.token }}"], env={"HF_TOKEN": "{{ params.token }}x"}),
    )
    operator.render_template_fields(
        {"params": {"token": "hf_RenderedTokenAbc1"}}, jinja_env=jinja2.Environment()
    )
    assert operator.engine.args == ["--hf-token", "hf_RenderedTokenAbc1"]
    assert redact(list(operator.engine.args)) == ["--hf-token", "***"]
    assert "hf_RenderedTokenAbc1" not in str(redact(dict(operator.engine.env)))
    # What the rendered-fields view stores: the engine's options, its secrets masked.
    from airflow.sdk.execution_time.task_runner import _serialize_rendered_fields

    shown = _serialize_rendered_fields(operator)
    assert shown["engine"]["engine"] == "VLLMRunner"
    assert shown["engine"]["args"] == ["--hf-token", "***"]
    assert "hf_RenderedTokenAbc1" not in json.dumps(shown)


def test_an_http_inputs_credentials_are_masked_when_rendered():
    import jinja2
    from airflow import __version__ as airflow_version

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
    from tests.airflow_compat import redact

    operator = VLLMBatchOperator(
        task_id="t",
        input_uri="{{ params.url }}",
        output_uri="s3://b/out/results.jsonl",
        model="m",
        engine=VLLMRunner(),
    )
    operator.render_template_fields(
        {"params": {"url": "https://reader:RenderedPw123@files.example/in.jsonl"}},
        jinja_env=jinja2.Environment(),
    )
    assert "RenderedPw123" not in str(redact(operator.input_uri))
    assert "RenderedPw123" not in str(redact("a log line quoting reader:RenderedPw123@files.example"))
    if not airflow_version.startswith("3.0."):  # Airflow 3.0 stores a rendered string unredacted
        from airflow.sdk.execution_time.task_runner import _serialize_rendered_fields

        assert "RenderedPw123" not in json.dumps(_serialize_rendered_fields(operator))


def test_a_malformed_http_input_fails_without_retry_naming_input_uri_and_no_password(batch, capfd, caplog):
    from airflow_vllm_batch.version_compat import AirflowFailException

    with pytest.raises(
        AirflowFailException, match=r"^input_uri: https://files.example/in.jsonl is not a URL"
    ) as err:
        batch.run(input_uri="https://reader:MalformedPw9@files.example:notaport/in.jsonl")
    out, errs = capfd.readouterr()
    assert "MalformedPw9" not in str(err.value) + out + errs + caplog.text
    assert batch.engine_runs == 0
