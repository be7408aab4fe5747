"""The stream yielding to a server's other users, against a stand-in whose queue fills with others' requests and drains.

The stand-in's ``/metrics`` reports what a vLLM server with ``slots`` running places would:
the batch's requests in flight plus ``others`` (interactive users), running up to ``slots``
and waiting beyond.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest
from aiohttp import web

from airflow_vllm_batch.serving import Journal, StreamStats, run_stream
from airflow_vllm_batch.serving.neighbour import NeighbourPlan
from tests.unit.serving.conftest import API_KEY, StandIn, chat_completion, request_lines


class SharedServer(StandIn):
    """A stand-in with ``/metrics``: ``others`` requests of other users beside the batch's, ``slots`` running at once."""

    def __init__(self, slots: int = 8) -> None:
        super().__init__()
        self.slots = slots
        self.others = 0
        self.metrics_status = 200
        self.priorities: list[object] = []
        self.metrics_auth: set[str | None] = set()

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_auth.add(request.headers.get("Authorization"))
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status, text="Not Found")
        total = self.in_flight + self.others
        running, waiting = min(total, self.slots), max(0, total - self.slots)
        return web.Response(
            text=f'vllm:num_requests_running{{engine="0"}} {running}.0\nvllm:num_requests_waiting{{engine="0"}} {waiting}.0\n'
        )

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.priorities.append(body.get("priority", "absent"))
        return await super()._handle(request)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()


@pytest.fixture
def shared() -> Iterator[SharedServer]:
    server = SharedServer().start()
    yield server
    server.close()


async def _slow(custom_id, body, attempt):
    await asyncio.sleep(0.01)
    return web.json_response(chat_completion(custom_id))


def _run(
    server: SharedServer, tmp_path, n: int, plan: NeighbourPlan, **kwargs
) -> tuple[StreamStats, list[dict], list[StreamStats]]:
    journal = Journal(tmp_path / "journal")
    seen: list[StreamStats] = []
    stats = run_stream(
        request_lines(n),
        base_url=server.base_url,
        api_key=API_KEY,
        journal=journal,
        neighbour=plan,
        on_progress=seen.append,
        progress_every_s=0.02,
        backoff_s=0.01,
        **kwargs,
    )
    lines = [json.loads(line) for part in journal.parts for line in part.path.read_bytes().splitlines()]
    return stats, lines, seen


def test_a_server_busy_with_others_gets_only_the_floor_and_the_batch_still_finishes(shared, tmp_path):
    shared.behaviour = _slow
    shared.others = 20  # a queue that never drains
    plan = NeighbourPlan(priority=None, min_in_flight=2, check_every_s=0.02)
    stats, lines, _seen = _run(shared, tmp_path, 60, plan, max_in_flight=32)
    assert sorted(line["custom_id"] for line in lines) == sorted(f"r{i}" for i in range(60))
    assert shared.max_in_flight <= 2
    assert stats.bound == 2


def test_the_bound_backs_off_while_others_queue_and_grows_back_once_they_are_gone(shared, tmp_path):
    shared.behaviour = _slow
    shared.others = 0
    plan = NeighbourPlan(priority=None, min_in_flight=2, check_every_s=0.02)
    timeline: list[tuple[str, int]] = []
    at_floor = threading.Event()

    def burst() -> None:
        time.sleep(0.3)
        shared.others = 12  # a burst of interactive requests: the server's queue fills
        # It lasts until the bound has come down to the floor (not a fixed time, which a loaded
        # machine's slower checks would not fill), then drains.
        at_floor.wait(timeout=60)
        shared.others = 0

    def progress(stats: StreamStats) -> None:
        timeline.append((phase(), stats.bound or 0))
        if timeline[-1] == ("burst", 2):
            at_floor.set()

    thread = threading.Thread(target=burst)
    thread.start()
    journal = Journal(tmp_path / "journal")
    phase = lambda: "burst" if shared.others else "calm"
    stats = run_stream(
        request_lines(3000),
        base_url=shared.base_url,
        api_key=API_KEY,
        journal=journal,
        max_in_flight=32,
        neighbour=plan,
        on_progress=progress,
        progress_every_s=0.02,
    )
    thread.join()
    burst_bounds = [b for p, b in timeline if p == "burst"]
    assert burst_bounds, timeline
    assert min(burst_bounds) == 2, timeline
    assert stats.bound == 32, timeline
    assert stats.bound_lowered >= 1, timeline
    assert stats.bound_raised >= 1, timeline
    assert (
        "requests waiting with" in stats.bound_last_move or "no requests of others" in stats.bound_last_move
    )
    assert stats.done == 3000


def test_the_priority_reaches_the_server_in_every_body(shared, tmp_path):
    plan = NeighbourPlan(priority=10, check_every_s=0.02)
    _run(shared, tmp_path, 20, plan, max_in_flight=8)
    assert shared.priorities == [10] * 20


def test_a_server_not_known_to_take_a_priority_gets_none(shared, tmp_path):
    plan = NeighbourPlan(priority=None, check_every_s=0.02)
    _run(shared, tmp_path, 20, plan, max_in_flight=8)
    assert shared.priorities == ["absent"] * 20


def test_without_metrics_the_batch_starts_at_the_floor_and_still_finishes(shared, tmp_path):
    shared.behaviour = _slow
    shared.metrics_status = 404
    plan = NeighbourPlan(priority=None, min_in_flight=3, check_every_s=0.02)
    stats, lines, seen = _run(shared, tmp_path, 200, plan, max_in_flight=16)
    assert len(lines) == 200
    assert seen[0].bound == 3
    assert stats.bound > 3  # grown a step per check without a 429/503


def test_429s_lower_the_bound(shared, tmp_path):
    answered = set()

    async def full_at_first(custom_id, body, attempt):
        await asyncio.sleep(0.01)
        if attempt == 1 and len(answered) < 40:
            return web.json_response({"error": "busy"}, status=429)
        answered.add(custom_id)
        return web.json_response(chat_completion(custom_id))

    shared.behaviour = full_at_first
    plan = NeighbourPlan(priority=None, min_in_flight=1, check_every_s=0.02)
    _stats, lines, seen = _run(shared, tmp_path, 400, plan, max_in_flight=16)
    assert len({line["custom_id"] for line in lines}) == 400
    assert any("answers 429/503" in s.bound_last_move for s in seen), [s.bound_last_move for s in seen][:10]


def test_the_api_key_goes_to_the_servers_own_metrics_but_not_to_another_url(shared, tmp_path):
    other = SharedServer().start()
    try:
        plan = NeighbourPlan(
            priority=None,
            check_every_s=0.02,
            metrics_urls=(other.base_url + "/metrics", shared.base_url + "/metrics"),
        )
        _run(shared, tmp_path, 5, plan, max_in_flight=4)
        assert other.metrics_auth == {None}
        assert shared.metrics_auth == {f"Bearer {API_KEY}"}
    finally:
        other.close()
