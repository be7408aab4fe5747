"""The output lease on a real S3 (SeaweedFS honours conditional writes)."""

from __future__ import annotations

import time

import pytest

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
    with lease(s3, bucket, holder("run-1")):
        with pytest.raises(OutputBusyError, match=r"dag\.vllm_batch of run 'run-1' \(try 1, on worker-a\) holds"):
            lease(s3, bucket, holder("run-2")).acquire()


def test_the_same_task_instance_takes_its_own_lease_over_at_once(s3, bucket):
    first = lease(s3, bucket, holder(try_number=1))
    first.acquire()  # never released: the try was SIGKILLed
    with lease(s3, bucket, holder(try_number=2)):
        pass
    first._stop.set()


def test_a_stale_lease_is_taken_over_by_another_run(s3, bucket):
    dead = lease(s3, bucket, holder("run-1"), heartbeat_s=3600)
    dead.acquire()
    time.sleep(1.1)
    with lease(s3, bucket, holder("run-2"), stale_after_s=1):
        pass
    dead._stop.set()


def test_heartbeats_keep_a_lease_live(s3, bucket):
    with lease(s3, bucket, holder("run-1"), heartbeat_s=0.5):
        time.sleep(2.2)
        with pytest.raises(OutputBusyError):
            lease(s3, bucket, holder("run-2"), stale_after_s=1.5).acquire()


def test_a_holder_whose_lease_was_taken_over_knows_it_and_does_not_delete_the_new_one(s3, bucket):
    slow = lease(s3, bucket, holder("run-1"), heartbeat_s=0.3)
    slow.acquire()
    # Another run decides the first is dead and takes over (as after a long network partition).
    other = lease(s3, bucket, holder("run-2"), stale_after_s=0)
    other.acquire()
    time.sleep(1)
    with pytest.raises(OutputBusyError, match="took over the lease"):
        slow.ensure_held()
    slow.release()
    assert s3.client().head_object(Bucket=bucket, Key=KEY)  # still run-2's
    other.release()
