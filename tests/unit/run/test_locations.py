"""A run's locations never collide: not its input, output, error file, manifest, lease, staging or answer cache (No strangers)."""

from __future__ import annotations

import pytest

from airflow_vllm_batch.exceptions import LocationError
from airflow_vllm_batch.run.locations import lease_uri, run_locations, staging_uri
from airflow_vllm_batch.run.settings import BatchSettings, check_static_settings

BASE = {"input_uri": "s3://b/in/input.jsonl", "output_uri": "s3://b/out/results.jsonl", "model": "m"}

#: (settings over BASE, the two parameters the message must name)
COLLIDING = {
    "output-is-input": ({"output_uri": "s3://b/in/input.jsonl"}, ("output_uri", "input_uri")),
    "error-is-input": ({"error_uri": "s3://b/in/input.jsonl"}, ("error_uri", "input_uri")),
    "default-error-file-is-input": (
        {"input_uri": "s3://b/out/results.errors.jsonl"},
        ("output_uri", "input_uri"),
    ),
    "manifest-is-input": ({"input_uri": "s3://b/out/results.manifest.json"}, ("output_uri", "input_uri")),
    "lease-is-input": ({"input_uri": "s3://b/out/results.lease.json"}, ("output_uri", "input_uri")),
    "input-under-staging": (
        {"input_uri": "s3://b/out/results.jsonl.staging/0123456789abcdef/input.jsonl"},
        ("output_uri", "input_uri"),
    ),
    "error-is-output": ({"error_uri": "s3://b/out/results.jsonl"}, ("error_uri", "output_uri")),
    "error-is-manifest": ({"error_uri": "s3://b/out/results.manifest.json"}, ("error_uri", "output_uri")),
    "error-is-lease": ({"error_uri": "s3://b/out/results.lease.json"}, ("error_uri", "output_uri")),
    "error-under-staging": (
        {"error_uri": "s3://b/out/results.jsonl.staging/x.jsonl"},
        ("error_uri", "output_uri"),
    ),
    "cache-holds-input": ({"answer_cache_uri": "s3://b/in/"}, ("input_uri", "answer_cache_uri")),
    "cache-holds-output": ({"answer_cache_uri": "s3://b/out/"}, ("output_uri", "answer_cache_uri")),
    "cache-is-whole-bucket": ({"answer_cache_uri": "s3://b/"}, ("output_uri", "answer_cache_uri")),
    "cache-under-staging": (
        {"answer_cache_uri": "s3://b/out/results.jsonl.staging/cache/"},
        ("output_uri", "answer_cache_uri"),
    ),
    "error-under-cache": (
        {"answer_cache_uri": "s3://c/cache/", "error_uri": "s3://c/cache/errors.jsonl"},
        ("error_uri", "answer_cache_uri"),
    ),
    "requests-prefix-holds-error": (
        {"input_uri": None, "requests": ["hi"], "error_uri": "s3://b/out/results.requests/e.jsonl"},
        ("requests", "error_uri"),
    ),
    "requests-prefix-under-cache": (
        {
            "input_uri": None,
            "requests": ["hi"],
            "output_uri": "s3://o/results.jsonl",
            "answer_cache_uri": "s3://o/results.requests/",
        },
        ("requests", "answer_cache_uri"),
    ),
}

APART = {
    "defaults": {},
    "other-bucket-same-key": {"output_uri": "s3://other/in/input.jsonl"},
    "cache-of-its-own": {"answer_cache_uri": "s3://b/answer-cache/"},
    "cache-prefix-sharing-a-name-start": {"answer_cache_uri": "s3://b/out/results.jsonl-cache/"},
    "error-beside": {"error_uri": "s3://b/out/failed.jsonl"},
    "local-input": {"input_uri": "/data/out/results.jsonl"},
    "requests": {"input_uri": None, "requests": ["hi"]},
}


@pytest.mark.parametrize(("values", "parameters"), COLLIDING.values(), ids=COLLIDING)
def test_colliding_locations_are_refused_when_the_settings_are_read_naming_both_parameters(
    values, parameters
):
    with pytest.raises(LocationError) as err:
        BatchSettings.from_rendered(**{**BASE, **values})
    message = str(err.value)
    for parameter in parameters:
        assert parameter in message
    assert "collide" in message
    assert "Give " in message
    assert "Nothing was run or written" in message
    assert not err.value.retryable


@pytest.mark.parametrize(("values", "parameters"), COLLIDING.values(), ids=COLLIDING)
def test_plain_colliding_locations_are_refused_at_dag_parse_time(values, parameters):
    with pytest.raises(LocationError, match="collide"):
        check_static_settings({**BASE, **values})


@pytest.mark.parametrize("values", APART.values(), ids=APART)
def test_locations_that_do_not_collide_are_accepted(values):
    BatchSettings.from_rendered(**{**BASE, **values})


def test_a_templated_location_is_checked_once_rendered_not_at_parse_time():
    templated = {**BASE, "output_uri": "{{ params.out }}", "error_uri": "s3://b/in/input.jsonl"}
    check_static_settings({**templated, "error_uri": None})  # nothing known to collide yet
    with pytest.raises(LocationError, match="error_uri and input_uri collide"):
        check_static_settings(templated)  # the plain ones still are checked
    with pytest.raises(LocationError, match="output_uri and input_uri collide"):
        BatchSettings.from_rendered(**{**BASE, "output_uri": BASE["input_uri"]})


def test_the_lease_and_staging_checked_are_where_the_store_puts_them():
    from unittest import mock

    from airflow_vllm_batch.storage.publishing import OutputStore

    store = OutputStore(mock.MagicMock(), BASE["output_uri"])
    lease = store.lease(mock.MagicMock())
    assert f"s3://{lease.bucket}/{lease.key}" == lease_uri(BASE["output_uri"])
    staging = store.staging(mock.MagicMock(short="0123456789abcdef"))
    assert f"s3://{staging.bucket}/{staging.prefix}".startswith(staging_uri(BASE["output_uri"]))
    labels = {loc.label for loc in run_locations(BASE)}
    assert {
        "the lease of output_uri",
        "the staging prefix of output_uri",
        "the manifest of output_uri",
    } <= labels
