"""The fault simulator with a warm server shared with interactive users (``yield_to_interactive``): every invariant, every seed."""

from __future__ import annotations

import os

from tests.simulation.campaign import assert_no_schedule_fails
from tests.simulation.invariants import check_all
from tests.simulation.yielding import SimSharedServer, SimYieldingEngine, run_yielding_schedule

#: Schedules per suite run (``VLLM_BATCH_SIM_YIELDING_SCHEDULES`` overrides).
SCHEDULES = int(os.environ.get("VLLM_BATCH_SIM_YIELDING_SCHEDULES", "200"))


def test_no_yielding_schedule_violates_a_run_protocol_invariant(tmp_path, sim_seed):
    seeds = [sim_seed] if sim_seed is not None else range(SCHEDULES)
    assert_no_schedule_fails(
        seeds,
        lambda seed: check_all(run_yielding_schedule(seed, tmp_path / "schedule")),
        lambda seed: f"VLLM_BATCH_SIM_SEED={seed} python -m pytest -q {__file__}",
    )


def test_the_yielding_schedules_cover_a_queue_that_fills_and_drains_and_every_policy(tmp_path, monkeypatch):
    seen: list[SimSharedServer] = []
    real = SimYieldingEngine.server.fget

    def kept(engine):
        server = real(engine)
        if server not in seen:
            seen.append(server)
        return server

    monkeypatch.setattr(SimYieldingEngine, "server", property(kept))
    for seed in range(40):
        run_yielding_schedule(seed, tmp_path / "schedule")
    assert {s.warm_hook.said for s in seen} == {"priority", "fcfs", None}
    moved = [s.bounds for s in seen if len(set(s.bounds)) > 1]
    assert moved, "no schedule moved the bound"
    assert any(
        min(b) < max(b) and b.index(min(b)) < len(b) - 1 and max(b[b.index(min(b)) :]) > min(b) for b in moved
    ), "no schedule lowered the bound and grew it back"
