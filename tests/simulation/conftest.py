"""``--sim-seed N`` (or ``VLLM_BATCH_SIM_SEED=N``) replays one schedule of the fault simulator."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--sim-seed", type=int, default=None, help="replay only this seed of the fault simulator"
    )


@pytest.fixture
def sim_seed(request: pytest.FixtureRequest) -> int | None:
    """The one seed to replay, if one was asked for."""
    seed = request.config.getoption("--sim-seed", default=None)
    if seed is None and os.environ.get("VLLM_BATCH_SIM_SEED"):
        seed = int(os.environ["VLLM_BATCH_SIM_SEED"])
    return seed
