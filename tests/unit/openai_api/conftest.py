"""The OpenAI API's unit tests run with a signing key and a files URI, as a deployment has them."""

from __future__ import annotations

import pytest

#: The signing key of the unit tests (what ``[vllm_batch] openai_signing_key`` holds in a deployment).
KEY = "k" * 40
FILES_URI = "s3://b/p/"


@pytest.fixture(autouse=True)
def signing_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY", KEY)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_FILES_URI", FILES_URI)
    return KEY
