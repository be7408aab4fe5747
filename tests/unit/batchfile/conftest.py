from __future__ import annotations

from pathlib import Path

import pytest

# tests/unit/batchfile/conftest.py -> parents[3] is the repo; the examples sit next to it.
SEED_DIR = Path(__file__).resolve().parents[3] / ".." / "shared" / "seed-examples"


@pytest.fixture
def seed_dir() -> Path:
    if not SEED_DIR.is_dir():
        pytest.skip(f"seed examples not found at {SEED_DIR}")
    return SEED_DIR
