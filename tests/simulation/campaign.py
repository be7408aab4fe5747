"""Many schedules in a row: what ran, what was injected, which invariants failed and for which seeds."""

from __future__ import annotations

import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.simulation.invariants import INVARIANTS, Violation, check_all
from tests.simulation.world import run_schedule

#: How a failing schedule is replayed, exactly.
REPLAY = "VLLM_BATCH_SIM_SEED={seed} python -m pytest -q tests/simulation  (or: python benchmarks/simulate.py --seed {seed})"


@dataclass
class CampaignReport:
    schedules: int = 0
    seconds: float = 0.0
    faults: Counter = field(default_factory=Counter)
    #: check name -> seeds that violated it, in order.
    violations: dict[str, list[int]] = field(default_factory=dict)
    details: dict[int, list[Violation]] = field(default_factory=dict)
    crashes: dict[int, str] = field(default_factory=dict)
    #: ``(site, fault kind) -> faults injected there`` (S3 faults, kills, zombies, pauses; see world.SITES).
    coverage: Counter = field(default_factory=Counter)
    #: Schedules whose last try met no fault (the ones the Liveness check applies to).
    clean_last_tries: int = 0

    @property
    def failing_seeds(self) -> list[int]:
        return sorted(set(self.details) | set(self.crashes))

    def by_invariant(self) -> dict[str, int]:
        counts = dict.fromkeys(INVARIANTS, 0)
        for found in self.details.values():
            for invariant in {v.invariant for v in found}:
                counts[invariant] += 1
        return counts

    def coverage_table(self) -> str:
        """The (site x fault kind) counts, one row per site; ``-`` where the kind does not exist at the site, ``0`` where it was never reached."""
        from tests.simulation.world import SITES, site_kinds

        kinds = (
            "error",
            "lost_response",
            "slow",
            "outage",
            "conflict",
            "partial",
            "kill",
            "zombie",
            "pause",
            "freeze",
        )
        short = {"lost_response": "lost"}
        lines = [f"{'site':<26}" + "".join(f"{short.get(k, k):>9}" for k in kinds)]
        for site in SITES:
            cells = [f"{self.coverage.get((site, k), 0) if k in site_kinds(site) else '-':>9}" for k in kinds]
            lines.append(f"{site:<26}" + "".join(cells))
        pairs = [(site, k) for site in SITES for k in site_kinds(site)]
        reached = sum(1 for p in pairs if self.coverage.get(p))
        lines.append(f"(site, fault kind) pairs reached: {reached} of {len(pairs)}")
        missing = [f"{s}/{k}" for s, k in pairs if not self.coverage.get((s, k))]
        if missing:
            lines.append("not reached: " + ", ".join(missing))
        return "\n".join(lines)

    def format(self, first: int = 5) -> str:
        lines = [
            f"schedules run: {self.schedules} in {self.seconds:.1f}s ({self.schedules / max(self.seconds, 1e-9):.0f}/s)"
        ]
        lines.append(
            "faults injected by kind: "
            + (", ".join(f"{k} {n}" for k, n in sorted(self.faults.items())) or "none")
        )
        lines.append(f"schedules whose last try met no fault (Liveness applies): {self.clean_last_tries}")
        lines.append(
            "schedules violating each invariant: "
            + ", ".join(f"{k} {n}" for k, n in self.by_invariant().items())
        )
        for check, seeds in sorted(self.violations.items()):
            lines.append(f"  {check}: {len(seeds)} schedule(s), first seeds {seeds[:first]}")
        for seed in self.failing_seeds[:first]:
            lines.append(
                f"seed {seed}: " + "; ".join(f"{v.check}: {v.detail}" for v in self.details.get(seed, []))
            )
            if seed in self.crashes:
                lines.append(f"seed {seed}: the simulator itself failed: {self.crashes[seed]}")
            lines.append("  replay: " + REPLAY.format(seed=seed))
        return "\n".join(lines)


def run_campaign(seeds: Iterable[int], workdir: Path) -> CampaignReport:
    """Run the schedule of every seed and check the invariants after each."""
    report = CampaignReport()
    started = time.perf_counter()
    for seed in seeds:
        report.schedules += 1
        try:
            world = run_schedule(seed, workdir / "schedule")
            found = check_all(world)
            if world.s3.unsupported:
                report.crashes[seed] = (
                    f"the run code called S3 methods the fake does not model: {sorted(world.s3.unsupported)}"
                )
        except Exception:  # noqa: BLE001 - a simulator failure is reported with its seed, not hidden
            report.crashes[seed] = traceback.format_exc(limit=-3)
            continue
        report.faults.update({f"s3 {kind}": n for kind, n in world.faults.injected.items()})
        report.faults.update({f"engine {kind}": n for kind, n in world.engine_events.items() if kind != "ok"})
        report.faults["try killed"] += world.kills
        report.faults["zombie try"] += world.zombies
        report.faults["input rewritten"] += world.input_version - 1
        report.faults["second task instance"] += any(t.run == "run-2" for t in world.tries)
        report.faults["cache expired"] += world.cache_expiries
        report.faults["aimed target (world.aim)"] += world.plan.aimed
        report.coverage.update(world.s3.coverage)
        last = world.final_try
        report.clean_last_tries += bool(
            last is not None
            and not last.dead
            and not last.faults
            and world.input_version == 1
            and not world.plan.second_run_at
            and not world.plan.collision
        )
        if found:
            report.details[seed] = found
            for check in dict.fromkeys(v.check for v in found):
                report.violations.setdefault(check, []).append(seed)
    report.seconds = time.perf_counter() - started
    return report


def assert_no_schedule_fails(
    seeds: Iterable[int], schedule: Callable[[int], Sequence[Violation]], replay: Callable[[int], str]
) -> None:
    """Run ``schedule`` on every seed; fail naming each failing seed (its violations, or its exception) and its replay.

    :param schedule: runs one seed's schedule and returns its invariants' violations.
    :param replay: the command that replays a seed.
    """
    seeds = list(seeds)
    failing: dict[int, str] = {}
    for seed in seeds:
        try:
            found = schedule(seed)
        except Exception:  # noqa: BLE001 - reported with its seed
            failing[seed] = traceback.format_exc(limit=-3)
            continue
        if found:
            failing[seed] = "; ".join(f"{v.check}: {v.detail}" for v in found)
    report = "\n".join(f"seed {s}: {d}\n  replay: {replay(s)}" for s, d in sorted(failing.items())[:10])
    assert not failing, f"{len(failing)} of {len(seeds)} schedules failed\n{report}"
