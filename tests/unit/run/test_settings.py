"""Unit tests of the run's settings: presigned URLs' life, rendered values, engine-specific checks."""

from __future__ import annotations

from datetime import timedelta

import pytest

from airflow_vllm_batch.exceptions import ConfigurationError, PresignError
from airflow_vllm_batch.run.settings import (
    DEFAULT_PRESIGN_SECONDS,
    DEFAULT_RESULTS_DIR,
    MAX_PRESIGN_SECONDS,
    PRESIGN_MARGIN_SECONDS,
    BatchSettings,
)


def make(**kwargs) -> BatchSettings:
    return BatchSettings.from_rendered(**{"input_uri": "s3://b/in.jsonl", "output_uri": "s3://b/out/results.jsonl", "model": "m", **kwargs})


def test_expiry_follows_the_execution_timeout_plus_margin():
    assert make(execution_timeout=timedelta(hours=10)).presign_seconds() == 10 * 3600 + PRESIGN_MARGIN_SECONDS


def test_expiry_defaults_to_a_day_without_a_timeout():
    assert make().presign_seconds() == DEFAULT_PRESIGN_SECONDS


def test_explicit_expiry_wins():
    assert make(presign_expires_in=600, execution_timeout=timedelta(hours=10)).presign_seconds() == 600


def test_expiry_past_sigv4_limit_is_a_clear_error():
    with pytest.raises(PresignError, match="7 days"):
        make(execution_timeout=timedelta(days=8)).presign_seconds()
    assert make(presign_expires_in=MAX_PRESIGN_SECONDS).presign_seconds() == MAX_PRESIGN_SECONDS


def test_a_rendered_ratio_string_becomes_a_number():
    assert make(max_failed_ratio="0.25").max_failed_ratio == 0.25


@pytest.mark.parametrize("ratio", ["x", "1.5", -0.1, None])
def test_a_ratio_outside_0_to_1_names_the_parameter(ratio):
    with pytest.raises(ConfigurationError, match="max_failed_ratio"):
        make(max_failed_ratio=ratio)


def test_none_values_take_the_defaults_but_aws_conn_id_none_is_kept():
    settings = make(results_dir=None, engine_env=None, default_body=None, aws_conn_id=None)
    assert settings.results_dir == DEFAULT_RESULTS_DIR
    assert settings.engine_env == {} and settings.default_body == {}
    assert settings.aws_conn_id is None  # boto3's own credential chain


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        make().model = "other"  # type: ignore[misc]


def test_an_unknown_engine_names_the_known_ones():
    with pytest.raises(ConfigurationError, match="engine must be one of .*'runner'.*'server'"):
        make(engine="gateway")
