"""Fixtures of the fast unit tests: a real S3 (SeaweedFS starts in about a second).

Unit tests use no engine and no Airflow deployment; where a test needs S3 it gets a real
one, because presigned URLs, conditional writes and ETags are exactly what can go wrong.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from vllm_batch_embedded.seaweedfs import SeaweedFS


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """SeaweedFS on a free loopback port, reachable through the ``aws_default`` connection."""
    saved = os.environ.get("AIRFLOW_CONN_AWS_DEFAULT")
    with SeaweedFS(tmp_path_factory.mktemp("unit-s3")) as server:
        os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = server.airflow_connection_json()
        yield server
    if saved is None:
        os.environ.pop("AIRFLOW_CONN_AWS_DEFAULT", None)
    else:
        os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = saved


@pytest.fixture
def bucket(s3: SeaweedFS, request: pytest.FixtureRequest) -> str:
    """A new, empty bucket for one test."""
    name = "t" + format(abs(hash(request.node.nodeid)), "x")[:12]
    s3.create_bucket(name)
    return name
