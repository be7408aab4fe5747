"""SeaweedFS as the embedded S3: real keys, real SigV4 checks, side-by-side instances, clean stops."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import pytest
import requests
from botocore.config import Config
from botocore.exceptions import ClientError

from vllm_batch_embedded.seaweedfs import (
    SeaweedFS,
    SeaweedFSError,
    find_weed_binary,
)

pytestmark = pytest.mark.integration

BUCKET = "embedded-tests"
CONN_ID = "embedded_s3_test"


def _process_gone(pid: int) -> bool:
    """True if ``pid`` has exited (a zombie awaiting its reaper counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return status.rsplit(")", 1)[1].split()[0] == "Z"


def _port_open(endpoint_url: str) -> bool:
    parts = urlsplit(endpoint_url)
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((parts.hostname, parts.port)) == 0


@pytest.fixture(scope="module")
def s3(seaweed: SeaweedFS) -> SeaweedFS:
    seaweed.create_bucket(BUCKET)
    return seaweed


@pytest.fixture
def hook(s3: SeaweedFS, monkeypatch: pytest.MonkeyPatch):
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", s3.airflow_connection_json())
    return S3Hook(aws_conn_id=CONN_ID)


def test_find_weed_binary_finds_the_packaged_binary():
    weed = find_weed_binary()
    version = subprocess.run([weed, "version"], capture_output=True, text=True, check=True).stdout
    assert "version" in version.lower()


def test_objects_round_trip_with_the_static_keys(s3):
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key="round/trip.txt", Body=b"hello")
    assert client.get_object(Bucket=BUCKET, Key="round/trip.txt")["Body"].read() == b"hello"


def test_create_bucket_twice_is_fine(s3):
    s3.create_bucket(BUCKET)
    assert BUCKET in {b["Name"] for b in s3.client().list_buckets()["Buckets"]}


def test_a_wrong_secret_key_is_refused(s3):
    client = boto3.client(
        "s3",
        endpoint_url=s3.endpoint_url,
        aws_access_key_id=s3.access_key,
        aws_secret_access_key="not-the-secret",
        region_name=s3.region,
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )
    with pytest.raises(ClientError) as err:
        client.list_objects_v2(Bucket=BUCKET)
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


def test_connection_json_is_an_airflow_aws_connection(s3):
    conn = json.loads(s3.airflow_connection_json())
    assert conn["conn_type"] == "aws"
    assert (conn["login"], conn["password"]) == (s3.access_key, s3.secret_key)
    assert conn["extra"]["endpoint_url"] == s3.endpoint_url
    assert conn["extra"]["region_name"] == "us-east-1"
    assert conn["extra"]["config_kwargs"]["signature_version"] == "s3v4"


def test_s3hook_reads_and_writes_through_the_connection(hook):
    hook.load_string("from airflow", key="hook/note.txt", bucket_name=BUCKET, replace=True)
    assert hook.read_key("hook/note.txt", BUCKET) == "from airflow"


def test_s3hook_presigned_urls_are_sigv4(hook):
    url = hook.generate_presigned_url("get_object", params={"Bucket": BUCKET, "Key": "any"}, expires_in=60)
    assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in url


def test_presigned_get_and_put_work_without_credentials(hook):
    put_url = hook.generate_presigned_url(
        "put_object", params={"Bucket": BUCKET, "Key": "presigned/data.jsonl"}, expires_in=60
    )
    assert requests.put(put_url, data=b'{"a": 1}\n', timeout=10).status_code == 200
    get_url = hook.generate_presigned_url(
        "get_object", params={"Bucket": BUCKET, "Key": "presigned/data.jsonl"}, expires_in=60
    )
    response = requests.get(get_url, timeout=10)
    assert (response.status_code, response.content) == (200, b'{"a": 1}\n')


def test_tampered_presigned_signature_is_refused(hook):
    hook.load_string("secret", key="presigned/tamper.txt", bucket_name=BUCKET, replace=True)
    url = hook.generate_presigned_url(
        "get_object", params={"Bucket": BUCKET, "Key": "presigned/tamper.txt"}, expires_in=60
    )
    signature = url.rsplit("X-Amz-Signature=", 1)[1][:64]
    flipped = ("0" if signature[0] != "0" else "1") + signature[1:]
    response = requests.get(url.replace(signature, flipped), timeout=10)
    assert response.status_code == 403
    assert "SignatureDoesNotMatch" in response.text


def test_expired_presigned_url_is_refused(hook):
    hook.load_string("soon gone", key="presigned/expired.txt", bucket_name=BUCKET, replace=True)
    url = hook.generate_presigned_url(
        "get_object", params={"Bucket": BUCKET, "Key": "presigned/expired.txt"}, expires_in=1
    )
    time.sleep(2)
    response = requests.get(url, timeout=10)
    assert response.status_code == 403
    assert "expired" in response.text.lower()


def test_two_instances_run_side_by_side(s3, tmp_path):
    with SeaweedFS(tmp_path / "second") as second:
        assert second.endpoint_url != s3.endpoint_url
        second.create_bucket("only-in-second")
        assert "only-in-second" not in {b["Name"] for b in s3.client().list_buckets()["Buckets"]}
        assert BUCKET in {b["Name"] for b in s3.client().list_buckets()["Buckets"]}


def test_stop_leaves_no_process_and_no_listener(tmp_path):
    server = SeaweedFS(tmp_path / "short-lived").start()
    pid, endpoint = server.pid, server.endpoint_url
    server.stop()
    assert pid is not None
    assert _process_gone(pid)
    assert not _port_open(endpoint)
    assert server.pid is None
    server.stop()  # a second stop is a no-op


def test_cli_starts_in_background_and_stops_by_pid(tmp_path):
    state = tmp_path / "s3.json"
    cli = [sys.executable, "-m", "vllm_batch_embedded.seaweedfs"]
    started = subprocess.run(
        [*cli, "start", "--dir", str(tmp_path / "data"), "--state", str(state), "--bucket", "demo"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    server = SeaweedFS.from_state_file(state)
    assert server.secret_key not in started.stdout
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert "demo" in {b["Name"] for b in server.client().list_buckets()["Buckets"]}

    subprocess.run([*cli, "stop", "--state", str(state)], capture_output=True, timeout=60, check=True)
    assert _process_gone(server.pid)
    assert not state.exists()


def test_start_failure_raises_with_the_log_tail(tmp_path):
    fake_weed = tmp_path / "weed"
    fake_weed.write_text("#!/bin/sh\necho 'bind: address already in use' >&2\nexit 3\n")
    fake_weed.chmod(0o755)
    server = SeaweedFS(tmp_path / "data", weed_binary=str(fake_weed), startup_timeout=5)
    with pytest.raises(SeaweedFSError, match="address already in use"):
        server.start()
    assert server.pid is None
