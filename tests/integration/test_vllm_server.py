"""A real vLLM server (CPU, tiny model) started by the task's code, and a batch streamed through it.

The session's warm server of the plain CPU flags (``warm_vllm``, shared with the other modules
that ask for those flags); each test sends its own requests and counts what the server answered
by the difference of its ``/metrics`` before and after.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from openai.types.chat import ChatCompletion

from airflow_vllm_batch.hooks.vllm import VLLMServerHook
from airflow_vllm_batch.serving import (
    Journal,
    ModelNotServedError,
    ServerAuthError,
    run_stream,
)
from tests.integration.vllm_metrics import requests_answered

if TYPE_CHECKING:
    from airflow_vllm_batch.engines.vllm.server_process import VLLMServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.engine]


@pytest.fixture(scope="module")
def server(warm_vllm) -> VLLMServerProcess:
    """The session's warm server of the plain CPU flags (conftest ``warm_vllm``)."""
    return warm_vllm()


def _lines(model: str, n: int, prefix: str = "chat") -> Iterator[tuple[int, bytes]]:
    for i in range(n):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Count to {i}"}],
            "max_completion_tokens": 4,
        }
        line = {"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        yield i + 1, json.dumps(line).encode()


def _results(journal: Journal) -> list[dict]:
    return [json.loads(line) for part in journal.parts for line in part.path.read_bytes().splitlines()]


def test_200_chat_requests_are_answered_once_each_with_openai_chat_completions(server, tiny_model, tmp_path):
    before = requests_answered(server.hook.base_url)
    journal = Journal(tmp_path / "journal", max_part_bytes=64 * 1024)
    stats = run_stream(
        _lines(str(tiny_model), 200),
        base_url=server.hook.base_url,
        api_key=server.hook.api_key,
        journal=journal,
        max_in_flight=64,
    )
    results = _results(journal)
    assert sorted(r["custom_id"] for r in results) == sorted(f"chat-{i}" for i in range(200))
    for result in results:
        assert result["error"] is None
        assert result["response"]["status_code"] == 200
        ChatCompletion.model_validate(result["response"]["body"])
    assert (stats.done, stats.failed, stats.durable) == (200, 0, 200)
    assert stats.completion_tokens == sum(
        r["response"]["body"]["usage"]["completion_tokens"] for r in results
    )
    assert len(journal.parts) > 1
    assert requests_answered(server.hook.base_url) - before == 200


def test_a_request_for_another_model_gets_vllms_error_line(server, tmp_path):
    journal = Journal(tmp_path)
    run_stream(_lines("nope", 1), base_url=server.hook.base_url, api_key=server.hook.api_key, journal=journal)
    (result,) = _results(journal)
    assert result["response"] == {
        "status_code": 404,
        "request_id": result["response"]["request_id"],
        "body": None,
    }
    assert result["error"]["error"]["type"] == "NotFoundError"
    assert result["error"]["error"]["code"] == 404


def test_a_wrong_api_key_is_a_clear_error(server, tiny_model, tmp_path):
    with pytest.raises(ServerAuthError, match="refused the API key"):
        run_stream(
            _lines(str(tiny_model), 3),
            base_url=server.hook.base_url,
            api_key="wrong-key",
            journal=Journal(tmp_path),
        )
    with pytest.raises(ServerAuthError, match="refused the API key"):
        VLLMServerHook(base_url=server.hook.base_url, api_key="wrong-key").served_models()


def test_check_serves_names_the_served_model(server, tiny_model):
    server.hook.check_serves(str(tiny_model))
    with pytest.raises(ModelNotServedError, match=re.escape(f"it serves {str(tiny_model)!r}")):
        server.hook.check_serves("nope")
