"""The ``airflow-vllm-batch`` console script on real S3 (SeaweedFS), as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CLI = str(Path(sys.executable).with_name("airflow-vllm-batch"))
GOOD = (
    '{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "hi"}}\n'
)
BAD = (
    GOOD
    + '{"custom_id": "b", "method": "GET", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}}\n'
)


def _cli(env_s3, *args: str) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "AIRFLOW_CONN_CLI_S3": env_s3.airflow_connection_json()}
    return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def files(seaweed):
    client = seaweed.client()
    client.create_bucket(Bucket="cli")
    client.put_object(Bucket="cli", Key="good.jsonl", Body=GOOD.encode())
    client.put_object(Bucket="cli", Key="with space+plus/bad.jsonl", Body=BAD.encode())
    return seaweed


def test_validate_on_an_s3_uri_exits_zero_for_a_clean_file(files):
    proc = _cli(files, "validate", "s3://cli/good.jsonl", "--aws-conn-id", "cli_s3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["valid_lines"] == 1


def test_validate_on_an_s3_uri_names_the_bad_line_and_exits_one(files):
    proc = _cli(files, "validate", "s3://cli/with space+plus/bad.jsonl", "--aws-conn-id", "cli_s3")
    assert proc.returncode == 1
    assert "line 2" in proc.stdout
    assert "POST" in proc.stdout


def test_validate_on_an_s3_uri_prints_no_airflow_log_lines(files):
    proc = _cli(files, "validate", "s3://cli/good.jsonl", "--aws-conn-id", "cli_s3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "connection_wrapper" not in proc.stdout
    assert "secrets_masker" not in proc.stdout


def test_validate_on_a_missing_bucket_names_the_bucket_and_the_fix(files):
    proc = _cli(files, "validate", "s3://no-such-bucket/good.jsonl", "--aws-conn-id", "cli_s3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: s3://no-such-bucket/good.jsonl: bucket 'no-such-bucket' does not exist (or connection 'cli_s3' cannot "
        "see it) — check the bucket's name, create it, or pass the connection of the account that has it with --aws-conn-id"
    ]


def test_validate_on_a_missing_key_names_the_key(files):
    proc = _cli(files, "validate", "s3://cli/nope.jsonl", "--aws-conn-id", "cli_s3")
    assert proc.returncode == 2
    assert "bucket 'cli' has no object 'nope.jsonl'" in proc.stderr
    assert "404" not in proc.stderr
