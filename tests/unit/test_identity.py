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


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {
                "engine": "VLLMRunner",
                "args": ["--hf-token", "hf_abcdefgh", "--max-model-len", "64"],
                "command": ["x", "y"],
            },
            {
                "engine_args": ["--hf-token", "<secret>", "--max-model-len", "64"],
                "engine_command": ["x", "y"],
            },
        ),
        (
            {"engine": "VLLMServer", "args": ["--max-model-len", "64"]},
            {"engine": "server", "engine_args": ["--max-model-len", "64"], "engine_command": []},
        ),
        (
            {"engine": "WarmVLLMServer", "conn_id": "c"},
            {"engine": "vllm_connection", "engine_args": None, "engine_command": None},
        ),
    ],
    ids=["runner", "server", "warm"],
)
def test_each_engines_part_of_the_identity_is_what_it_was_before_engines_took_options(options, expected):
    """Runs made before the options objects keep resuming: the same components (and so fingerprints) as the flat arguments gave."""
    import logging

    import airflow_vllm_batch.engines as engines
    from airflow_vllm_batch.run.settings import BatchSettings

    options = dict(options)
    engine = getattr(engines, options.pop("engine"))(**options)
    settings = BatchSettings.from_rendered(
        input_uri="s3://b/in.jsonl", output_uri="s3://b/out/r.jsonl", model="m", engine=engine
    )
    assert engines.make_engine(settings, logging.getLogger(__name__)).identity() == expected
