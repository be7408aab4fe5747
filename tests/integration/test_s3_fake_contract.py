"""The fault simulator's in-memory S3 answers like a real one: the same call sequences on the fake and on SeaweedFS.

Each sequence is the run code's own use of S3 (the lease's conditional create, renew and
delete, a conditional write retried after its response was lost, pinned reads, listing,
the managed copy, batch deletes); the test compares what both return: the outcome of each
call (its fields that the code reads, or the error code and HTTP status) and the objects
left. A difference means the simulator's verdicts cannot be trusted for that call.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from tests.simulation.s3 import FakeS3, FakeS3Client

if TYPE_CHECKING:
    import pytest


def outcome(call) -> Any:
    """What the run code can see of one call: selected fields, or the error's code and status."""
    try:
        result = call()
    except ClientError as err:
        return ("error", err.response["Error"]["Code"], err.response["ResponseMetadata"]["HTTPStatusCode"])
    if result is None:
        return ("ok",)
    if "Body" in result:
        return ("body", result["Body"].read(), result["ETag"])
    if "Contents" in result or "KeyCount" in result:
        return ("keys", [o["Key"] for o in result.get("Contents", [])])
    if "Deleted" in result:
        return ("deleted", sorted(d["Key"] for d in result["Deleted"]))
    return ("ok", result.get("ETag"))


def sequence(client, bucket: str) -> list[Any]:
    """The run code's S3 calls, in the order a lease, a publish and a resume make them."""
    lease, out = "k/results.lease.json", "k/results.jsonl"
    seen: list[Any] = []
    seen.append(outcome(lambda: client.get_object(Bucket=bucket, Key=lease)))  # free: NoSuchKey
    first = client.put_object(Bucket=bucket, Key=lease, Body=b'{"try": 1}', IfNoneMatch="*")
    seen.append(("ok", first["ETag"]))
    seen.append(
        outcome(lambda: client.put_object(Bucket=bucket, Key=lease, Body=b'{"try": 2}', IfNoneMatch="*"))
    )  # taken: 412
    renewed = client.put_object(
        Bucket=bucket, Key=lease, Body=b'{"try": 1, "beat": 1}', IfMatch=first["ETag"]
    )
    seen.append(("ok", renewed["ETag"]))
    # A renewal whose response was lost, sent again by botocore with the old ETag: 412.
    seen.append(
        outcome(
            lambda: client.put_object(
                Bucket=bucket, Key=lease, Body=b'{"try": 1, "beat": 1}', IfMatch=first["ETag"]
            )
        )
    )
    seen.append(
        outcome(lambda: client.get_object(Bucket=bucket, Key=lease, IfMatch=first["ETag"]))
    )  # a pinned read of old content: 412
    seen.append(outcome(lambda: client.get_object(Bucket=bucket, Key=lease, IfMatch=renewed["ETag"])))
    seen.append(
        outcome(lambda: client.head_object(Bucket=bucket, Key="k/missing"))
    )  # S3Hook.head_object reads the 404
    client.put_object(
        Bucket=bucket, Key="k/results.jsonl.staging/r/parts/part-000000-a.jsonl", Body=b'{"custom_id": "a"}\n'
    )
    client.put_object(
        Bucket=bucket, Key="k/results.jsonl.staging/r/parts/part-000001-a.jsonl", Body=b'{"custom_id": "b"}\n'
    )
    client.put_object(Bucket=bucket, Key="k/results.jsonl.staging/r/results.jsonl", Body=b"staged\n")
    seen.append(
        outcome(lambda: client.list_objects_v2(Bucket=bucket, Prefix="k/results.jsonl.staging/r/parts/"))
    )
    client.copy({"Bucket": bucket, "Key": "k/results.jsonl.staging/r/results.jsonl"}, bucket, out)
    seen.append(outcome(lambda: client.get_object(Bucket=bucket, Key=out)))
    copied = client.copy_object(
        Bucket=bucket,
        Key=out,
        CopySource={"Bucket": bucket, "Key": "k/results.jsonl.staging/r/parts/part-000000-a.jsonl"},
    )
    seen.append(("ok", copied["CopyObjectResult"]["ETag"]))
    seen.append(outcome(lambda: client.get_object(Bucket=bucket, Key=out)))
    client.upload_fileobj(io.BytesIO(b'{"manifest": 1}'), bucket, "k/results.manifest.json")
    seen.append(outcome(lambda: client.get_object(Bucket=bucket, Key="k/results.manifest.json")))
    seen.append(
        outcome(
            lambda: client.delete_objects(
                Bucket=bucket,
                Delete={
                    "Objects": [{"Key": "k/results.jsonl.staging/r/results.jsonl"}, {"Key": "k/never-there"}]
                },
            )
        )
    )
    seen.append(outcome(lambda: client.delete_object(Bucket=bucket, Key=lease, IfMatch=renewed["ETag"])))
    seen.append(outcome(lambda: client.get_object(Bucket=bucket, Key=lease)))
    # Publishing's conditional writes (storage.publishing.OutputStore.publish): a copy and a PUT over what was seen,
    # the same after another writer changed it, and a conditional delete of a key that is gone.
    source = {"Bucket": bucket, "Key": "k/results.jsonl.staging/r/parts/part-000001-a.jsonl"}
    seen.append(
        outcome(
            lambda: client.copy_object(
                Bucket=bucket, Key=out, CopySource=source, IfMatch=copied["CopyObjectResult"]["ETag"]
            )
        )
    )
    seen.append(
        outcome(
            lambda: client.copy_object(
                Bucket=bucket, Key=out, CopySource=source, IfMatch=copied["CopyObjectResult"]["ETag"]
            )
        )
    )
    seen.append(
        outcome(lambda: client.copy_object(Bucket=bucket, Key=out, CopySource=source, IfNoneMatch="*"))
    )
    seen.append(
        outcome(
            lambda: client.put_object(
                Bucket=bucket, Key="k/results.errors.jsonl", Body=b"e\n", IfNoneMatch="*"
            )
        )
    )
    seen.append(
        outcome(
            lambda: client.put_object(
                Bucket=bucket, Key="k/results.errors.jsonl", Body=b"f\n", IfMatch=first["ETag"]
            )
        )
    )
    # The manifest's chain: a tombstone If-Match the manifest seen, a successor's tombstone over it, the
    # paused zombie's manifest If-Match its own (replaced) tombstone: 412; the successor's manifest lands,
    # and botocore sending it again (its answer lost) meets its own new ETag: 412.
    manifest = "k/results.manifest.json"
    old = client.head_object(Bucket=bucket, Key=manifest)["ETag"]
    zombie = client.put_object(Bucket=bucket, Key=manifest, Body=b'{"tombstone": "z"}', IfMatch=old)
    seen.append(("ok", zombie["ETag"]))
    successor = client.put_object(
        Bucket=bucket, Key=manifest, Body=b'{"tombstone": "s"}', IfMatch=zombie["ETag"]
    )
    seen.append(("ok", successor["ETag"]))
    seen.append(
        outcome(
            lambda: client.put_object(
                Bucket=bucket, Key=manifest, Body=b'{"manifest": "z"}', IfMatch=zombie["ETag"]
            )
        )
    )
    seen.append(
        outcome(
            lambda: client.put_object(
                Bucket=bucket, Key=manifest, Body=b'{"manifest": "s"}', IfMatch=successor["ETag"]
            )
        )
    )
    seen.append(
        outcome(
            lambda: client.put_object(
                Bucket=bucket, Key=manifest, Body=b'{"manifest": "s"}', IfMatch=successor["ETag"]
            )
        )
    )
    seen.append(outcome(lambda: client.get_object(Bucket=bucket, Key=manifest)))
    seen.append(
        outcome(
            lambda: client.put_object(
                Bucket=bucket, Key="k2/results.manifest.json", Body=b'{"tombstone": "n"}', IfNoneMatch="*"
            )
        )
    )
    seen.append(outcome(lambda: client.delete_object(Bucket=bucket, Key=lease, IfMatch=renewed["ETag"])))
    seen.append(outcome(lambda: client.head_bucket(Bucket=bucket)))
    seen.append(outcome(lambda: client.list_objects_v2(Bucket=bucket, Prefix="k/")))
    return seen


def normalised(seen: list[Any]) -> list[Any]:
    """ETags are MD5s on both; HTTP statuses of missing keys are what the code compares."""
    return [tuple(x.strip('"') if isinstance(x, str) else x for x in entry) for entry in seen]


def test_the_fake_s3_answers_the_run_codes_calls_as_seaweedfs_does(seaweed, request: pytest.FixtureRequest):
    bucket = "contract" + format(abs(hash(request.node.nodeid)), "x")[:8]
    seaweed.create_bucket(bucket)
    real = normalised(sequence(seaweed.client(), bucket))
    fake_s3 = FakeS3()
    fake_s3.create_bucket(bucket)
    fake = normalised(sequence(FakeS3Client(fake_s3), bucket))
    assert fake == real
