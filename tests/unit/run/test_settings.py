"""Unit tests of the run's settings: presigned URLs' life, rendered values, engine-specific checks."""

from __future__ import annotations

from datetime import timedelta

import pytest

from airflow_vllm_batch.engines import VLLMRunner, VLLMServer
from airflow_vllm_batch.exceptions import ConfigurationError, PresignError
from airflow_vllm_batch.run.settings import (
    DEFAULT_PRESIGN_SECONDS,
    DEFAULT_RESULTS_DIR,
    MAX_PRESIGN_SECONDS,
    PRESIGN_MARGIN_SECONDS,
    BatchSettings,
)


def make(**kwargs) -> BatchSettings:
    return BatchSettings.from_rendered(
        **{"input_uri": "s3://b/in.jsonl", "output_uri": "s3://b/out/results.jsonl", "model": "m", **kwargs}
    )


def test_expiry_follows_the_execution_timeout_plus_margin():
    assert make(execution_timeout=timedelta(hours=10)).presign_seconds() == 10 * 3600 + PRESIGN_MARGIN_SECONDS


def test_expiry_defaults_to_a_day_without_a_timeout():
    assert make().presign_seconds() == DEFAULT_PRESIGN_SECONDS


def test_explicit_expiry_wins():
    assert make(execution_timeout=timedelta(hours=10)).presign_seconds(600) == 600


def test_expiry_may_be_a_timedelta_as_airflow_durations_are():
    assert make().presign_seconds(timedelta(hours=2)) == 7200


@pytest.mark.parametrize("bad", [0, -5, 1.5, "600", True])
def test_an_expiry_that_is_no_duration_names_the_parameter(bad):
    with pytest.raises(ConfigurationError, match="presign_expires_in"):
        make(engine=VLLMRunner(presign_expires_in=bad))


def test_expiry_past_sigv4_limit_is_a_clear_error():
    with pytest.raises(PresignError, match="7 days"):
        make(execution_timeout=timedelta(days=8)).presign_seconds()
    assert make().presign_seconds(MAX_PRESIGN_SECONDS) == MAX_PRESIGN_SECONDS


def test_a_rendered_ratio_string_becomes_a_number():
    assert make(max_failed_ratio="0.25").max_failed_ratio == 0.25


@pytest.mark.parametrize("ratio", ["x", "1.5", -0.1, None])
def test_a_ratio_outside_0_to_1_names_the_parameter(ratio):
    with pytest.raises(ConfigurationError, match="max_failed_ratio"):
        make(max_failed_ratio=ratio)


def test_none_values_take_the_defaults_but_aws_conn_id_none_is_kept():
    settings = make(results_dir=None, engine=VLLMRunner(env=None), default_body=None, aws_conn_id=None)
    assert settings.results_dir == DEFAULT_RESULTS_DIR
    assert settings.engine.env == {}
    assert settings.default_body == {}
    assert settings.aws_conn_id is None  # boto3's own credential chain


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        make().model = "other"  # type: ignore[misc]


def test_an_engine_that_is_no_engines_options_names_them():
    with pytest.raises(ConfigurationError, match=r"engine must be an engine's options, e.g. VLLMRunner"):
        make(engine="server")


def test_no_engine_is_vllms_batch_runner():
    assert isinstance(make().engine, VLLMRunner)
    assert make().engine.args == ()


@pytest.mark.parametrize(("given", "seconds"), [(timedelta(minutes=2), 120.0), (90, 90.0), (2.5, 2.5)])
def test_the_server_durations_take_a_timedelta_or_seconds(given, seconds):
    options = make(
        engine=VLLMServer(
            startup_timeout=given, request_timeout=given, checkpoint_interval=given, kill_grace=given
        )
    ).engine
    assert (
        options.startup_timeout_s,
        options.request_timeout_s,
        options.checkpoint_interval_s,
        options.kill_grace_s,
    ) == (seconds,) * 4


def test_the_default_durations_are_the_engines_own():
    from airflow_vllm_batch.engines.vllm.process import DEFAULT_GRACE_S
    from airflow_vllm_batch.engines.vllm.server_process import DEFAULT_STARTUP_TIMEOUT_S
    from airflow_vllm_batch.serving.journal import DEFAULT_CHECKPOINT_INTERVAL_S
    from airflow_vllm_batch.serving.stream import DEFAULT_REQUEST_TIMEOUT_S

    options = VLLMServer()
    assert (
        options.startup_timeout_s,
        options.request_timeout_s,
        options.checkpoint_interval_s,
        options.kill_grace_s,
    ) == (
        DEFAULT_STARTUP_TIMEOUT_S,
        DEFAULT_REQUEST_TIMEOUT_S,
        DEFAULT_CHECKPOINT_INTERVAL_S,
        DEFAULT_GRACE_S,
    )


@pytest.mark.parametrize("name", ["startup_timeout", "request_timeout", "checkpoint_interval"])
@pytest.mark.parametrize("bad", [0, -5, timedelta(0), "10", True])
def test_a_duration_that_is_not_positive_fails_at_dag_parse_time_naming_it(name, bad):
    from airflow_vllm_batch.run.settings import check_static_settings

    with pytest.raises(
        ConfigurationError, match=rf"^{name} must be a datetime.timedelta or a number of seconds > 0"
    ):
        check_static_settings(
            {
                "input_uri": "s3://b/in.jsonl",
                "output_uri": "s3://b/o.jsonl",
                "model": "m",
                "engine": VLLMServer(**{name: bad}),
            }
        )


def test_a_started_server_gets_its_timeouts():
    import logging

    from airflow_vllm_batch.engines.server import ServerEngine

    settings = make(engine=VLLMServer(startup_timeout=timedelta(seconds=42), request_timeout=7))
    server = ServerEngine(settings, logging.getLogger(__name__)).server
    assert (server.startup_timeout_s, server.request_timeout_s) == (42.0, 7.0)
