"""The split and merge operators on a real S3 (SeaweedFS): what the merge refuses to publish, and which failures are retried.

The shards' files and manifests are written here as ``VLLMBatchOperator`` leaves them
(results without a final newline, one error line per failed request, skipped invalid
lines included); the integration tests run the same operators after a real engine.
"""

from __future__ import annotations

import json

import pytest
from botocore.exceptions import ClientError

from airflow_vllm_batch.exceptions import OutputBusyError
from airflow_vllm_batch.lease import LeaseHolder
from airflow_vllm_batch.manifest import MANIFEST_SCHEMA_VERSION
from airflow_vllm_batch.operators.shards import VLLMBatchMergeOperator, VLLMBatchSplitOperator
from airflow_vllm_batch.storage.merged_output import MergedOutputStore
from airflow_vllm_batch.storage.publishing import OutputStore
from airflow_vllm_batch.version_compat import AirflowFailException


class FakeTI:
    """What the operators use of a task instance."""

    def __init__(self, try_number: int = 1) -> None:
        self.dag_id, self.task_id, self.run_id = "d", "merge", "run-1"
        self.try_number, self.map_index = try_number, -1
        self.xcoms: dict = {}

    def xcom_push(self, key: str, value) -> None:
        self.xcoms[key] = value


def result_line(custom_id: str) -> bytes:
    return json.dumps(
        {"id": "x", "custom_id": custom_id, "response": {"status_code": 200, "body": {}}, "error": None}
    ).encode()


def error_line(custom_id: str | None) -> bytes:
    return json.dumps(
        {"id": "x", "custom_id": custom_id, "response": None, "error": {"message": "failed"}}
    ).encode()


class Shards:
    """Three shards of one split in a fresh bucket, each with its files and manifest as the inference task left them."""

    COMPLETED = (3, 2, 3)
    FAILED = (0, 2, 0)  # shard 1: one engine error and one invalid line skipped by preflight

    def __init__(self, s3, bucket: str) -> None:
        self.client = s3.client()
        self.bucket = bucket
        self.output_uri = f"s3://{bucket}/out/results.jsonl"
        self.manifests = [self.write_shard(i) for i in range(3)]

    def key(self, index: int, suffix: str = ".jsonl") -> str:
        return f"p/shards/shard-{index:05d}{suffix}"

    def write_shard(self, index: int) -> dict:
        completed, failed = self.COMPLETED[index], self.FAILED[index]
        self.put(self.key(index), b"request\n" * (completed + failed))
        # vLLM uploads its output without a final newline.
        output_etag = self.put(
            self.key(index, ".results.jsonl"),
            b"\n".join(result_line(f"r{index}-{n}") for n in range(completed)),
        )
        error_uri = error_etag = None
        if failed:
            lines = [error_line(f"r{index}-e{n}") for n in range(failed - 1)] + [error_line(None)]
            error_etag = self.put(self.key(index, ".results.errors.jsonl"), b"\n".join(lines) + b"\n")
            error_uri = f"s3://{self.bucket}/{self.key(index, '.results.errors.jsonl')}"
        return {
            "output_uri": f"s3://{self.bucket}/{self.key(index, '.results.jsonl')}",
            "output_etag": output_etag,
            "error_uri": error_uri,
            "error_etag": error_etag,
            "input_uri": f"s3://{self.bucket}/{self.key(index)}",
            "model": "m",
            "request_counts": {"total": completed + failed, "completed": completed, "failed": failed},
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "duration_s": 1.0,
            "engine_duration_s": 0.5,
            "vllm_version": "0.32.0",
            "fingerprint": f"{index:064d}",
            "manifest_uri": f"s3://{self.bucket}/{self.key(index, '.results.manifest.json')}",
        }

    def put(self, key: str, data: bytes) -> str:
        """Write an object; return its ETag, bare, as manifests record it."""
        return self.client.put_object(Bucket=self.bucket, Key=key, Body=data)["ETag"].strip('"')

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def published(self) -> list[str]:
        return sorted(
            o["Key"]
            for o in self.client.list_objects_v2(Bucket=self.bucket, Prefix="out/").get("Contents", [])
        )

    def merge(self, manifests=None, ti: FakeTI | None = None) -> dict:
        operator = VLLMBatchMergeOperator(
            task_id="merge",
            shard_manifests=self.manifests if manifests is None else manifests,
            output_uri=self.output_uri,
        )
        return operator.execute({"ti": ti or FakeTI()})


@pytest.fixture
def shards(s3, bucket) -> Shards:
    return Shards(s3, bucket)


def test_a_merge_of_complete_shards_publishes_every_line_and_leaves_no_lease(shards):
    manifest = shards.merge()
    assert manifest["request_counts"] == {"total": 10, "completed": 8, "failed": 2}
    assert len(shards.get("out/results.jsonl").splitlines()) == 8
    assert len(shards.get("out/results.errors.jsonl").splitlines()) == 2
    assert shards.published() == [
        "out/results.errors.jsonl",
        "out/results.jsonl",
        "out/results.manifest.json",
    ]


@pytest.mark.parametrize("absent", [[0], [1], [2], [0, 2]], ids=str)
def test_a_none_shard_manifest_fails_the_merge_without_retry_naming_its_map_index(shards, absent):
    manifests = [None if i in absent else m for i, m in enumerate(shards.manifests)]
    with pytest.raises(
        AirflowFailException, match=rf"map index \[{', '.join(map(str, absent))}\] have no manifest"
    ):
        shards.merge(manifests)
    assert shards.published() == []


def test_a_shard_manifest_of_a_newer_schema_fails_the_merge_without_retry_saying_to_upgrade(shards):
    manifests = [dict(m) for m in shards.manifests]
    manifests[1]["schema_version"] = MANIFEST_SCHEMA_VERSION + 1
    with pytest.raises(
        AirflowFailException,
        match=r"the shard manifest at map index 1 has schema_version 2, newer .* Upgrade",
    ):
        shards.merge(manifests)
    assert shards.published() == []


@pytest.mark.parametrize("missing", [[1], [2], [0], [1, 2]], ids=str)
def test_a_shard_left_out_of_the_mapped_output_fails_the_merge_naming_its_map_index(shards, missing):
    # A mapped task that did not publish pushes no XCom: its manifest is not even None.
    manifests = [m for i, m in enumerate(shards.manifests) if i not in missing]
    with pytest.raises(
        AirflowFailException, match=rf"map index \[{', '.join(map(str, missing))}\] \(of the split under"
    ):
        shards.merge(manifests)
    assert shards.published() == []


def test_shards_mapped_without_the_split_are_merged_as_given(shards):
    renamed = [
        {**m, "input_uri": f"s3://{shards.bucket}/mine/part-{i}.jsonl"}
        for i, m in enumerate(shards.manifests)
    ]
    assert shards.merge(renamed[:2])["request_counts"]["total"] == 7


# A manifest that miscounts the files it published (their ETags are its own): only the counts tell.


def _extra_result(shards: Shards) -> None:
    data = shards.get(shards.key(1, ".results.jsonl")) + b"\n" + result_line("late")
    shards.manifests[1]["output_etag"] = shards.put(shards.key(1, ".results.jsonl"), data)


def _lost_result(shards: Shards) -> None:
    shards.manifests[1]["output_etag"] = shards.put(shards.key(1, ".results.jsonl"), result_line("r1-0"))


def _lost_error_line(shards: Shards) -> None:
    shards.manifests[1]["error_etag"] = shards.put(
        shards.key(1, ".results.errors.jsonl"), error_line(None) + b"\n"
    )


def _no_error_file_named(shards: Shards) -> None:
    shards.manifests[1]["error_uri"] = None


def _more_completed_counted(shards: Shards) -> None:
    shards.manifests[1]["request_counts"] = {"total": 5, "completed": 3, "failed": 2}


@pytest.mark.parametrize(
    "disagree",
    [_extra_result, _lost_result, _lost_error_line, _no_error_file_named, _more_completed_counted],
    ids=lambda f: f.__name__,
)
def test_a_shard_whose_files_disagree_with_its_manifest_fails_before_anything_is_published(shards, disagree):
    shards.put("out/results.manifest.json", b'{"an": "earlier merge"}')
    disagree(shards)
    with pytest.raises(
        AirflowFailException,
        match=r"manifests count \d+ completed and 2 failed requests: shard 1 \(s3://.*shard-00001",
    ):
        shards.merge()
    # Not even the old manifest is invalidated: the check comes before the publish protocol.
    assert shards.published() == ["out/results.manifest.json"]


@pytest.mark.parametrize("suffix", [".results.jsonl", ".results.errors.jsonl"])
def test_a_shard_file_rewritten_since_its_manifest_fails_the_merge_naming_the_shard(shards, suffix):
    # As many lines as the manifest counts, so only the ETag its manifest recorded tells them apart.
    original = shards.get(shards.key(1, suffix))
    shards.put(shards.key(1, suffix), original.replace(b'"r1-', b'"other-'))
    with pytest.raises(
        AirflowFailException, match=r"shard at map index 1 published s3://.*shard-00001.* has changed since"
    ):
        shards.merge()
    assert shards.published() == []


@pytest.mark.parametrize("suffix", [".results.jsonl", ".results.errors.jsonl"])
def test_a_shard_file_deleted_since_its_manifest_fails_the_merge_without_retry_naming_the_shard(
    shards, suffix
):
    # Gone for every try alike, so a retry fails the same way (the shard simulator's seed 18 retried a raw NoSuchKey).
    shards.put("out/results.manifest.json", b'{"an": "earlier merge"}')
    shards.client.delete_object(Bucket=shards.bucket, Key=shards.key(1, suffix))
    with pytest.raises(
        AirflowFailException, match=r"shard at map index 1 published s3://.*shard-00001.*, which is gone"
    ):
        shards.merge()
    assert shards.published() == ["out/results.manifest.json"]


def test_the_count_mismatch_names_only_the_shards_that_disagree(shards):
    _lost_result(shards)
    with pytest.raises(AirflowFailException) as failure:
        shards.merge()
    assert "shard 1 (" in str(failure.value)
    assert "shard 0 (" not in str(failure.value)
    assert "shard 2 (" not in str(failure.value)


def test_a_merge_does_not_publish_while_another_run_holds_the_output(shards):
    other = LeaseHolder("other_dag", "scheduled__2026-11-01", "merge", -1, 1, "f" * 64, "worker-7")
    shards.put("out/results.lease.json", json.dumps(other.__dict__).encode())
    # Another writer is transient: the task's retry may find the output free.
    with pytest.raises(OutputBusyError, match=r"other_dag\.merge of run 'scheduled__2026-11-01'"):
        shards.merge()
    assert shards.published() == ["out/results.lease.json"]


def test_a_merge_that_loses_the_lease_while_publishing_leaves_the_published_output_untouched(
    shards, monkeypatch
):
    shards.put("out/results.jsonl", b"earlier results\n")
    shards.put("out/results.errors.jsonl", b"earlier errors\n")
    shards.put("out/results.manifest.json", b'{"an": "earlier manifest"}')
    output = [k for k in shards.published() if not k.endswith(".lease.json")]
    before = {
        k: (shards.get(k), shards.client.head_object(Bucket=shards.bucket, Key=k)["ETag"]) for k in output
    }
    real_publish = OutputStore.publish

    def lose_the_lease_then_publish(self, *args, **kwargs):
        # The next try (its scheduler thought this one dead) takes over between two heartbeats.
        successor = LeaseHolder("d", "run-1", "merge", -1, 2, "f" * 64, "worker-2")
        shards.put("out/results.lease.json", json.dumps(successor.__dict__).encode())
        return real_publish(self, *args, **kwargs)

    monkeypatch.setattr(OutputStore, "publish", lose_the_lease_then_publish)
    with pytest.raises(OutputBusyError, match="took over the lease"):
        shards.merge()
    after = [k for k in shards.published() if not k.endswith(".lease.json")]
    assert {
        k: (shards.get(k), shards.client.head_object(Bucket=shards.bucket, Key=k)["ETag"]) for k in after
    } == before


def test_an_s3_failure_while_merging_is_left_to_airflows_retries(shards, monkeypatch):
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    real_conn = S3Hook.get_conn

    def slowing_down(self):
        client = real_conn(self)

        def get_object(**kwargs):
            raise ClientError(
                {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}}, "GetObject"
            )

        client.get_object = get_object
        return client

    monkeypatch.setattr(S3Hook, "get_conn", slowing_down)
    with pytest.raises(ClientError, match="SlowDown"):
        shards.merge()


@pytest.mark.parametrize(
    ("shard_prefix", "content", "named"),
    [
        ("/local/shards/", b"request\n", "shard_prefix must be an s3:// URI"),
        ("s3://{bucket}/p/shards/", b"\n  \n", "has no request line"),
    ],
    ids=["prefix-not-s3", "no-request-line"],
)
def test_a_split_of_bad_input_fails_without_retry(s3, bucket, tmp_path, shard_prefix, content, named):
    source = tmp_path / "input.jsonl"
    source.write_bytes(content)
    split = VLLMBatchSplitOperator(
        task_id="split", input_uri=str(source), shard_prefix=shard_prefix.format(bucket=bucket)
    )
    with pytest.raises(AirflowFailException, match=named):
        split.execute({"ti": FakeTI()})


def test_the_merged_manifest_carries_the_shards_cost_added_up(shards):
    cost = {
        "device": "gpu",
        "engine_s": 10.0,
        "gpus": 1,
        "gpu_s": 10.0,
        "tokens_per_gpu_s": 0.2,
        "gpu_hour_cost": 3.6,
        "cost": 0.01,
    }
    manifests = [{**m, "cost": cost} for m in shards.manifests]
    merged = shards.merge(manifests)
    n = len(manifests)
    assert merged["cost"]["gpu_s"] == 10.0 * n
    assert merged["cost"]["cost"] == round(0.01 * n, 6)
    assert merged["cost"]["tokens_per_gpu_s"] == round(merged["usage"]["total_tokens"] / (10.0 * n), 3)
    assert "cost" not in shards.merge()  # shards published without a cost: the batch is not counted


class LazyManifests:
    """Like Airflow's lazy XCom sequence of a mapped task's outputs: asking past the end is a 404 the Task SDK logs at error level."""

    def __init__(self, manifests: list[dict]) -> None:
        self.manifests, self.asked_past_the_end = manifests, []

    def __len__(self) -> int:
        return len(self.manifests)

    def __getitem__(self, index: int) -> dict:
        if index >= len(self.manifests):
            self.asked_past_the_end.append(index)
            raise IndexError(index)
        return self.manifests[index]


def test_a_merge_reads_the_mapped_outputs_by_index_never_asking_past_the_end(shards):
    lazy = LazyManifests(shards.manifests)
    assert shards.merge(lazy)["request_counts"]["total"] == 10
    assert lazy.asked_past_the_end == []


def test_a_merge_without_error_files_logs_no_empty_merge_and_no_error(s3, bucket, capfd):
    clean = Shards.__new__(Shards)
    clean.client, clean.bucket, clean.output_uri = s3.client(), bucket, f"s3://{bucket}/out/results.jsonl"
    clean.FAILED = (0, 0, 0)
    clean.manifests = [clean.write_shard(i) for i in range(3)]
    capfd.readouterr()
    manifest = clean.merge()
    log = capfd.readouterr().out
    assert manifest["error_uri"] is None
    assert "Merged 3 file(s) into 8 lines" in log  # the task log is what is read here
    assert "Merged 0 file(s)" not in log
    assert "[error" not in log


def _state(shards: Shards) -> dict[str, tuple[bytes, str]]:
    """Every object of the merged output: its bytes and ETag."""
    return {
        k: (shards.get(k), shards.client.head_object(Bucket=shards.bucket, Key=k)["ETag"])
        for k in shards.published()
    }


def test_a_retry_after_a_complete_merge_writes_nothing_and_returns_the_published_manifest(
    shards, monkeypatch
):
    first = shards.merge(ti=FakeTI(1))
    before = _state(shards)

    def no_tombstone(self, *args, **kwargs):
        raise AssertionError("a merge of the same shards wrote a tombstone over the complete merged output")

    monkeypatch.setattr(OutputStore, "mark_publishing", no_tombstone)
    # A retry whose predecessor's success Airflow never heard of: nothing to merge again.
    assert shards.merge(ti=FakeTI(2)) == first
    assert _state(shards) == before


def test_a_zombie_merge_that_finds_its_successors_merge_complete_under_the_lease_writes_nothing(
    shards, monkeypatch
):
    # Try 1 looks (nothing published yet) and merges; while it merges, try 2 (its scheduler thought try 1
    # dead) merges and publishes the same shards and releases the lease. Try 1 then takes the free lease:
    # the manifest its publish pins is complete for this very merge, so it writes nothing, not even a
    # tombstone (shard seeds 8631 and, for a try paused before its tombstone, 1416/3668/6762).
    real_merge_files = VLLMBatchMergeOperator.merge_files
    published: list[dict] = []
    successor: list[int] = []

    def successor_publishes_meanwhile(self, manifests, tmp):
        merged = real_merge_files(self, manifests, tmp)
        if not successor:
            successor.append(2)  # the successor's own merge_files comes through here too
            published.append(shards.merge(ti=FakeTI(2)))
        return merged

    monkeypatch.setattr(VLLMBatchMergeOperator, "merge_files", successor_publishes_meanwhile)
    writes: list[str] = []
    real_put = OutputStore._put_manifest_key

    def recording(self, body, condition):
        writes.append(json.loads(body).get("tombstone", "manifest"))
        return real_put(self, body, condition)

    monkeypatch.setattr(OutputStore, "_put_manifest_key", recording)
    zombie = shards.merge(ti=FakeTI(1))
    assert writes == [writes[0], "manifest"]  # the successor's tombstone and manifest only
    assert zombie == published[0]
    assert json.loads(shards.get("out/results.manifest.json"))["identity"] == published[0]["identity"]
    assert "out/results.lease.json" not in shards.published()


def test_no_two_merges_publish_the_same_manifest_bytes(shards):
    # A manifest unique per publish: a write If-Match an ETag read before another try published can
    # never match that try's manifest by coincidence (the ETag ABA of shard seeds 1416, 3668, 6762).
    first = shards.get("out/results.manifest.json") if shards.merge() else b""
    shards.client.delete_object(Bucket=shards.bucket, Key="out/results.manifest.json")
    second = shards.merge()
    assert shards.get("out/results.manifest.json") != first
    assert second["identity"]["merged_shards"] == json.loads(first)["identity"]["merged_shards"]
    assert second["identity"]["publish_id"] != json.loads(first)["identity"]["publish_id"]


def test_a_merge_of_a_shard_published_again_republishes_the_merged_output(shards):
    first = shards.merge()
    # Shard 2 ran again (cleared by a user): new results, new ETag, new manifest.
    shards.manifests[2] = {
        **shards.manifests[2],
        "output_etag": shards.put(
            shards.key(2, ".results.jsonl"), b"\n".join(result_line(f"again-{n}") for n in range(3))
        ),
    }
    second = shards.merge()
    assert second["identity"]["merged_shards"] != first["identity"]["merged_shards"]
    assert b"again-2" in shards.get("out/results.jsonl")
    assert json.loads(shards.get("out/results.manifest.json"))["identity"] == second["identity"]


@pytest.mark.parametrize("change", ["results overwritten", "older manifest", "tombstone"])
def test_a_merged_output_not_complete_for_these_shards_is_merged_again(shards, change):
    first = shards.merge()
    if change == "results overwritten":
        shards.put("out/results.jsonl", b"someone else's lines\n")
    elif change == "older manifest":
        # A merged manifest written before merges recorded their shards: not known to be this merge.
        older = {k: v for k, v in first.items() if k != "identity" and v is not None}
        shards.put("out/results.manifest.json", json.dumps(older).encode())
    else:
        shards.put(
            "out/results.manifest.json",
            b'{"tombstone": "0f", "output_uri": "%s"}' % shards.output_uri.encode(),
        )
    second = shards.merge()
    assert second["identity"]["publish_id"] != first["identity"]["publish_id"]
    assert len(shards.get("out/results.jsonl").splitlines()) == 8
    assert json.loads(shards.get("out/results.manifest.json"))["identity"] == second["identity"]


def test_a_merge_whose_pinned_tombstone_became_this_merge_complete_returns_it_writing_nothing(
    shards, monkeypatch
):
    # Shard seed 931: a paused earlier try's manifest lands between this (last) try's read of the
    # manifest and its tombstone; the try holds the lease and the output is its merge, complete.
    shards.merge(ti=FakeTI(1))
    finished = shards.get("out/results.manifest.json")
    shards.put(
        "out/results.manifest.json", b'{"tombstone": "0f", "output_uri": "%s"}' % shards.output_uri.encode()
    )
    real_body_at = MergedOutputStore._manifest_body_at

    def earlier_try_lands_meanwhile(self, etag):
        shards.put("out/results.manifest.json", finished)
        return real_body_at(self, etag)

    monkeypatch.setattr(MergedOutputStore, "_manifest_body_at", earlier_try_lands_meanwhile)
    writes: list[bytes] = []
    real_put = OutputStore._put_manifest_key
    monkeypatch.setattr(
        OutputStore,
        "_put_manifest_key",
        lambda self, body, condition: writes.append(body) or real_put(self, body, condition),
    )
    returned = shards.merge(ti=FakeTI(3))
    assert writes == []
    assert returned["identity"] == json.loads(finished)["identity"]
    assert shards.get("out/results.manifest.json") == finished
