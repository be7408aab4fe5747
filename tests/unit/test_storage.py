"""The storage module on a real S3: pinned reads, location checks, what counts as complete, fencing."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from botocore.exceptions import ClientError

from airflow_vllm_batch.batchfile import Failed, Text
from airflow_vllm_batch.exceptions import (
    InputChangedError,
    InputNotFoundError,
    LocationError,
    ManifestVersionError,
    OutputBusyError,
    ResultsCheckError,
)
from airflow_vllm_batch.identity import RunIdentity
from airflow_vllm_batch.lease import OutputLease
from airflow_vllm_batch.manifest import MANIFEST_SCHEMA_VERSION, Manifest, RequestCounts, Usage
from airflow_vllm_batch.storage import read_answers
from airflow_vllm_batch.storage.publishing import OutputStore
from airflow_vllm_batch.storage.s3 import head_etag, head_input, s3_lines, split_s3_uri


@pytest.fixture
def hook(s3) -> S3Hook:
    return S3Hook(aws_conn_id="aws_default")


def test_a_read_of_a_pinned_input_that_changed_fails_naming_it(s3, bucket, hook):
    s3.client().put_object(Bucket=bucket, Key="in.jsonl", Body=b"a\n")
    etag = head_input(hook, f"s3://{bucket}/in.jsonl").etag
    s3.client().put_object(Bucket=bucket, Key="in.jsonl", Body=b"b\n")
    with (
        pytest.raises(
            InputChangedError, match=rf"s3://{bucket}/in.jsonl was overwritten while this task ran"
        ),
        s3_lines(hook, bucket, "in.jsonl", if_match=etag) as lines,
    ):
        list(lines)


def test_a_missing_input_names_input_uri_and_the_fix(bucket, hook):
    with pytest.raises(
        InputNotFoundError, match=r"input_uri: s3://.*/typo.jsonl does not exist .* Nothing was run"
    ):
        head_input(hook, f"s3://{bucket}/typo.jsonl")


@pytest.mark.parametrize("uri", ["/tmp/x.jsonl", "s3://", "s3://bucket-only", "s3://b/folder/"])
def test_a_malformed_location_names_the_parameter(uri):
    with pytest.raises(LocationError, match="error_uri must"):
        split_s3_uri(uri, "error_uri")


def test_a_missing_error_bucket_is_found_before_the_run(bucket, hook):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl", "s3://no-such-bucket-xyz/e.jsonl")
    with pytest.raises(LocationError, match="error_uri: bucket 'no-such-bucket-xyz' does not exist"):
        store.check_writable()
    assert [b["Name"] for b in hook.get_conn().list_buckets()["Buckets"]].count("no-such-bucket-xyz") == 0


def _manifest(store: OutputStore, fingerprint: str, error_uri: str | None = None) -> Manifest:
    return Manifest(
        output_uri=store.output_uri,
        error_uri=error_uri,
        input_uri="s3://b/in",
        model="m",
        request_counts=RequestCounts(1, 1, 0),
        usage=Usage(),
        duration_s=0.0,
        vllm_version=None,
        fingerprint=fingerprint,
        manifest_uri=store.manifest_uri,
        identity={"model": "m"},
    )


def test_a_manifest_whose_files_are_gone_is_not_complete(s3, bucket, hook):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    identity = RunIdentity({"model": "m"})
    store.write_manifest(_manifest(store, identity.fingerprint, error_uri=store.error_uri))
    s3.client().put_object(Bucket=bucket, Key="r.jsonl", Body=b"{}\n")
    manifest, why = store.completed(identity)
    assert manifest is None
    assert why == f"the manifest names {store.error_uri}, which is gone"
    s3.client().put_object(Bucket=bucket, Key="r.errors.jsonl", Body=b"{}\n")
    assert store.completed(identity)[0] is not None


def test_an_output_whose_publish_stopped_after_its_tombstone_is_not_complete_and_says_so(
    s3, bucket, hook, tmp_path
):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    identity = RunIdentity({"model": "m"})
    local = tmp_path / "r.jsonl"
    local.write_bytes(b"{}\n")
    store.publish(_manifest(store, identity.fingerprint), results_path=local)
    assert store.completed(identity)[0] is not None
    # The next publish's first write; the try is stopped before its last.
    store.mark_publishing(head_etag(s3.client(), bucket, "r.manifest.json"), identity.fingerprint)
    manifest, why = store.completed(identity)
    assert manifest is None
    assert store.read_manifest() is None
    assert (
        why
        == f"the output at s3://{bucket}/r.jsonl is not complete: a try began publishing it and has not finished (it still publishes, or it was stopped)"
    )


def test_a_manifest_of_a_newer_schema_beside_the_output_is_refused_not_taken_for_no_output(s3, bucket, hook):
    # Taken for "no complete output", it would be published over by a package that cannot read it.
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    identity = RunIdentity({"model": "m"})
    newer = {
        **_manifest(store, identity.fingerprint).to_dict(),
        "schema_version": MANIFEST_SCHEMA_VERSION + 1,
    }
    s3.client().put_object(Bucket=bucket, Key="r.manifest.json", Body=json.dumps(newer).encode())
    s3.client().put_object(Bucket=bucket, Key="r.jsonl", Body=b"{}\n")
    with pytest.raises(ManifestVersionError, match=rf"s3://{bucket}/r.manifest.json has schema_version 2"):
        store.completed(identity)
    with pytest.raises(ManifestVersionError, match="Upgrade airflow-vllm-batch"):
        list(read_answers(newer))


def test_two_tombstones_of_one_output_differ_so_a_lost_answer_is_known_by_its_etag(s3, bucket, hook):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    first = store.mark_publishing(None, "f")
    assert store.mark_publishing(first, "f") != first


def test_removing_a_runs_staging_leaves_other_runs_staging(s3, bucket, hook):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    mine, theirs = store.staging(RunIdentity({"a": 1})), store.staging(RunIdentity({"a": 2}))
    for staging in (mine, theirs):
        s3.client().put_object(Bucket=bucket, Key=staging.results_key, Body=b"x\n")
    mine.remove()
    assert not mine.has_results()
    assert theirs.has_results()


def test_the_writable_check_probes_a_bucket_once_when_the_error_file_sits_beside_the_output(
    s3, bucket, hook, monkeypatch
):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    client = hook.get_conn()
    puts = []
    real_put = client.put_object
    monkeypatch.setattr(client, "put_object", lambda **kw: puts.append(kw["Bucket"]) or real_put(**kw))
    store.check_writable()
    assert puts == [bucket]


def _chat(custom_id: str, text: str) -> bytes:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
    return json.dumps(
        {"id": "v", "custom_id": custom_id, "response": {"status_code": 200, "body": body}, "error": None}
    ).encode()


def _published(s3, bucket: str, completed: int) -> dict:
    failed = json.dumps(
        {"id": "v", "custom_id": "b", "response": None, "error": {"message": "too long"}}
    ).encode()
    s3.client().put_object(
        Bucket=bucket, Key="out/r.jsonl", Body=_chat("a", "yes")
    )  # no final newline, as vLLM writes it
    s3.client().put_object(Bucket=bucket, Key="out/r.errors.jsonl", Body=failed + b"\n")
    return {
        "output_uri": f"s3://{bucket}/out/r.jsonl",
        "error_uri": f"s3://{bucket}/out/r.errors.jsonl",
        "request_counts": {"total": completed + 1, "completed": completed, "failed": 1},
    }


def test_read_answers_streams_a_published_manifest_from_s3(s3, bucket):
    assert list(read_answers(_published(s3, bucket, completed=1))) == [
        Text("a", "yes"),
        Failed("b", "too long"),
    ]


def test_read_answers_from_s3_still_checks_the_counts_of_the_manifest(s3, bucket):
    with pytest.raises(ResultsCheckError, match="does not match its manifest"):
        list(read_answers(_published(s3, bucket, completed=2)))


# -- Fencing: a try whose lease was taken over changes nothing under the output -----------


def _objects(client, bucket: str) -> dict[str, str]:
    """Every object but the lease, with its ETag: what a fenced-off try must leave as it was."""
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: o["ETag"] for o in listed if not o["Key"].endswith(".lease.json")}


@pytest.fixture
def taken_over(s3, bucket, hook, tmp_path):
    """A store whose try took the lease, a published output and staging beside it, and a successor that took the lease over."""
    from airflow_vllm_batch.lease import LeaseHolder

    store = OutputStore(hook, f"s3://{bucket}/out/r.jsonl")
    identity = RunIdentity({"model": "m"})
    zombie = store.lease(
        LeaseHolder("d", "run-1", "t", -1, 1, identity.fingerprint, "gpu-1"), heartbeat_s=3600
    )
    zombie.acquire()
    staging = store.staging(identity)
    client = s3.client()
    for key, body in [
        ("out/r.jsonl", b"published results\n"),
        ("out/r.errors.jsonl", b"published errors\n"),
        ("out/r.manifest.json", b'{"published": "manifest"}'),
        (staging.results_key, b"staged results\n"),
        (staging.part_key("part-000000-aaaa.jsonl"), b"a part\n"),
    ]:
        client.put_object(Bucket=bucket, Key=key, Body=body)
    # The task's next try (its scheduler thought this one dead) takes the lease over between two heartbeats.
    successor = OutputLease(
        client,
        bucket,
        "out/r.lease.json",
        LeaseHolder("d", "run-1", "t", -1, 2, identity.fingerprint, "gpu-2"),
        heartbeat_s=3600,
    )
    successor.acquire()
    local = tmp_path / "new.jsonl"
    local.write_bytes(b"a zombie's lines\n")
    yield store, staging, local
    zombie._stop.set()
    successor.release()


_MUTATIONS = {
    "mark-publishing": lambda store, staging, local: store.mark_publishing(
        head_etag(store.hook.get_conn(), store.manifest_bucket, store.manifest_key)
    ),
    "publish-upload": lambda store, staging, local: store.publish(
        _manifest(store, "f"), staging=staging, results_path=local, errors_path=local
    ),
    "publish-copy": lambda store, staging, local: store.publish(_manifest(store, "f"), staging=staging),
    "write-manifest": lambda store, staging, local: store.write_manifest(_manifest(store, "f")),
    "remove-staging": lambda store, staging, local: staging.remove(),
    "drop-results": lambda store, staging, local: staging.drop_results(),
    "drop-parts": lambda store, staging, local: staging.drop_parts(staging.list_parts()),
    "put-part": lambda store, staging, local: staging.put_part(local, "bbbb"),
    "put-results": lambda store, staging, local: staging.put_results(local),
    "put-input": lambda store, staging, local: staging.put_input(local),
    "put-cached-hits": lambda store, staging, local: staging.put_file(
        local, f"{staging.prefix}cached-results.jsonl"
    ),
}


@pytest.mark.parametrize("mutation", list(_MUTATIONS))
def test_a_try_whose_lease_was_taken_over_changes_nothing_under_the_output(s3, bucket, taken_over, mutation):
    store, staging, local = taken_over
    before = _objects(s3.client(), bucket)
    with pytest.raises(OutputBusyError, match=r"\(try 2, on gpu-2\) took over the lease"):
        _MUTATIONS[mutation](store, staging, local)
    assert _objects(s3.client(), bucket) == before


def test_deleting_an_old_error_file_is_fenced_too(s3, bucket, taken_over):
    store, staging, local = taken_over
    before = _objects(s3.client(), bucket)
    # A publish with no failed line deletes the earlier error file: not when the lease is gone.
    with pytest.raises(OutputBusyError):
        store.publish(_manifest(store, "f"), staging=staging, results_path=local, errors_path=None)
    assert _objects(s3.client(), bucket) == before


def test_the_manifest_is_not_written_over_one_another_writer_put_there(s3, bucket, hook):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    s3.client().put_object(Bucket=bucket, Key="r.manifest.json", Body=b'{"theirs": true}')
    with pytest.raises(OutputBusyError, match="changed while this try published"):
        store.write_manifest(_manifest(store, "f"))
    assert s3.client().get_object(Bucket=bucket, Key="r.manifest.json")["Body"].read() == b'{"theirs": true}'


@pytest.mark.parametrize(
    "paused_before", [1, 2, 3, 4], ids=["tombstone", "results", "error-file", "manifest"]
)
def test_a_try_paused_after_its_lease_check_cannot_undo_what_its_successor_published_meanwhile(
    s3, bucket, hook, tmp_path, paused_before
):
    """Fencing when the check passed: the lease was this try's at the check, its successor took over and
    published before the write landed (a zombie paused between the two); every write is conditional on
    what the try read before its first check, so the write fails and the successor's output stands."""
    client = s3.client()
    for key, body in [
        ("r.jsonl", b"old results\n"),
        ("r.errors.jsonl", b"old errors\n"),
        ("r.manifest.json", b'{"old": 1}'),
    ]:
        client.put_object(Bucket=bucket, Key=key, Body=body)
    zombie = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    successor = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    mine = tmp_path / "zombie.jsonl"
    mine.write_bytes(b"the zombie's lines\n")
    theirs = tmp_path / "successor.jsonl"
    theirs.write_bytes(b"the successor's lines\n")
    checks = []

    def fence() -> None:  # the check passes; the pause after the chosen one is when the successor publishes
        checks.append(1)
        if len(checks) == paused_before:
            successor.publish(_manifest(successor, "s"), results_path=theirs, errors_path=theirs)

    zombie.fence = fence
    with pytest.raises(OutputBusyError, match="changed while this try published"):
        zombie.publish(_manifest(zombie, "z"), results_path=mine, errors_path=mine)
    published = successor.read_manifest()
    assert published is not None
    assert published.fingerprint == "s"
    assert client.get_object(Bucket=bucket, Key="r.jsonl")["Body"].read() == b"the successor's lines\n"
    assert client.get_object(Bucket=bucket, Key="r.errors.jsonl")["Body"].read() == b"the successor's lines\n"
    # The successor's manifest still names the very files that are there: its output is complete.
    assert (published.output_etag, published.error_etag) == (
        head_etag(client, bucket, "r.jsonl"),
        head_etag(client, bucket, "r.errors.jsonl"),
    )


def test_a_zombies_manifest_cannot_land_between_its_successors_results_and_its_successors_manifest(
    s3, bucket, hook, tmp_path
):
    """The schedule the simulator found (seeds 975, 9811): the zombie's lease check before its manifest
    passed; while it paused there its successor took over, replaced the results and the error file, and
    paused before its own manifest; the zombie's manifest landed then. Its write must fail (the
    successor's publish replaced the zombie's tombstone), and the successor's manifest must follow."""
    client = s3.client()
    for key, body in [
        ("r.jsonl", b"old results\n"),
        ("r.errors.jsonl", b"old errors\n"),
        ("r.manifest.json", b'{"old": 1}'),
    ]:
        client.put_object(Bucket=bucket, Key=key, Body=body)
    zombie = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    successor = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    mine = tmp_path / "zombie.jsonl"
    mine.write_bytes(b"the zombie's lines\n")
    theirs = tmp_path / "successor.jsonl"
    theirs.write_bytes(b"the successor's lines\n")
    zombie_paused, zombie_goes = threading.Event(), threading.Event()
    zombie_ended: list[BaseException | None] = []

    def before_the_manifest(lines: bytes) -> bool:
        # The error file is each publish's last write before its manifest.
        return head_etag(client, bucket, "r.errors.jsonl") == hashlib.md5(lines).hexdigest()

    def zombie_fence() -> None:
        if before_the_manifest(mine.read_bytes()):
            zombie_paused.set()
            zombie_goes.wait(timeout=60)

    def successor_fence() -> None:
        if before_the_manifest(theirs.read_bytes()):
            zombie_goes.set()  # the zombie's manifest write lands now, between the successor's files and its manifest
            zombie_thread.join(timeout=60)

    def zombie_publishes() -> None:
        try:
            zombie.publish(_manifest(zombie, "z"), results_path=mine, errors_path=mine)
            zombie_ended.append(None)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            zombie_ended.append(err)

    zombie.fence, successor.fence = zombie_fence, successor_fence
    zombie_thread = threading.Thread(target=zombie_publishes)
    zombie_thread.start()
    assert zombie_paused.wait(timeout=60)
    successor.publish(_manifest(successor, "s"), results_path=theirs, errors_path=theirs)
    zombie_thread.join(timeout=60)
    assert len(zombie_ended) == 1
    assert isinstance(zombie_ended[0], OutputBusyError)
    published = successor.read_manifest()
    assert published is not None
    assert published.fingerprint == "s"
    assert client.get_object(Bucket=bucket, Key="r.jsonl")["Body"].read() == b"the successor's lines\n"
    assert (published.output_etag, published.error_etag) == (
        head_etag(client, bucket, "r.jsonl"),
        head_etag(client, bucket, "r.errors.jsonl"),
    )


def test_an_output_overwritten_after_its_manifest_is_not_complete(s3, bucket, hook, tmp_path):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    identity = RunIdentity({"model": "m"})
    local = tmp_path / "r.jsonl"
    local.write_bytes(_chat("a", "yes") + b"\n")
    store.publish(_manifest(store, identity.fingerprint), results_path=local)
    assert store.completed(identity)[0] is not None
    # A zombie's PUT that landed after its last lease check, once the manifest was written.
    s3.client().put_object(Bucket=bucket, Key="r.jsonl", Body=_chat("a", "a zombie's answer") + b"\n")
    manifest, why = store.completed(identity)
    assert manifest is None
    assert "was overwritten after its manifest was written" in why


def test_read_answers_refuses_results_overwritten_after_the_manifest(s3, bucket, hook, tmp_path):
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    local = tmp_path / "r.jsonl"
    local.write_bytes(_chat("a", "yes") + b"\n")
    manifest = _manifest(store, "f")
    store.publish(manifest, results_path=local)
    assert list(read_answers(manifest.to_dict())) == [Text("a", "yes")]
    s3.client().put_object(Bucket=bucket, Key="r.jsonl", Body=_chat("a", "a zombie's answer") + b"\n")
    with pytest.raises(ResultsCheckError, match="is not the file its manifest published"):
        list(read_answers(manifest.to_dict()))


class _LostResponses:
    """A boto3 client whose conditional writes land but lose their answer once: botocore then sends the
    same request again, conditions and all, and that second request's answer (a 412) is what the caller sees."""

    def __init__(self, client) -> None:
        self._client = client
        self.resent = []

    def __getattr__(self, name):
        call = getattr(self._client, name)
        if name not in ("put_object", "copy_object", "delete_object"):
            return call

        def twice(**kwargs):
            if "IfMatch" not in kwargs and "IfNoneMatch" not in kwargs:
                return call(**kwargs)
            body = kwargs.get("Body")
            call(**kwargs)  # landed; its answer is lost
            if hasattr(body, "seek"):
                body.seek(0)
            self.resent.append((name, kwargs["Key"]))
            return call(**kwargs)

        return twice


def test_a_publish_whose_conditional_writes_lost_their_answers_takes_them_as_its_own(
    s3, bucket, hook, tmp_path, monkeypatch
):
    client = s3.client()
    for key, body in [
        ("r.jsonl", b"old results\n"),
        ("r.errors.jsonl", b"old errors\n"),
        ("r.manifest.json", b'{"old": 1}'),
    ]:
        client.put_object(Bucket=bucket, Key=key, Body=body)
    lossy = _LostResponses(hook.get_conn())
    monkeypatch.setattr(hook, "get_conn", lambda: lossy)
    store = OutputStore(hook, f"s3://{bucket}/r.jsonl")
    results = tmp_path / "results.jsonl"
    results.write_bytes(b"new results\n")
    store.publish(_manifest(store, "n"), results_path=results, errors_path=None)
    assert {key for _, key in lossy.resent} == {"r.manifest.json", "r.jsonl", "r.errors.jsonl"}
    published = store.read_manifest()
    assert published is not None
    assert published.fingerprint == "n"
    assert published.output_etag == head_etag(client, bucket, "r.jsonl")
    assert head_etag(client, bucket, "r.errors.jsonl") is None


def test_a_large_file_goes_up_in_parts_under_its_condition_and_a_refused_one_leaves_no_upload_behind(
    s3, bucket, tmp_path, monkeypatch
):
    import airflow_vllm_batch.storage.s3 as storage

    monkeypatch.setattr(storage, "MULTIPART_ABOVE", 1)
    monkeypatch.setattr(storage, "UPLOAD_PART_BYTES", 5 * 2**20)  # S3's smallest part
    monkeypatch.setattr(storage, "COPY_OBJECT_MAX", 1)
    client = s3.client()
    big = tmp_path / "big.jsonl"
    big.write_bytes(b'{"custom_id": "c"}\n' * (6 * 2**20 // 19))  # two parts
    etag = storage.upload_file(client, big, bucket, "r.jsonl", IfNoneMatch="*")
    assert etag == head_etag(client, bucket, "r.jsonl")
    assert etag.endswith("-2")
    with pytest.raises(ClientError, match="PreconditionFailed"):
        storage.upload_file(client, big, bucket, "r.jsonl", IfNoneMatch="*")
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")  # the refused upload was aborted
    copied = storage.copy_object(client, bucket, "r.jsonl", bucket, "copy.jsonl", IfNoneMatch="*")
    assert copied == head_etag(client, bucket, "copy.jsonl")
    assert client.get_object(Bucket=bucket, Key="copy.jsonl")["Body"].read() == big.read_bytes()


class PartialDeletes:
    """A DeleteObjects that answers 200 but lists the first ``failing`` requests' keys under ``Errors``, as S3 does."""

    def __init__(self, failing: int) -> None:
        self.failing = failing
        self.requests: list[list[str]] = []

    def delete_objects(self, Bucket, Delete, **_):
        keys = [o["Key"] for o in Delete["Objects"]]
        self.requests.append(keys)
        if len(self.requests) <= self.failing:
            return {
                "Errors": [
                    {"Key": keys[0], "Code": "InternalError", "Message": "We encountered an internal error."}
                ]
            }
        return {}


def test_keys_deleteobjects_failed_to_delete_are_sent_again():
    from airflow_vllm_batch.storage.s3 import delete_keys

    client = PartialDeletes(failing=1)
    delete_keys(client, "b", ["k/a", "k/b"])
    assert client.requests == [["k/a", "k/b"], ["k/a"]]


def test_a_key_deleteobjects_keeps_failing_to_delete_raises_instead_of_being_taken_for_gone():
    from airflow_vllm_batch.exceptions import StorageUnavailableError
    from airflow_vllm_batch.storage.s3 import DELETE_ROUNDS, delete_keys

    client = PartialDeletes(failing=DELETE_ROUNDS)
    with pytest.raises(
        StorageUnavailableError, match=r"did not delete 1 object\(s\) in s3://b/ .*k/a: InternalError"
    ):
        delete_keys(client, "b", ["k/a", "k/b"])
