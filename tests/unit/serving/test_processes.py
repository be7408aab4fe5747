"""run_stream_processes's own edges: the in-flight split, and a server gone under the workers."""

from __future__ import annotations

import socket

import pytest

from airflow_vllm_batch.exceptions import ServerUnavailableError
from airflow_vllm_batch.serving import Journal
from airflow_vllm_batch.serving.processes import run_stream_processes, worker_in_flight


@pytest.mark.parametrize(("bound", "processes"), [(512, 2), (7, 3), (4, 4), (2, 3)])
def test_the_in_flight_bound_is_split_between_the_workers(bound, processes):
    shares = [worker_in_flight(bound, processes, index) for index in range(processes)]
    assert min(shares) >= 1
    assert max(shares) - min(shares) <= 1
    assert sum(shares) == max(bound, processes)


def test_a_server_gone_under_the_workers_fails_retryable_and_every_worker_stops(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    lines = [
        (i + 1, b'{"custom_id":"r%d","method":"POST","url":"/v1/chat/completions","body":{}}' % i)
        for i in range(40)
    ]
    with pytest.raises(ServerUnavailableError, match="did not answer after 1 retries") as raised:
        run_stream_processes(
            lines,
            processes=2,
            base_url=f"http://127.0.0.1:{port}",
            api_key=None,
            journal=Journal(tmp_path),
            max_in_flight=4,
            retries=1,
            backoff_s=0.001,
        )
    assert raised.value.retryable


def test_one_process_is_the_in_process_stream_not_this(tmp_path):
    with pytest.raises(ValueError, match="at least 2 processes"):
        run_stream_processes(
            [], processes=1, base_url="http://x", api_key=None, journal=Journal(tmp_path), max_in_flight=1
        )
