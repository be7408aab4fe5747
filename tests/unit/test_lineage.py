"""OpenLineage datasets of a batch run, in the OpenLineage provider's own types."""

from __future__ import annotations

import os

import pytest

# The openlineage extra; without it the module still imports (test_lineage_optional.py).
pytest.importorskip("airflow.providers.openlineage")

from airflow.providers.common.compat.openlineage.facet import Dataset
from airflow.providers.openlineage.extractors import OperatorLineage

from airflow_vllm_batch.lineage import lineage_for

OUT = "s3://results-bucket/batches/2026-01-01/results.jsonl"
ERR = "s3://results-bucket/batches/2026-01-01/results.errors.jsonl"


@pytest.mark.parametrize(
    ("input_uri", "expected"),
    [
        (
            "s3://in-bucket/batches/input.jsonl",
            Dataset(namespace="s3://in-bucket", name="batches/input.jsonl"),
        ),
        ("/data/batches/input.jsonl", Dataset(namespace="file", name="/data/batches/input.jsonl")),
        (
            "https://files.example.com/batches/input.jsonl",
            Dataset(namespace="https://files.example.com", name="/batches/input.jsonl"),
        ),
        (
            "http://10.0.0.5:8333/b/input.jsonl",
            Dataset(namespace="http://10.0.0.5:8333", name="/b/input.jsonl"),
        ),
    ],
    ids=["s3", "local", "https", "http-with-port"],
)
def test_input_dataset_namespace_and_name(input_uri, expected):
    assert lineage_for(input_uri, OUT, None).inputs == [expected]


def test_relative_local_input_is_named_by_its_absolute_path():
    lineage = lineage_for("batches/input.jsonl", OUT, None)
    assert lineage.inputs == [Dataset(namespace="file", name=os.path.abspath("batches/input.jsonl"))]


def test_http_input_loses_query_string_and_user_info():
    lineage = lineage_for(
        "https://user:pw@s3.example.com/b/in.jsonl?X-Amz-Signature=abc&X-Amz-Credential=AK", OUT, None
    )
    (dataset,) = lineage.inputs
    assert (dataset.namespace, dataset.name) == ("https://s3.example.com", "/b/in.jsonl")


def test_outputs_are_only_the_results_when_no_error_file_was_published():
    lineage = lineage_for("s3://in/x.jsonl", OUT, None)
    assert lineage.outputs == [
        Dataset(namespace="s3://results-bucket", name="batches/2026-01-01/results.jsonl")
    ]


def test_error_file_is_an_output_when_it_was_published():
    lineage = lineage_for("s3://in/x.jsonl", OUT, ERR)
    assert lineage.outputs == [
        Dataset(namespace="s3://results-bucket", name="batches/2026-01-01/results.jsonl"),
        Dataset(namespace="s3://results-bucket", name="batches/2026-01-01/results.errors.jsonl"),
    ]


def test_returns_the_openlineage_providers_operator_lineage():
    assert isinstance(lineage_for("s3://in/x.jsonl", OUT, None), OperatorLineage)


def test_a_task_that_failed_before_writing_its_requests_has_no_input():
    lineage = lineage_for(None, "s3://b/out/results.jsonl", None)
    assert lineage.inputs == []
    assert [d.name for d in lineage.outputs] == ["out/results.jsonl"]
