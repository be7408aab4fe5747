"""A warm-server batch that yields to interactive users (``WarmVLLMServer(yield_to_interactive=...)``), through the operator.

The stand-in warm server of ``test_vllm_batch_server.py``, with a ``/metrics`` and, when a test
says so, a ``/server_info`` that tells its scheduling policy (vLLM serves it only in its dev mode).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator

import pytest
from aiohttp import web

from airflow_vllm_batch.engines import WarmVLLMServer, YieldToInteractive, server as server_engines
from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.serving import ServerUnavailableError
from tests.unit.operators.test_vllm_batch_runs import FakeTI
from tests.unit.operators.test_vllm_batch_server import (
    CONN_ID,
    Batch,
    N,
    ServedStandIn,
    _dies_after,
)
from tests.unit.serving.conftest import API_KEY


class SharedWarmServer(ServedStandIn):
    """The warm stand-in with ``/metrics`` (``others`` requests of other users) and an optional ``/server_info``."""

    policy: str | None = None
    others = 0

    async def _start(self) -> None:
        self.priorities: list[object] = []
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        if self.policy is not None:
            app.router.add_get("/server_info", self._server_info)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _handle(self, request: web.Request) -> web.Response:
        self.priorities.append((await request.json()).get("priority", "absent"))
        return await super()._handle(request)

    async def _metrics(self, request: web.Request) -> web.Response:
        total = self.in_flight + self.others
        return web.Response(
            text=f"vllm:num_requests_running {min(total, 8)}.0\nvllm:num_requests_waiting {max(0, total - 8)}.0\n"
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"vllm_config": {"scheduler_config": {"policy": self.policy, "max_num_seqs": 8}}}
        )


def _connection(port: int, **extra) -> None:
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(
        {
            "conn_type": "vllm",
            "host": "127.0.0.1",
            "port": port,
            "password": API_KEY,
            "extra": {"max_in_flight": 4, **extra},
        }
    )


@pytest.fixture
def shared(request) -> Iterator[SharedWarmServer]:
    stand_in = SharedWarmServer()
    stand_in.policy = getattr(request, "param", None)
    stand_in.start()
    _connection(stand_in.port)
    yield stand_in
    os.environ.pop(f"AIRFLOW_CONN_{CONN_ID.upper()}", None)
    stand_in.close()


@pytest.fixture
def batch(s3, bucket, tmp_path) -> Batch:
    return Batch(s3, bucket, tmp_path)


@pytest.mark.parametrize("shared", ["priority"], indirect=True)
def test_a_server_that_says_it_runs_priority_scheduling_gets_the_batchs_priority_on_every_request(
    batch, shared, capfd
):
    manifest = batch.run(yield_to_interactive=True)
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    assert shared.priorities == [10] * N
    assert (
        "requests carry priority 10 (its /server_info says --scheduling-policy priority)"
        in capfd.readouterr().out
    )


@pytest.mark.parametrize("shared", ["fcfs"], indirect=True)
def test_a_server_that_says_it_runs_fcfs_never_gets_a_priority_even_when_the_user_says_otherwise(
    batch, shared, capfd
):
    batch.run(yield_to_interactive=YieldToInteractive(priority_scheduling=True))
    assert shared.priorities == ["absent"] * N
    assert "but the server says it runs --scheduling-policy fcfs" in capfd.readouterr().out


def test_a_server_that_does_not_say_gets_no_priority_and_the_log_says_how_to_state_it(batch, shared, capfd):
    batch.run(yield_to_interactive=True)
    assert shared.priorities == ["absent"] * N
    assert "the server does not say its scheduling policy" in capfd.readouterr().out


def test_the_connections_scheduling_policy_extra_states_it_for_a_server_that_does_not_say(
    batch, shared, capfd
):
    _connection(shared.port, scheduling_policy="priority")
    batch.run(yield_to_interactive=YieldToInteractive(priority=3))
    assert shared.priorities == [3] * N
    assert "the connection's scheduling_policy extra is 'priority'" in capfd.readouterr().out


def test_the_user_may_state_it_for_a_server_that_does_not_say(batch, shared):
    batch.run(yield_to_interactive=YieldToInteractive(priority_scheduling=True))
    assert shared.priorities == [10] * N


def test_without_yield_to_interactive_no_priority_is_sent_and_no_metrics_read(batch, shared):
    batch.run()
    assert shared.priorities == ["absent"] * N


def test_each_progress_line_says_the_bound_and_why_it_last_moved(batch, shared, monkeypatch, capfd):
    monkeypatch.setattr(server_engines, "PROGRESS_EVERY_S", 0.05)
    shared.others = 10  # the server's queue is full of others' requests: the batch stays at its floor

    async def slow(custom_id: str, body: dict, attempt: int) -> web.Response:
        await asyncio.sleep(0.05)
        return web.json_response(
            {"id": custom_id, "object": "chat.completion", "created": 1, "model": "m", "choices": []}
        )

    shared.behaviour = slow
    batch.run(yield_to_interactive=YieldToInteractive(min_in_flight=1))
    out = capfd.readouterr().out
    assert (
        "in flight between 1 and 4 requests, following every 0.5s the load read at http://127.0.0.1:" in out
    )
    line = next(line for line in out.splitlines() if "Progress: " in line)
    assert (
        " in flight (bound 1: lowered 0x, raised 0x since the last line; last " not in line
    )  # nothing moved: no "last"
    assert " in flight (bound 1: lowered 0x, raised 0x since the last line)" in line
    assert shared.max_in_flight == 1


def test_a_retry_of_a_yielding_batch_resumes_from_the_parts_and_sends_only_the_unanswered(batch, shared):
    shared.behaviour = _dies_after(shared, 10)
    with pytest.raises(ServerUnavailableError):
        batch.run(max_in_flight=1, yield_to_interactive=True)
    sent_first = dict(shared.attempts)
    shared.restart()
    shared.behaviour = _dies_after(shared, N)
    manifest = batch.run(FakeTI(try_number=2), max_in_flight=1, yield_to_interactive=True)
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    resent = {cid for cid, n in shared.attempts.items() if n - sent_first.get(cid, 0)}
    assert resent == {f"r{i}" for i in range(10, N)}
    assert sorted(r["custom_id"] for r in batch.lines("out/results.jsonl")) == sorted(
        f"r{i}" for i in range(N)
    )


def test_yielding_is_not_in_the_run_identity_a_finished_run_is_returned_without_a_request(batch, shared):
    first = batch.run(yield_to_interactive=True)
    sent = shared.requests
    again = batch.run(FakeTI(try_number=2))
    assert again["fingerprint"] == first["fingerprint"]
    assert shared.requests == sent


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"yield_to_interactive": "yes"}, "yield_to_interactive must be True, False or a YieldToInteractive"),
        (
            {"yield_to_interactive": True, "client_processes": 2},
            "yield_to_interactive needs client_processes=1",
        ),
        (
            {"yield_to_interactive": YieldToInteractive(priority=0)},
            r"priority=...\) must be a whole number >= 1",
        ),
        (
            {"yield_to_interactive": YieldToInteractive(min_in_flight=0)},
            r"min_in_flight=...\) must be a whole number >= 1",
        ),
        (
            {"yield_to_interactive": YieldToInteractive(metrics_urls="http://a/metrics")},
            "must be a list of http",
        ),
        (
            {"yield_to_interactive": YieldToInteractive(priority_scheduling="yes")},
            "must be True, False or None",
        ),
    ],
)
def test_yielding_options_that_cannot_work_fail_at_dag_parse_time_naming_the_parameter(
    batch, options, message
):
    with pytest.raises(ConfigurationError, match=message):
        batch.operator(**options)


def test_the_rendered_view_shows_the_yielding_options():
    shown = WarmVLLMServer(conn_id="c", yield_to_interactive=YieldToInteractive(min_in_flight=2)).serialize()
    assert shown["yield_to_interactive"] == {
        "priority_scheduling": None,
        "priority": 10,
        "min_in_flight": 2,
        "metrics_urls": [],
    }
