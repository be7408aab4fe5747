"""The output lease on a real S3 (SeaweedFS honours conditional writes).

No test sleeps for a heartbeat: they call :meth:`OutputLease.beat` or wait for the heartbeat
thread with :meth:`OutputLease.wait_for_beats`, so a loaded machine only makes them slower.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from botocore.exceptions import ReadTimeoutError

from airflow_vllm_batch.exceptions import OutputBusyError
from airflow_vllm_batch.lease import LeaseHolder, OutputLease

KEY = "out/results.lease.json"


def holder(run_id: str = "run-1", try_number: int = 1, task_id: str = "vllm_batch") -> LeaseHolder:
    return LeaseHolder("dag", run_id, task_id, -1, try_number, "f" * 64, "worker-a")


def lease(s3, bucket, who: LeaseHolder, **kwargs) -> OutputLease:
    return OutputLease(s3.client(), bucket, KEY, who, **kwargs)


def test_a_free_output_is_taken_and_given_back(s3, bucket):
    with lease(s3, bucket, holder()):
        assert s3.client().head_object(Bucket=bucket, Key=KEY)
    assert "Contents" not in s3.client().list_objects_v2(Bucket=bucket)


def test_another_run_is_refused_while_the_lease_is_live(s3, bucket):
    with (
        lease(s3, bucket, holder("run-1")),
        pytest.raises(OutputBusyError, match=r"dag\.vllm_batch of run 'run-1' \(try 1, on worker-a\) holds"),
    ):
        lease(s3, bucket, holder("run-2")).acquire()


def test_the_same_task_instance_takes_its_own_lease_over_at_once(s3, bucket):
    first = lease(s3, bucket, holder(try_number=1))
    first.acquire()  # never released: the try was SIGKILLed
    with lease(s3, bucket, holder(try_number=2)):
        pass
    first._stop.set()


@pytest.mark.parametrize("stale_after_s", [120.0, 0.0])
def test_a_zombie_try_never_takes_the_lease_back_from_its_newer_successor(s3, bucket, stale_after_s):
    # Try 1 paused before taking the lease (Airflow gave up on it and started try 2); try 2 holds it.
    successor = lease(s3, bucket, holder(try_number=2), heartbeat_s=3600)
    successor.acquire()
    zombie = lease(s3, bucket, holder(try_number=1), stale_after_s=stale_after_s)
    with pytest.raises(OutputBusyError, match=r"A later try of this task, .*\(try 2, on worker-a\), holds"):
        zombie.acquire()
    # Try 2 still holds it (live, or silent past stale_after_s: a take-over never goes to an older try).
    assert json.loads(s3.client().get_object(Bucket=bucket, Key=KEY)["Body"].read())["try_number"] == 2
    successor.ensure_held(verify=True)
    successor.release()


class ReleasedBeforeTheTakeOver:
    """A client on which the lease's holder gives it back right between a take-over's read and its write."""

    def __init__(self, client) -> None:
        self.client = client
        self.released = False

    def __getattr__(self, name):
        return getattr(self.client, name)

    def put_object(self, **kwargs):
        if "IfMatch" in kwargs and not self.released:
            self.released = True
            self.client.delete_object(Bucket=kwargs["Bucket"], Key=kwargs["Key"])  # the holder's release
        return self.client.put_object(**kwargs)


def test_a_lease_given_back_during_its_take_over_is_taken_again_not_a_failure(s3, bucket):
    # Simulator seed 120: the last try read its zombie predecessor's lease, the predecessor published and
    # released it, and the take-over's If-Match met no object: the last try failed, and with it the task.
    earlier = lease(s3, bucket, holder(try_number=1), heartbeat_s=3600)
    earlier.acquire()
    client = ReleasedBeforeTheTakeOver(s3.client())
    with OutputLease(client, bucket, KEY, holder(try_number=2), heartbeat_s=3600) as taken:
        assert client.released
        taken.ensure_held(verify=True)
        assert json.loads(s3.client().get_object(Bucket=bucket, Key=KEY)["Body"].read())["try_number"] == 2
    earlier._stop.set()


class OlderTryTakesItFirst:
    """A client on which an older try of the same task takes the lease over between a take-over's read and its write."""

    def __init__(self, client, older: LeaseHolder) -> None:
        self.client = client
        self.older = older
        self.raced = False

    def __getattr__(self, name):
        return getattr(self.client, name)

    def put_object(self, **kwargs):
        if "IfMatch" in kwargs and not self.raced:
            self.raced = True
            body = json.dumps({**dataclasses.asdict(self.older), "written_at": 0, "nonce": "older"}).encode()
            self.client.put_object(Bucket=kwargs["Bucket"], Key=kwargs["Key"], Body=body)
        return self.client.put_object(**kwargs)


def test_a_take_over_raced_by_an_older_try_of_the_task_takes_the_lease_from_it(s3, bucket):
    # Simulator seed 2335 (at fdc20fc): tries 3 (a zombie) and 4 both took over try 2's lease; try 3's write
    # won, and try 4, the task's last, failed with OutputBusyError although a newer try may take an older's lease.
    lease(s3, bucket, holder(try_number=2), heartbeat_s=3600).acquire()
    client = OlderTryTakesItFirst(s3.client(), holder(try_number=3))
    with OutputLease(client, bucket, KEY, holder(try_number=4), heartbeat_s=3600) as taken:
        assert client.raced
        taken.ensure_held(verify=True)
        assert json.loads(s3.client().get_object(Bucket=bucket, Key=KEY)["Body"].read())["try_number"] == 4


def test_a_take_over_raced_by_another_run_still_fails_naming_it(s3, bucket):
    lease(s3, bucket, holder("run-1"), heartbeat_s=3600).acquire()
    client = OlderTryTakesItFirst(s3.client(), holder("run-3"))
    with pytest.raises(OutputBusyError, match="run-3"):
        OutputLease(client, bucket, KEY, holder("run-2"), stale_after_s=0).acquire()


def test_a_lease_silent_for_stale_after_s_is_taken_over_by_another_run(s3, bucket):
    dead = lease(s3, bucket, holder("run-1"), heartbeat_s=3600)
    dead.acquire()
    # Its age (0 s or more, on the server's clock) has reached stale_after_s=0: no sleep needed.
    with lease(s3, bucket, holder("run-2"), stale_after_s=0):
        assert json.loads(s3.client().get_object(Bucket=bucket, Key=KEY)["Body"].read())["run_id"] == "run-2"
    dead._stop.set()


def test_heartbeats_rewrite_the_lease_and_keep_it_held(s3, bucket):
    with lease(s3, bucket, holder("run-1"), heartbeat_s=0.05) as live:
        seen = s3.client().head_object(Bucket=bucket, Key=KEY)["ETag"]
        # Beat n+1 may have written before that HEAD; beat n+2 starts after it: its write is newer.
        assert live.wait_for_beats(live._beats + 2, timeout=60)
        renewed = json.loads(s3.client().get_object(Bucket=bucket, Key=KEY)["Body"].read())
        assert s3.client().head_object(Bucket=bucket, Key=KEY)["ETag"] != seen
        assert renewed["run_id"] == "run-1"
        assert renewed["nonce"] in live._nonces
        live.ensure_held(verify=True)
        assert not live.lost


def test_a_holder_whose_lease_was_taken_over_knows_it_at_its_next_heartbeat_and_does_not_delete_the_new_one(
    s3, bucket
):
    slow = lease(s3, bucket, holder("run-1"), heartbeat_s=3600)
    slow.acquire()
    # Another run decides the first is dead and takes over (as after a long network partition).
    other = lease(s3, bucket, holder("run-2"), stale_after_s=0)
    other.acquire()
    slow.beat()
    assert slow.lost
    with pytest.raises(OutputBusyError, match="took over the lease"):
        slow.ensure_held()
    slow.release()
    assert json.loads(s3.client().get_object(Bucket=bucket, Key=KEY)["Body"].read())["run_id"] == "run-2"
    other.release()


class LostResponses:
    """A boto3 client whose next ``put_object`` calls land at S3 but whose responses are lost.

    ``"retried-412"``: botocore retries the PUT as it was sent, with the If-Match (or
    If-None-Match) that no longer holds, and S3 answers that retry 412. ``"timeout"``: the
    client gives up reading the response.
    """

    def __init__(self, client, how: str) -> None:
        self.client = client
        self.how = how
        self.losing = 0

    def __getattr__(self, name):
        return getattr(self.client, name)

    def put_object(self, **kwargs):
        response = self.client.put_object(**kwargs)
        if not self.losing:
            return response
        self.losing -= 1
        if self.how == "retried-412":
            return self.client.put_object(**kwargs)  # raises: S3's 412 to the stale condition
        raise ReadTimeoutError(endpoint_url="http://s3")


@pytest.mark.parametrize("how", ["retried-412", "timeout"])
def test_a_heartbeat_whose_response_was_lost_keeps_the_lease(s3, bucket, how):
    client = LostResponses(s3.client(), how)
    held = OutputLease(client, bucket, KEY, holder(), heartbeat_s=3600)
    held.acquire()
    client.losing = 1
    held.beat()
    assert not held.lost
    held.ensure_held(verify=True)
    held.beat()  # the next renewal's If-Match is the ETag the lost write made
    assert not held.lost
    held.release()
    assert "Contents" not in s3.client().list_objects_v2(Bucket=bucket)  # released: the ETag was current


@pytest.mark.parametrize("how", ["retried-412", "timeout"])
def test_an_acquisition_whose_response_was_lost_holds_the_lease(s3, bucket, how):
    client = LostResponses(s3.client(), how)
    client.losing = 1
    with OutputLease(client, bucket, KEY, holder(), heartbeat_s=3600) as held:
        held.ensure_held(verify=True)
    assert "Contents" not in s3.client().list_objects_v2(Bucket=bucket)


@pytest.mark.parametrize("how", ["retried-412", "timeout"])
def test_a_renewal_after_a_landed_write_nobody_could_confirm_keeps_the_lease(s3, bucket, how):
    client = LostResponses(s3.client(), how)
    held = OutputLease(client, bucket, KEY, holder(), heartbeat_s=3600)
    held.acquire()
    real_get = client.client.get_object
    failing = {"reads": 1}

    def get_object(**kwargs):
        if failing["reads"]:
            failing["reads"] -= 1
            raise ReadTimeoutError(endpoint_url="http://s3")
        return real_get(**kwargs)

    client.get_object = get_object
    client.losing = 1
    held.beat()  # landed, response lost, and the read-back failed too: this try cannot tell yet
    held.beat()  # its If-Match is stale (412), but the lease still holds one of this try's nonces
    assert not held.lost
    held.ensure_held(verify=True)
    held.release()
    assert "Contents" not in s3.client().list_objects_v2(Bucket=bucket)
