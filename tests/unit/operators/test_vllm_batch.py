"""Unit tests of VLLMBatchOperator's pure parts: arguments, expiry, derived URIs."""

from __future__ import annotations

from datetime import timedelta

import pytest

from airflow_vllm_batch.exceptions import PresignError
from airflow_vllm_batch.operators.vllm_batch import (
    DEFAULT_PRESIGN_SECONDS,
    MAX_PRESIGN_SECONDS,
    PRESIGN_MARGIN_SECONDS,
    VLLMBatchOperator,
)


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


def test_expiry_follows_the_execution_timeout_plus_margin():
    op = make(execution_timeout=timedelta(hours=10))
    assert op.presign_seconds() == 10 * 3600 + PRESIGN_MARGIN_SECONDS


def test_expiry_defaults_to_a_day_without_a_timeout():
    assert make().presign_seconds() == DEFAULT_PRESIGN_SECONDS


def test_explicit_expiry_wins():
    assert make(presign_expires_in=600, execution_timeout=timedelta(hours=10)).presign_seconds() == 600


def test_expiry_past_sigv4_limit_is_a_clear_error():
    op = make(execution_timeout=timedelta(days=8))
    with pytest.raises(PresignError, match="7 days"):
        op.presign_seconds()
    assert make(presign_expires_in=MAX_PRESIGN_SECONDS).presign_seconds() == MAX_PRESIGN_SECONDS


def test_error_and_manifest_uris_sit_beside_the_output():
    op = make()
    assert op.resolved_error_uri == "s3://b/out/results.errors.jsonl"
    assert op.resolved_manifest_uri == "s3://b/out/results.manifest.json"
    assert make(error_uri="s3://b/e.jsonl").resolved_error_uri == "s3://b/e.jsonl"
