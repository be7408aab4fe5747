from __future__ import annotations

from pathlib import Path

import pytest

#: The OpenAI batch-format examples (requests and results in both of vLLM's shapes), kept
#: in the repository so that the tests need nothing outside the clone.
SEED_DIR = Path(__file__).resolve().parents[2] / "data" / "seed-examples"


@pytest.fixture
def seed_dir() -> Path:
    return SEED_DIR
