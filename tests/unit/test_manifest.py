"""The typed manifest: one shape for the operator, the merge and the CLI."""

from __future__ import annotations

import json

import pytest

from airflow_vllm_batch.exceptions import ManifestVersionError
from airflow_vllm_batch.manifest import (
    MANIFEST_SCHEMA_VERSION,
    Manifest,
    RequestCounts,
    Usage,
    schema_version,
)


def manifest(**extra) -> Manifest:
    return Manifest(
        output_uri="s3://b/r.jsonl",
        error_uri=None,
        input_uri="s3://b/in.jsonl",
        model="m",
        request_counts=RequestCounts(2, 2, 0),
        usage=Usage(5, 3, 8),
        duration_s=1.5,
        vllm_version="0.32.0",
        fingerprint="f" * 64,
        manifest_uri="s3://b/r.manifest.json",
        **extra,
    )


def test_the_xcom_shape_keeps_the_contract_keys_and_drops_unset_shard_fields():
    data = manifest().to_dict()
    assert data["error_uri"] is None
    assert data["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert data["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert "shards" not in data


def test_a_stored_manifest_reads_back_equal():
    original = manifest(shards=3, shard_manifest_uris=["s3://b/0.manifest.json", None, None])
    assert Manifest.from_json(original.to_json()) == original
    assert Manifest.from_dict(original.to_dict()) == original


def test_a_new_manifest_says_its_schema_version_and_reads_back_with_it():
    original = manifest()
    assert json.loads(original.to_json())["schema_version"] == MANIFEST_SCHEMA_VERSION == 1
    assert original.to_dict()["schema_version"] == 1
    assert Manifest.from_json(original.to_json()).schema_version == 1
    assert Manifest.from_dict(original.to_dict()) == original


def test_a_manifest_written_before_schema_version_reads_as_version_1():
    old = json.loads(manifest().to_json())
    del old["schema_version"]
    assert Manifest.from_json(json.dumps(old)).schema_version == 1
    assert Manifest.from_dict(old) == manifest()
    assert schema_version(old) == 1


@pytest.mark.parametrize("read", [Manifest.from_json, Manifest.from_dict, schema_version])
def test_a_manifest_of_a_newer_schema_is_refused_saying_to_upgrade(read):
    newer = {**manifest().to_dict(), "schema_version": MANIFEST_SCHEMA_VERSION + 1, "renamed": "x"}
    data = json.dumps(newer) if read == Manifest.from_json else newer
    with pytest.raises(
        ManifestVersionError,
        match=r"s3://b/r.manifest.json has schema_version 2, newer .* Upgrade airflow-vllm-batch",
    ) as err:
        read(data, "s3://b/r.manifest.json")
    assert not err.value.retryable


@pytest.mark.parametrize("version", [0, "1", True, None])
def test_a_schema_version_that_is_no_version_is_refused(version):
    with pytest.raises(ManifestVersionError, match="not a manifest schema version"):
        schema_version({**manifest().to_dict(), "schema_version": version})
