"""Run identity: what changes it, what does not, and how a change is named."""

from __future__ import annotations

import pytest

from airflow_vllm_batch.identity import PinnedInput, RunIdentity, local_file_tag

BASE = {
    "input": {"uri": "s3://b/in.jsonl", "etag": "e1", "version_id": None},
    "model": "m",
    "engine_args": ["--max-model-len", "4096"],
    "default_body": {"temperature": 0},
    "error_uri": "s3://b/out.errors.jsonl",
}


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("engine_args", ["--max-model-len", "2048"], "engine_args"),
        ("default_body", {"temperature": 0.5}, "default_body"),
        ("model", "m2", "model"),
        ("input", {"uri": "s3://b/in.jsonl", "etag": "e2", "version_id": None}, "input.etag"),
        ("error_uri", "s3://b/elsewhere.jsonl", "error_uri"),
    ],
)
def test_each_part_changes_the_fingerprint_and_is_named(key, value, named):
    before, after = RunIdentity(BASE), RunIdentity({**BASE, key: value})
    assert before.fingerprint != after.fingerprint
    assert after.changes_from(BASE) == [named]


def test_the_same_parts_in_another_order_give_the_same_fingerprint():
    assert RunIdentity(dict(reversed(list(BASE.items())))).fingerprint == RunIdentity(BASE).fingerprint


def test_an_http_input_is_never_the_same_run_twice_and_is_stored_redacted():
    url = "https://host/in.jsonl?X-Amz-Signature=secret"
    one, two = PinnedInput(url).components(), PinnedInput(url).components()
    assert one != two
    assert "secret" not in repr(one)
    assert PinnedInput(url).display_uri == "https://host/in.jsonl?<redacted>"


def test_a_local_file_is_pinned_by_its_content(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\n")
    first = local_file_tag(str(path))
    path.write_bytes(b"b\n")
    assert local_file_tag(str(path)) != first
