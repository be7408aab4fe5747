"""Unit tests of VLLMBatchOperator's pure parts: templated fields, the constructor, derived URIs."""

from __future__ import annotations

from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator


def make(**kwargs) -> VLLMBatchOperator:
    args = {"task_id": "t", "input_uri": "s3://b/in.jsonl", "output_uri": "s3://b/out/results.jsonl", "model": "m"}
    return VLLMBatchOperator(**{**args, **kwargs})


def test_every_user_facing_string_is_templated():
    assert {"input_uri", "output_uri", "error_uri", "model", "engine_args", "engine_env"} <= set(
        VLLMBatchOperator.template_fields
    )
    assert not getattr(VLLMBatchOperator, "template_ext", ())  # a .jsonl path is not a Jinja file


def test_constructor_stores_arguments_without_touching_s3():
    op = make(aws_conn_id="does-not-exist")
    assert "s3_hook" not in op.__dict__  # cached_property not yet built


def test_the_error_file_sits_beside_the_output():
    op = make()
    assert op.resolved_error_uri == "s3://b/out/results.errors.jsonl"
    assert make(error_uri="s3://b/e.jsonl").resolved_error_uri == "s3://b/e.jsonl"
