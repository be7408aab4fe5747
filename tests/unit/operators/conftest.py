"""Fixtures of the operator tests on a warm server: the stand-in server, the batch, quick retries."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from airflow_vllm_batch.serving import stream
from tests.unit.operators.test_vllm_batch_server import CONN_ID, Batch, ServedStandIn
from tests.unit.serving.conftest import API_KEY


@pytest.fixture
def server() -> Iterator[ServedStandIn]:
    stand_in = ServedStandIn().start()
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(
        {
            "conn_type": "vllm",
            "host": "127.0.0.1",
            "port": stand_in.port,
            "password": API_KEY,
            "extra": {"max_in_flight": 4},
        }
    )
    yield stand_in
    os.environ.pop(f"AIRFLOW_CONN_{CONN_ID.upper()}", None)
    stand_in.close()


@pytest.fixture
def quick_retries(monkeypatch):
    """No backoff between retries of a gone server: the retry count still bounds them.

    Not autouse: a module asks for it with ``pytestmark = pytest.mark.usefixtures("quick_retries")``.
    """
    monkeypatch.setattr(stream, "backoff", lambda attempt, first_s: 0.001)


@pytest.fixture
def batch(s3, bucket, tmp_path) -> Batch:
    return Batch(s3, bucket, tmp_path)
