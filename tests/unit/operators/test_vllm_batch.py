"""Unit tests of VLLMBatchOperator's pure parts: templated fields, the constructor, derived URIs."""

from __future__ import annotations

from airflow_vllm_batch.engines import VLLMRunner, VLLMServer, WarmVLLMServer
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator


def make(**kwargs) -> VLLMBatchOperator:
    args = {
        "task_id": "t",
        "input_uri": "s3://b/in.jsonl",
        "output_uri": "s3://b/out/results.jsonl",
        "model": "m",
    }
    return VLLMBatchOperator(**{**args, **kwargs})


def test_every_user_facing_string_is_templated():
    assert {"input_uri", "output_uri", "error_uri", "model", "engine"} <= set(
        VLLMBatchOperator.template_fields
    )
    assert {"args", "python", "command", "env"} <= set(VLLMRunner.template_fields)
    assert {"args", "python", "env"} <= set(VLLMServer.template_fields)
    assert "conn_id" in WarmVLLMServer.template_fields
    assert not getattr(VLLMBatchOperator, "template_ext", ())  # a .jsonl path is not a Jinja file


def test_constructor_stores_arguments_without_touching_s3():
    op = make(aws_conn_id="does-not-exist")
    assert "hook" not in op.__dict__  # cached_property not yet built


def test_amazon_connection_settings_reach_the_s3_hook():
    """As every amazon operator (AwsBaseOperator): region_name, verify and botocore_config configure the S3Hook."""
    op = make(
        aws_conn_id="my_aws",
        region_name="eu-west-3",
        verify="/etc/ca.pem",
        botocore_config={"retries": {"max_attempts": 7}},
    )
    hook = op.hook
    assert type(hook).__name__ == "S3Hook"
    assert (hook.aws_conn_id, hook.region_name, hook.verify) == ("my_aws", "eu-west-3", "/etc/ca.pem")
    assert hook.config.retries == {"max_attempts": 7}


def test_amazon_connection_settings_are_templated():
    assert {"aws_conn_id", "region_name", "verify"} <= set(VLLMBatchOperator.template_fields)


def test_the_error_file_sits_beside_the_output():
    op = make()
    assert op.resolved_error_uri == "s3://b/out/results.errors.jsonl"
    assert make(error_uri="s3://b/e.jsonl").resolved_error_uri == "s3://b/e.jsonl"


def test_the_operator_takes_at_most_18_parameters_of_its_own():
    import inspect

    own = [
        p
        for p in inspect.signature(VLLMBatchOperator.__init__).parameters.values()
        if p.kind is p.KEYWORD_ONLY
    ]
    assert len(own) <= 18, [p.name for p in own]


def test_an_options_object_shared_by_two_tasks_is_rendered_for_each_alone():
    engine = VLLMRunner(args=["--served-model-name", "{{ task.task_id }}"])
    first, second = make(task_id="first", engine=engine), make(task_id="second", engine=engine)
    first.render_template_fields({"task": first})
    second.render_template_fields({"task": second})
    assert (first.engine.args, second.engine.args) == (
        ["--served-model-name", "first"],
        ["--served-model-name", "second"],
    )
