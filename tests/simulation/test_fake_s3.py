"""The fake S3's fault model: what botocore does when a response is lost after the call landed."""

from __future__ import annotations

import random

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from tests.simulation.s3 import FakeS3, FakeS3Client


class Scripted:
    """A fault plan that injects the given faults, in order, then none."""

    def __init__(self, *faults: str | None) -> None:
        self.faults = list(faults)
        self.injected: dict[str, int] = {}

    def draw(self) -> str | None:
        return self.faults.pop(0) if self.faults else None


def client(*faults: str | None) -> tuple[FakeS3, FakeS3Client]:
    s3 = FakeS3(faults=Scripted(*faults))  # type: ignore[arg-type]
    s3.create_bucket("b")
    return s3, FakeS3Client(s3)


def test_a_conditional_write_whose_response_was_lost_is_retried_and_meets_its_own_etag_as_412():
    s3, s3_client = client()
    etag = s3_client.put_object(Bucket="b", Key="lease", Body=b"1", IfNoneMatch="*")["ETag"]
    s3.faults = Scripted("lost_response")  # type: ignore[assignment]
    with pytest.raises(ClientError) as err:
        s3_client.put_object(Bucket="b", Key="lease", Body=b"2", IfMatch=etag)
    assert err.value.response["Error"]["Code"] == "PreconditionFailed"
    assert s3.buckets["b"]["lease"].body == b"2"  # the write landed all the same


def test_an_error_before_the_call_is_retried_and_changes_nothing_twice():
    s3, s3_client = client("error", "error")
    s3_client.put_object(Bucket="b", Key="k", Body=b"x")
    assert s3.buckets["b"]["k"].body == b"x"
    assert len(s3.mutations) == 1


def test_an_outage_reaches_the_caller_and_nothing_lands():
    s3, s3_client = client("outage")
    with pytest.raises(EndpointConnectionError):
        s3_client.put_object(Bucket="b", Key="k", Body=b"x")
    assert "k" not in s3.buckets["b"]


def test_five_lost_responses_in_a_row_raise_although_the_write_landed():
    s3, s3_client = client(*["lost_response"] * 5)
    with pytest.raises(Exception, match="Read timeout"):
        s3_client.put_object(Bucket="b", Key="k", Body=b"x")
    assert s3.buckets["b"]["k"].body == b"x"


def test_a_fault_plan_draws_the_same_faults_from_the_same_seed():
    from tests.simulation.s3 import FaultPlan

    plan_a, plan_b = FaultPlan(random.Random(5), 0.3), FaultPlan(random.Random(5), 0.3)
    drawn = [plan_a.draw() for _ in range(50)]
    assert drawn == [plan_b.draw() for _ in range(50)]
    assert any(drawn)


def test_the_trace_shows_each_attempt_with_its_conditions_fault_and_outcome():
    s3, s3_client = client()
    etag = s3_client.put_object(Bucket="b", Key="lease", Body=b"1", IfNoneMatch="*")["ETag"]
    s3.faults = Scripted("lost_response")  # type: ignore[assignment]
    with pytest.raises(ClientError):
        s3_client.put_object(Bucket="b", Key="lease", Body=b"2", IfMatch=etag)
    lost, retried = s3.trace[-2:]
    assert f"IfMatch={etag}" in lost
    assert "[lost_response]: applied, response lost" in lost
    assert "attempt 2: raises PreconditionFailed" in retried
