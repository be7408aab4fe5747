"""Every branch of resume, recovery, staging, publishing and the lease, in seconds.

Real S3 (SeaweedFS) and an engine stand-in (``fake_runner.py``, through ``engine_command``);
the integration tests run the same paths with the real vLLM engine and Airflow's retries.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import sys
import threading
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from airflow_vllm_batch.engines import VLLMRunner
from airflow_vllm_batch.exceptions import (
    OutputBusyError,
    PublishError,
    ResultsCheckError,
    StorageUnavailableError,
)
from airflow_vllm_batch.lease import LeaseHolder
from airflow_vllm_batch.manifest import is_tombstone
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.run import InputLimits
from airflow_vllm_batch.storage.staging import RunStaging
from airflow_vllm_batch.version_compat import AirflowFailException

FAKE_RUNNER = Path(__file__).with_name("fake_runner.py")


class FakeTI:
    """What the operator uses of a task instance."""

    def __init__(self, try_number: int = 1, run_id: str = "run-1", map_index: int = -1) -> None:
        self.dag_id, self.task_id, self.run_id = "d", "vllm_batch", run_id
        self.try_number, self.map_index = try_number, map_index
        self.xcoms: dict = {}

    def xcom_push(self, key: str, value) -> None:
        self.xcoms[key] = value


def chat_lines(n: int, model: str = "m") -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": model, "messages": [{"role": "user", "content": f"hi {i}"}]},
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


#: The keyword arguments of the helpers that are the runner's options.
RUNNER_FIELDS = {f.name for f in dataclasses.fields(VLLMRunner)}


class Batch:
    """One input and output in a fresh bucket, and a way to run the operator on them."""

    def __init__(self, s3, bucket: str, tmp_path: Path) -> None:
        self.client = s3.client()
        self.bucket = bucket
        self.calls = tmp_path / "engine-calls.txt"
        self.results_dir = tmp_path / "results"
        #: The subdirectory of results_dir the runs own (scratch, kept results).
        self.scratch_dir = self.results_dir / "airflow-vllm-batch"
        self.input_uri = f"s3://{bucket}/in/input.jsonl"
        self.output_uri = f"s3://{bucket}/out/results.jsonl"
        self.put("in/input.jsonl", chat_lines(5))

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def keys(self, prefix: str = "") -> list[str]:
        return [
            o["Key"]
            for o in self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix).get("Contents", [])
        ]

    @property
    def engine_runs(self) -> int:
        return len(self.calls.read_text().splitlines()) if self.calls.exists() else 0

    def operator(self, **kwargs) -> VLLMBatchOperator:
        """The operator on the fake runner; the keyword arguments that are ``VLLMRunner``'s go to it."""
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in RUNNER_FIELDS}
        options["env"] = {"FAKE_ENGINE_CALLS": str(self.calls), **(options.get("env") or {})}
        options.setdefault("command", [sys.executable, str(FAKE_RUNNER)])
        args = {
            "task_id": "vllm_batch",
            "input_uri": self.input_uri,
            "output_uri": self.output_uri,
            "model": "m",
            "engine": VLLMRunner(**options),
            "results_dir": str(self.results_dir),
        }
        return VLLMBatchOperator(**{**args, **kwargs})

    def run(self, ti: FakeTI | None = None, **kwargs) -> dict:
        return self.operator(**kwargs).execute({"ti": ti or FakeTI(), "outlet_events": {}})


@pytest.fixture
def batch(s3, bucket, tmp_path) -> Batch:
    return Batch(s3, bucket, tmp_path)


def test_first_run_publishes_results_and_manifest_and_leaves_no_staging_lease_or_scratch(batch):
    manifest = batch.run()
    assert manifest["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert manifest["error_uri"] is None
    assert len(batch.get("out/results.jsonl").splitlines()) == 5
    assert json.loads(batch.get("out/results.manifest.json"))["fingerprint"] == manifest["fingerprint"]
    assert sorted(batch.keys()) == ["in/input.jsonl", "out/results.jsonl", "out/results.manifest.json"]
    assert list(batch.scratch_dir.iterdir()) == []
    assert batch.engine_runs == 1


def test_same_identity_returns_the_published_manifest_without_the_engine(batch):
    first = batch.run()
    again = batch.run(FakeTI(run_id="backfill-rerun"))
    assert again == first
    assert batch.engine_runs == 1


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"args": ["--max-model-len", "64"]}, "engine_args"),
        ({"default_body": {"max_completion_tokens": 3}}, "default_body"),
        ({"invalid_lines": "skip"}, "invalid_lines"),
        ({"limits": InputLimits(max_lines=100)}, "max_lines"),
        ({"error_uri": "s3://{bucket}/elsewhere/errors.jsonl"}, "error_uri"),
        ({"rewrite_model": True}, "rewrite_model"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_changed_setting_runs_again_and_the_log_names_it(batch, capfd, change, named):
    batch.run()
    change = {k: v.format(bucket=batch.bucket) if isinstance(v, str) else v for k, v in change.items()}
    capfd.readouterr()
    manifest = batch.run(**change)
    assert batch.engine_runs == 2
    assert f"made by a different run (changed: {named})" in capfd.readouterr().out
    value = next(iter(change.values()))
    assert manifest["identity"][named] == (getattr(value, named) if isinstance(value, InputLimits) else value)


def test_an_overwritten_input_is_a_new_run(batch, capfd):
    batch.run()
    batch.put("in/input.jsonl", chat_lines(6))
    capfd.readouterr()
    manifest = batch.run()
    assert manifest["request_counts"]["total"] == 6
    assert batch.engine_runs == 2
    assert "(changed: input.etag)" in capfd.readouterr().out


def test_results_that_fail_the_check_are_dropped_so_the_retry_runs_the_engine(batch):
    with pytest.raises(ResultsCheckError, match="custom_id 'r4'\\): has no result"):
        batch.run(env={"FAKE_ENGINE_DROP": "1"})
    assert not [k for k in batch.keys() if k.endswith("results.jsonl") and ".staging/" in k]
    assert list(batch.scratch_dir.iterdir()) == []  # a failed try leaves no scratch behind
    manifest = batch.run(FakeTI(try_number=2))
    assert manifest["request_counts"]["completed"] == 5
    assert batch.engine_runs == 2


def test_staged_results_are_published_by_a_retry_without_the_engine(batch, monkeypatch):
    from airflow_vllm_batch.storage.publishing import OutputStore

    real_publish = OutputStore.publish

    def s3_fails(self, *args, **kwargs):
        raise ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "down"}}, "PutObject")

    monkeypatch.setattr(OutputStore, "publish", s3_fails)
    with pytest.raises(PublishError, match="a retry publishes them without running the engine"):
        batch.run()
    assert any(k.endswith(".staging/" + k.split(".staging/")[1]) for k in batch.keys("out/"))
    monkeypatch.setattr(OutputStore, "publish", real_publish)
    # The retry may land on another worker: the local scratch is gone either way.
    assert list(batch.scratch_dir.iterdir()) == []
    manifest = batch.run(FakeTI(try_number=2))
    assert manifest["request_counts"]["completed"] == 5
    assert batch.engine_runs == 1
    assert not [k for k in batch.keys() if ".staging/" in k]


def test_s3_gone_right_after_staging_says_a_retry_publishes_the_staged_results(batch, monkeypatch):
    # The first S3 call after staging is the check that the input was not overwritten while
    # the engine read it: its failure must still tell the user what is kept and what to do.
    from airflow_vllm_batch.run.inputs import BatchInput

    real_confirm = BatchInput.confirm_unchanged

    def s3_gone(self):
        raise StorageUnavailableError(
            f"S3 failed while checking that {self.uri} is unchanged (connection refused)."
        )

    monkeypatch.setattr(BatchInput, "confirm_unchanged", s3_gone)
    with pytest.raises(
        PublishError,
        match=r"S3 failed while publishing: .* a retry publishes them without running the engine",
    ):
        batch.run()
    monkeypatch.setattr(BatchInput, "confirm_unchanged", real_confirm)
    manifest = batch.run(FakeTI(try_number=2))
    assert manifest["request_counts"]["completed"] == 5
    assert batch.engine_runs == 1


def test_results_kept_on_the_worker_when_staging_failed_are_published_by_the_retry(batch, monkeypatch):
    real_put = RunStaging.put_results

    def s3_fails(self, path):
        raise ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "down"}}, "PutObject")

    monkeypatch.setattr(RunStaging, "put_results", s3_fails)
    with pytest.raises(PublishError, match=r"kept at .* a retry on this worker publishes them") as err:
        batch.run()
    (kept,) = batch.scratch_dir.glob("*/results.jsonl")
    assert str(kept) in str(err.value)
    monkeypatch.setattr(RunStaging, "put_results", real_put)
    manifest = batch.run(FakeTI(try_number=2))
    assert manifest["request_counts"]["completed"] == 5
    assert batch.engine_runs == 1
    assert not kept.exists()


def test_kept_results_the_check_rejects_are_dropped_so_the_next_try_runs_the_engine(batch, monkeypatch):
    real_put = RunStaging.put_results

    def s3_fails(self, path):
        raise ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "down"}}, "PutObject")

    monkeypatch.setattr(RunStaging, "put_results", s3_fails)
    with pytest.raises(PublishError):
        batch.run()
    monkeypatch.setattr(RunStaging, "put_results", real_put)
    (kept,) = batch.scratch_dir.glob("*/results.jsonl")
    kept.write_bytes(b"".join(kept.read_bytes().splitlines(keepends=True)[:-1]))  # a request left unanswered

    with pytest.raises(ResultsCheckError):
        batch.run(FakeTI(try_number=2))
    assert not kept.exists()
    manifest = batch.run(FakeTI(try_number=3))
    assert manifest["request_counts"]["completed"] == 5
    assert batch.engine_runs == 2


def test_a_publish_that_fails_midway_leaves_no_manifest_to_trust(batch, monkeypatch):
    from airflow_vllm_batch.storage.publishing import OutputStore

    batch.run()
    batch.put("in/input.jsonl", chat_lines(7))

    def manifest_write_fails(self, manifest, over=None):
        raise ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "down"}}, "PutObject")

    monkeypatch.setattr(OutputStore, "write_manifest", manifest_write_fails)
    with pytest.raises(PublishError):
        batch.run()
    # The old manifest went first (a tombstone took its place): nobody pairs it with the new results file.
    assert is_tombstone(batch.get("out/results.manifest.json"))


def test_publishing_removes_only_this_runs_staging(batch):
    batch.put("out/results.jsonl.staging/0123456789abcdef/results.jsonl", b"another run's work\n")
    batch.run()
    assert "out/results.jsonl.staging/0123456789abcdef/results.jsonl" in batch.keys()


def _hold(batch: Batch, holder: LeaseHolder) -> None:
    batch.put("out/results.lease.json", json.dumps(holder.__dict__).encode())


def test_a_second_run_on_a_held_output_fails_fast_naming_the_holder(batch):
    _hold(batch, LeaseHolder("other_dag", "scheduled__2026-11-01", "vllm_batch", -1, 1, "f" * 64, "gpu-7"))
    with pytest.raises(
        OutputBusyError, match=r"other_dag\.vllm_batch of run 'scheduled__2026-11-01' \(try 1, on gpu-7\)"
    ):
        batch.run()
    assert batch.engine_runs == 0
    assert "out/results.jsonl" not in batch.keys()


def test_a_retry_of_the_same_task_instance_takes_over_its_own_dead_lease(batch):
    _hold(batch, LeaseHolder("d", "run-1", "vllm_batch", -1, 1, "f" * 64, "gpu-7"))
    manifest = batch.run(FakeTI(try_number=2))
    assert manifest["request_counts"]["completed"] == 5
    assert "out/results.lease.json" not in batch.keys()


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_failed_ratio": "abc"}, "max_failed_ratio must be a number from 0 to 1, got 'abc'"),
        ({"max_failed_ratio": None}, "max_failed_ratio must be a number from 0 to 1, got None"),
        ({"output_uri": "/tmp/results.jsonl"}, "output_uri must be an s3://bucket/key URI"),
        ({"error_uri": "errors.jsonl"}, "error_uri must be an s3://bucket/key URI"),
        (
            {"input_uri": "s3://{bucket}/in/typo.jsonl"},
            "input_uri: s3://{bucket}/in/typo.jsonl does not exist",
        ),
        ({"input_uri": "/nonexistent/input.jsonl"}, "input_uri: no file '/nonexistent/input.jsonl'"),
        (
            {"output_uri": "s3://no-such-bucket-here/r.jsonl"},
            "output_uri: bucket 'no-such-bucket-here' does not exist",
        ),
        (
            {"error_uri": "s3://no-such-bucket-here/e.jsonl"},
            "error_uri: bucket 'no-such-bucket-here' does not exist",
        ),
    ],
)
def test_a_mistake_fails_without_retry_before_any_engine(batch, kwargs, fragment):
    kwargs = {k: v.format(bucket=batch.bucket) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(
        AirflowFailException,
        match=fragment.format(bucket=batch.bucket).replace("(", r"\(").replace(")", r"\)"),
    ):
        batch.run(**kwargs)
    assert batch.engine_runs == 0


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"args": "--max-model-len 64"}, "args must be a list of strings"),
        ({"command": "python -m vllm"}, "command must be a list of strings"),
    ],
)
def test_a_malformed_engine_option_fails_at_dag_parse_time(batch, kwargs, fragment):
    from airflow_vllm_batch.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match=fragment):
        batch.operator(**kwargs)


@pytest.mark.parametrize("name", ["output_mode", "invalid_lines"])
def test_a_bad_mode_fails_at_dag_parse_time(batch, name):
    from airflow_vllm_batch.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match=name):
        batch.operator(**{name: "ignore"})


def test_presigned_mode_stages_through_a_presigned_put_and_publishes(batch):
    manifest = batch.run(output_mode="presigned")
    assert manifest["request_counts"]["completed"] == 5
    assert not [k for k in batch.keys() if ".staging/" in k]


@pytest.fixture
def http_input(tmp_path):
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "input.jsonl").write_bytes(chat_lines(3))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # the test server's own access log is not the operator's
            pass

    handler = lambda *a: Quiet(*a, directory=str(tmp_path / "www"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/input.jsonl?X-Amz-Signature=topsecret123&X-Amz-Credential=AKIDSECRET"
    server.shutdown()


def test_an_http_input_with_credentials_is_stored_and_logged_redacted(batch, http_input, capfd):
    ti = FakeTI()
    manifest = batch.run(ti, input_uri=http_input)
    assert manifest["request_counts"]["completed"] == 3
    stored = batch.get("out/results.manifest.json").decode()
    logged = capfd.readouterr()
    assert "Preflight of http://127.0.0.1" in logged.out
    for text in (json.dumps(manifest), stored, json.dumps(ti.xcoms), logged.out, logged.err):
        assert "topsecret123" not in text
        assert "AKIDSECRET" not in text
    assert manifest["input_uri"].endswith("/input.jsonl?<redacted>")


def test_an_http_input_is_never_resumed(batch, http_input):
    batch.run(input_uri=http_input)
    batch.run(input_uri=http_input)
    assert batch.engine_runs == 2


def test_the_input_is_read_once_from_s3_by_the_operator_and_once_by_the_engine(batch, monkeypatch):
    import airflow_vllm_batch.storage.s3 as storage

    reads = []
    real_body = storage.s3_body

    def counting_body(hook, bucket, key, **pin):
        reads.append(key)
        return real_body(hook, bucket, key, **pin)

    monkeypatch.setattr(storage, "s3_body", counting_body)
    batch.run()
    # Preflight reads it (pinned); the results check uses preflight's index instead of a re-read.
    assert reads.count("in/input.jsonl") == 1
    assert batch.engine_runs == 1


def test_leftovers_of_killed_tries_are_aged_out_of_the_results_dir(batch):
    import os
    import time

    stale = batch.scratch_dir / "0123456789abcdef-try-dead"
    stale.mkdir(parents=True)
    (stale / "engine-results.jsonl").write_bytes(b"x\n")
    week_ago = time.time() - 8 * 24 * 3600
    os.utime(stale, (week_ago, week_ago))
    fresh = batch.scratch_dir / "fedcba9876543210"
    fresh.mkdir()
    batch.run()
    assert not stale.exists()
    assert fresh.exists()


def test_a_users_old_files_in_results_dir_are_never_aged_out(batch):
    # results_dir may be a data disk: the runs own only their subdirectory, and in it only what they made.
    import os
    import time

    month_ago = time.time() - 30 * 24 * 3600
    notes = batch.results_dir / "notes.txt"
    weights = batch.results_dir / "models" / "llama" / "weights.bin"
    stranger = (
        batch.scratch_dir / "my-own-file.txt"
    )  # not a name a run makes, even in the runs' own directory
    for path in (notes, weights, stranger):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"mine\n")
    for path in (notes, weights, weights.parent, weights.parent.parent, stranger):
        os.utime(path, (month_ago, month_ago))
    own_stale = batch.scratch_dir / "0123456789abcdef-try-dead"
    own_stale.mkdir()
    os.utime(own_stale, (month_ago, month_ago))
    batch.run()
    batch.run(resume=False)
    assert notes.read_bytes() == weights.read_bytes() == stranger.read_bytes() == b"mine\n"
    assert not own_stale.exists()


def test_failures_are_counted_by_reason_in_the_manifest_and_the_log_ends_with_a_summary_table(batch, capfd):
    batch.put("in/input.jsonl", chat_lines(5) + b'{"custom_id": "bad", "method": "GET"}\n')
    manifest = batch.run(invalid_lines="skip", max_failed_ratio=0.5, env={"FAKE_ENGINE_FAIL": "2"})
    assert manifest["request_counts"] == {"total": 6, "completed": 3, "failed": 3}
    assert manifest["failed_by_reason"] == {"engine_error": 2, "invalid_request": 1}
    stored = json.loads(batch.get("out/results.manifest.json"))
    assert stored["failed_by_reason"] == manifest["failed_by_reason"]
    log = capfd.readouterr().out
    table = log[log.index("vLLM batch: 3 of 6 requests completed, 3 failed") :]
    assert "| failed: engine_error" in table
    assert "2, e.g. r0: Internal error while generating" in table
    assert "| failed: invalid_request" in table
    assert "1, e.g. bad:" in table
    assert "| results  " in table
    assert batch.output_uri in table
    assert "results.errors.jsonl" in table
    assert "X-Amz-Signature" not in log


def test_a_reused_output_says_no_engine_ran_and_keeps_the_counts_by_reason(batch, capfd):
    batch.put("in/input.jsonl", chat_lines(5) + b'{"custom_id": "bad", "method": "GET"}\n')
    batch.run(invalid_lines="skip", max_failed_ratio=0.5)
    capfd.readouterr()
    again = batch.run(FakeTI(run_id="backfill-rerun"), invalid_lines="skip", max_failed_ratio=0.5)
    assert again["failed_by_reason"] == {"invalid_request": 1}
    assert batch.engine_runs == 1
    log = capfd.readouterr().out
    assert "Not running the engine again" in log
    assert "(reused: no engine ran in this try)" in log
    assert "1 (see the error file)" in log


def test_a_run_without_failures_has_no_failed_by_reason(batch):
    assert "failed_by_reason" not in batch.run()


def _successor_takes_over(batch: Batch) -> None:
    """The task's next try (its scheduler thought this one dead) takes the output's lease."""
    _hold(batch, LeaseHolder("d", "run-1", "vllm_batch", -1, 2, "f" * 64, "gpu-2"))


def test_a_try_that_lost_its_lease_while_the_engine_ran_stages_and_publishes_nothing(batch, monkeypatch):
    from airflow_vllm_batch.hooks.vllm import VLLMEngineHook

    real_run = VLLMEngineHook.run

    def run_then_lose_the_lease(self, *args, **kwargs):
        run = real_run(self, *args, **kwargs)
        _successor_takes_over(batch)  # between two heartbeats: only a read of S3 can tell
        return run

    monkeypatch.setattr(VLLMEngineHook, "run", run_then_lose_the_lease)
    with pytest.raises(
        OutputBusyError, match=r"d\.vllm_batch of run 'run-1' \(try 2, on gpu-2\) took over the lease"
    ):
        batch.run()
    assert sorted(k for k in batch.keys() if not k.startswith("in/")) == [
        "out/results.lease.json"
    ]  # the successor's


def _output(batch) -> dict[str, tuple[bytes, str]]:
    """The published output's files (not the lease, the input or the staging), with their bytes and ETags."""
    keys = [k for k in batch.keys("out/") if not k.endswith(".lease.json") and ".staging/" not in k]
    return {k: (batch.get(k), batch.client.head_object(Bucket=batch.bucket, Key=k)["ETag"]) for k in keys}


def test_a_try_that_lost_its_lease_before_publishing_leaves_the_published_output_untouched(
    batch, monkeypatch
):
    from airflow_vllm_batch.storage.publishing import OutputStore

    # An output published earlier (by a run this one does not resume: its manifest is not this run's).
    batch.put("out/results.jsonl", b"earlier results\n")
    batch.put("out/results.errors.jsonl", b"earlier errors\n")
    batch.put("out/results.manifest.json", b'{"an": "earlier manifest"}')
    before = _output(batch)
    real_publish = OutputStore.publish

    def lose_the_lease_then_publish(self, *args, **kwargs):
        _successor_takes_over(batch)
        return real_publish(self, *args, **kwargs)

    monkeypatch.setattr(OutputStore, "publish", lose_the_lease_then_publish)
    with pytest.raises(OutputBusyError, match="took over the lease"):
        batch.run()
    assert _output(batch) == before


def test_a_try_whose_predecessor_published_while_it_took_the_lease_returns_that_output_untouched(
    batch, monkeypatch
):
    from airflow_vllm_batch.storage.publishing import OutputStore

    real_check_writable = OutputStore.check_writable
    published = []

    def predecessor_publishes_first(self):
        # After this try found no complete output, its predecessor (a zombie to Airflow) publishes and lets go.
        monkeypatch.setattr(OutputStore, "check_writable", real_check_writable)
        published.append((batch.run(FakeTI(try_number=1)), _output(batch)))
        return real_check_writable(self)

    monkeypatch.setattr(OutputStore, "check_writable", predecessor_publishes_first)
    manifest = batch.run(FakeTI(try_number=2))
    assert (manifest, _output(batch)) == published[0]
    assert batch.engine_runs == 1


def test_access_denied_while_writing_requests_fails_without_retry_naming_the_location(batch, monkeypatch):
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    def denied(self, *args, **kwargs):
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "PutObject")

    monkeypatch.setattr(S3Hook, "load_bytes", denied)
    with pytest.raises(AirflowFailException, match=f"output_uri: .*{batch.bucket}"):
        batch.run(input_uri=None, requests=["hello"])
    assert batch.engine_runs == 0
