"""The typed manifest: one shape for the operator, the merge and the CLI."""

from __future__ import annotations

from airflow_vllm_batch.manifest import Manifest, RequestCounts, Usage


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
