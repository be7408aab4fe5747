"""A stand-in for a vLLM server: a small aiohttp app on a loopback port, in a thread of its own.

Each test sets ``stand_in.behaviour`` (an async function of the custom_id, the request
body and the attempt number) to the answers it needs; the stand-in counts what it saw.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator

import pytest
from aiohttp import web

API_KEY = "test-key-do-not-log"

Behaviour = Callable[[str, dict, int], Awaitable[web.Response]]


def chat_completion(custom_id: str, completion_tokens: int = 3) -> dict:
    """A minimal chat completion, as vLLM answers one."""
    return {
        "id": f"chatcmpl-{custom_id}",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}
        ],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": completion_tokens,
            "total_tokens": 5 + completion_tokens,
        },
    }


async def answer_ok(custom_id: str, body: dict, attempt: int) -> web.Response:
    """Answer every request with a chat completion."""
    return web.json_response(chat_completion(custom_id))


class StandIn:
    """The server; ``base_url``, what it saw, and ``stop()`` to make it vanish mid-run."""

    def __init__(self) -> None:
        self.behaviour: Behaviour = answer_ok
        self.in_flight = 0
        self.max_in_flight = 0
        self.attempts: collections.Counter[str] = collections.Counter()
        self.auth_headers: set[str | None] = set()
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        custom_id = body["messages"][0]["content"]
        self.auth_headers.add(request.headers.get("Authorization"))
        self.attempts[custom_id] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.behaviour(custom_id, body, self.attempts[custom_id])
        finally:
            self.in_flight -= 1

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def start(self) -> StandIn:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def stop(self) -> None:
        """Close the listening socket and every connection, as a dead server would."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(10)

    def stop_soon(self) -> None:
        """Stop from inside a handler (on the stand-in's loop) without waiting for it."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            self.loop.create_task(runner.cleanup())

    def close(self) -> None:
        self.stop()
        asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


async def _cancel_the_rest() -> None:
    """Cancel handlers still waiting (held or stuck on purpose), so none is destroyed pending."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    server = StandIn().start()
    yield server
    server.close()


def request_lines(n: int, start: int = 0) -> list[tuple[int, bytes]]:
    """``n`` chat request lines; each message's content is its custom_id, for the stand-in."""
    return [
        (
            i + 1,
            json.dumps(
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": "m", "messages": [{"role": "user", "content": f"r{i}"}]},
                }
            ).encode(),
        )
        for i in range(start, start + n)
    ]
