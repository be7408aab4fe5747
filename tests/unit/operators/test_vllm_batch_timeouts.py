"""Bounded: the operator's request_timeout ends a try on a wedged server within it, not 7 x 30 min."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
from aiohttp import web

from airflow_vllm_batch.serving import ServerUnavailableError
from tests.unit.serving.conftest import chat_completion

pytestmark = pytest.mark.usefixtures("quick_retries")


def test_a_wedged_warm_server_ends_the_try_within_request_timeout_as_retryable(batch, server):
    answered = 0

    async def answers_five_then_wedges(custom_id, body, attempt):
        nonlocal answered
        if answered >= 5:
            await asyncio.sleep(60)  # never answers; cancelled when the stand-in closes
        answered += 1
        return web.json_response(chat_completion(custom_id))

    server.behaviour = answers_five_then_wedges
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=r"answered no request for 1s .*wedged.*resumes") as err:
        batch.run(max_in_flight=2, request_timeout=timedelta(seconds=1))
    assert err.value.retryable
    assert (
        time.monotonic() - started < 1 + 10
    )  # one request_timeout, plus the run's own S3 work on a loaded machine
    answered_in_parts = [r["custom_id"] for k in batch.parts() for r in batch.lines(k)]
    assert len(answered_in_parts) == 5  # what it answered before it wedged is checkpointed for the retry
