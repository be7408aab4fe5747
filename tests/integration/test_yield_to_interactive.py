"""A batch that yields to interactive users, against one real vLLM server (CPU, tiny model) run with ``--scheduling-policy priority``.

The session's warm server of these flags (``warm_vllm``), started with ``--max-num-seqs 16``
so that a queue forms on a CPU: the batch's priority reaches it (an interactive request sent while the batch's
requests wait is answered ahead of them, not behind: counted in answers the server finished meanwhile, which
a loaded CPU does not blur as it does latencies), the bound backs off under a burst
of interactive requests and grows back after it, and a batch on a connection that does not
say the server runs priority scheduling sends no priority at all (a recording proxy in
front of the same server shows every body).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from aiohttp import ClientSession, web

from airflow_vllm_batch.engines import WarmVLLMServer, YieldToInteractive, server as server_engines
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from tests.integration.vllm_metrics import requests_answered
from vllm_batch_embedded.demo import BUCKET

if TYPE_CHECKING:
    from airflow_vllm_batch.engines.vllm.server_process import VLLMServerProcess

# Alone: it compares latencies and watches the bound move with the server's queue, which another
# worker's engine start-up beside it would blur (`make test` runs it after the rest).
pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.alone]

CONN_ID = "vllm_priority"
PLAIN_CONN_ID = "vllm_priority_unsaid"
MAX_NUM_SEQS = 16


@pytest.fixture(scope="module")
def priority_server(embedded, warm_vllm) -> Iterator[VLLMServerProcess]:
    """The session's warm server run with ``--scheduling-policy priority`` (``warm_vllm``), behind connection ``vllm_priority`` (whose extra says so)."""
    server = warm_vllm("--scheduling-policy", "priority", "--max-num-seqs", str(MAX_NUM_SEQS))
    assert server.hook is not None
    host, port = server.hook.base_url.removeprefix("http://").split(":")
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(
        {
            "conn_type": "vllm",
            "host": host,
            "port": int(port),
            "password": server.hook.api_key,
            "extra": {"scheduling_policy": "priority"},
        }
    )
    try:
        yield server
    finally:
        os.environ.pop(f"AIRFLOW_CONN_{CONN_ID.upper()}", None)


class _TI:
    dag_id, task_id, map_index, try_number, max_tries = "yield", "vllm_batch", -1, 1, 0

    def __init__(self) -> None:
        self.run_id = f"yield-{time.time_ns()}"

    def xcom_push(self, key, value):
        pass


def _requests(n: int, model: str, max_tokens: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"b{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"Tell a story about {i}."}],
                    "max_completion_tokens": max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


def _run_batch(embedded, tmp_path: Path, model: str, n: int, max_tokens: int, **engine) -> dict:
    ti = _TI()
    key = f"yield/{ti.run_id}"
    embedded.client().put_object(
        Bucket=BUCKET, Key=f"{key}/input.jsonl", Body=_requests(n, model, max_tokens)
    )
    op = VLLMBatchOperator(
        task_id="vllm_batch",
        input_uri=f"s3://{BUCKET}/{key}/input.jsonl",
        output_uri=f"s3://{BUCKET}/{key}/results.jsonl",
        model=model,
        engine=WarmVLLMServer(**engine),
        results_dir=str(tmp_path / "results"),
    )
    return op.execute({"ti": ti, "outlet_events": {}})


async def _chat_latency(base_url: str, api_key: str, model: str, max_tokens: int = 4) -> float:
    """One interactive request (priority 0, as a user's): its total latency."""
    started = time.monotonic()
    async with ClientSession() as session:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": max_tokens,
            "ignore_eos": True,
        }
        async with session.post(
            f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}
        ) as response:
            assert response.status == 200, await response.text()
            await response.read()
    return time.monotonic() - started


def _waiting(base_url: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(v) for v in re.findall(r"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", text, re.MULTILINE)
    )


def _interactive_request_beside(
    embedded, tmp_path, server: VLLMServerProcess, model: str, *, priority: bool
) -> dict[str, float]:
    """One interactive request sent while a batch of fixed bound 96 keeps ~80 requests waiting.

    Returns the waiting the server reported just before it was sent, its latency, and ``overtaken``:
    how many other requests the server finished between its send and its answer.
    """
    result: dict = {}

    def batch() -> None:
        result["manifest"] = _run_batch(
            embedded,
            tmp_path,
            model,
            400,
            24,
            conn_id=CONN_ID,
            max_in_flight=96,
            # floor = maximum: the bound cannot move, so only the priority differs between the two runs.
            yield_to_interactive=YieldToInteractive(min_in_flight=96, priority_scheduling=priority),
        )

    thread = threading.Thread(target=batch)
    thread.start()
    assert server.hook is not None
    base_url = server.hook.base_url
    deadline = time.monotonic() + 120
    while (waiting := _waiting(base_url)) < 40:
        assert time.monotonic() < deadline, "the batch never filled the server's queue"
        assert thread.is_alive(), "the batch never filled the server's queue"
        time.sleep(0.1)
    answered_before = requests_answered(base_url)
    latency = asyncio.run(_chat_latency(base_url, server.hook.api_key or "", model))
    # The interactive request itself is one of the answers counted since.
    overtaken = requests_answered(base_url) - answered_before - 1
    thread.join()
    assert result["manifest"]["request_counts"]["completed"] == 400
    return {"waiting": waiting, "latency_s": latency, "overtaken": overtaken}


def test_the_batchs_priority_reaches_the_server_an_interactive_request_is_served_ahead_of_its_waiting_requests(
    embedded, priority_server, tiny_model, tmp_path
):
    model = str(tiny_model)
    with_priority = _interactive_request_beside(embedded, tmp_path, priority_server, model, priority=True)
    without = _interactive_request_beside(embedded, tmp_path, priority_server, model, priority=False)
    # Without the batch's priority (first come, first served) the interactive request is scheduled only once
    # the >= 40 batch requests waiting ahead of it have been, each in a slot another request's answer freed:
    # the server answers at least that many before it. With it, the request takes the first free slot, so
    # at most the 16 running ones finish before it starts and at most 16 more while it decodes its 4 tokens.
    # Counted, not timed: its latency (reported) is mostly HTTP and tokenising on a loaded CPU, where two
    # runs' latencies differed by as little as 0.21 s against 0.30 s.
    assert with_priority["overtaken"] <= 2 * MAX_NUM_SEQS < without["overtaken"], (with_priority, without)
    assert without["overtaken"] >= without["waiting"] - MAX_NUM_SEQS, (with_priority, without)


def test_the_bound_backs_off_under_an_interactive_burst_and_grows_back_after_it(
    embedded, priority_server, tiny_model, tmp_path, monkeypatch, capfd
):
    monkeypatch.setattr(server_engines, "PROGRESS_EVERY_S", 0.5)
    assert priority_server.hook is not None
    base_url, key, model = priority_server.hook.base_url, priority_server.hook.api_key or "", str(tiny_model)
    burst: dict[str, float] = {}

    def interactive_burst() -> None:
        time.sleep(3)  # the batch is under way (alone on this CPU it answers ~150 requests a second)
        burst["from"] = time.monotonic()

        async def users() -> None:
            end = time.monotonic() + 8
            while time.monotonic() < end:
                await asyncio.gather(*(_chat_latency(base_url, key, model, max_tokens=24) for _ in range(12)))

        asyncio.run(users())
        burst["to"] = time.monotonic()

    thread = threading.Thread(target=interactive_burst)
    thread.start()
    started = time.monotonic()
    manifest = _run_batch(
        embedded,
        tmp_path,
        model,
        3000,  # outlasts the burst with time to grow back, on an idle machine or a busy one
        24,
        conn_id=CONN_ID,
        max_in_flight=64,
        yield_to_interactive=YieldToInteractive(min_in_flight=2),
    )
    ended = time.monotonic()
    thread.join()
    assert manifest["request_counts"]["completed"] == 3000
    assert burst["to"] < ended, "the batch ended before the burst did: give it more requests"
    out = capfd.readouterr().out
    assert "requests carry priority 10 (the connection's scheduling_policy extra is 'priority')" in out
    bounds = [
        (int(m.group(1)), line)
        for line in out.splitlines()
        if (m := re.search(r"in flight \(bound (\d+):", line))
    ]
    assert bounds, out[-3000:]
    # The progress lines are in time order; the burst is the middle third or so of the run.
    lowest = min(b for b, _ in bounds)
    assert lowest <= 16, bounds
    assert any("requests waiting with" in line for _, line in bounds), [line for _, line in bounds][:20]
    assert bounds[-1][0] == 64 or any(b == 64 for b, _ in bounds[bounds.index(min(bounds)) :]), bounds
    del started


class _RecordingProxy:
    """A pass-through proxy in front of the real server that keeps every request body it forwards."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        data = await request.read()
        if request.method == "POST":
            self.bodies.append(json.loads(data))
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        async with self.session.request(
            request.method, self.upstream + request.path_qs, data=data or None, headers=headers
        ) as upstream:
            return web.Response(
                status=upstream.status, body=await upstream.read(), content_type=upstream.content_type
            )

    async def _start(self) -> int:
        self.session = ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def __enter__(self) -> _RecordingProxy:
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        async def stop() -> None:
            await self.session.close()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_server_not_known_to_run_priority_scheduling_is_never_sent_a_priority(
    embedded, priority_server, tiny_model, tmp_path, capfd
):
    assert priority_server.hook is not None
    with _RecordingProxy(priority_server.hook.base_url) as proxy:
        os.environ[f"AIRFLOW_CONN_{PLAIN_CONN_ID.upper()}"] = json.dumps(
            {
                "conn_type": "vllm",
                "host": "127.0.0.1",
                "port": proxy.port,
                "password": priority_server.hook.api_key,
            }
        )
        try:
            manifest = _run_batch(
                embedded, tmp_path, str(tiny_model), 50, 4, conn_id=PLAIN_CONN_ID, yield_to_interactive=True
            )
        finally:
            os.environ.pop(f"AIRFLOW_CONN_{PLAIN_CONN_ID.upper()}", None)
    assert manifest["request_counts"]["completed"] == 50
    sent = [body for body in proxy.bodies if "messages" in body]
    assert len(sent) == 50
    assert not any("priority" in body for body in sent)
    assert "the server does not say its scheduling policy" in capfd.readouterr().out
