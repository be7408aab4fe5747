from __future__ import annotations

import json

from airflow_vllm_batch.batchfile.per_model import count_per_model


def result(custom_id: str, model: str | None, prompt: int, completion: int) -> bytes:
    body = {
        "object": "chat.completion",
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    if model is not None:
        body["model"] = model
    return json.dumps(
        {
            "id": "x",
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": "r", "body": body},
            "error": None,
        }
    ).encode()


def test_requests_and_tokens_land_on_the_name_vllm_reports():
    successes = [result("a", "llama", 3, 2), result("b", "sql", 4, 1), result("c", "llama", 5, 5), b"\n"]
    stats = count_per_model(
        successes,
        {"llama": 1, "chat": 1, "sql": 2},
        default_name="llama",
        aliases={"llama": "llama", "chat": "llama"},
    )
    assert stats == {
        "llama": {
            "requests": 2,
            "completed": 2,
            "failed": 0,
            "prompt_tokens": 8,
            "completion_tokens": 7,
            "total_tokens": 15,
        },
        "sql": {
            "requests": 2,
            "completed": 1,
            "failed": 1,
            "prompt_tokens": 4,
            "completion_tokens": 1,
            "total_tokens": 5,
        },
    }


def test_a_response_without_model_counts_for_the_base_model():
    stats = count_per_model([result("a", None, 1, 1)], {"m": 1}, default_name="m")
    assert stats["m"]["completed"] == 1
    assert stats["m"]["failed"] == 0
