"""The mutation campaign: does the fault simulator (and, separately, do the unit tests) catch each single bug?

Each mutant of ``tests/simulation/mutation.py`` (an exact snippet of a protocol module and
its replacement) is applied to a temporary copy of the package, never to the worktree, and
the simulator runs on that copy in a subprocess, seed 0 upward, until a schedule violates
an invariant or ``--schedules`` ran clean. Prints, per mutant, which check caught it and
after how many schedules (or that it survived), the equivalent mutants with the argument
why no schedule can tell them from the real code, and the score over the others. With
``--unit`` the module's unit tests run against each mutant too. Exits non-zero when a
snippet is not found (the module changed: re-anchor the mutant) or the real code itself
violates an invariant.

A hand-written catalogue rather than mutmut or cosmic-ray: those generate operator
mutants (``<`` to ``<=``, a constant changed) by the thousand, most of them equivalent or
caught by any test, and none of them drops an ``If-Match``, skips a fence or moves a
publishing step, which are the bugs this protocol is about; nor do they run a mutant in a
copy of the package while other sessions edit the tree.

Usage::

    .venv/bin/python benchmarks/mutate.py [--schedules 2000] [--jobs 2] [--unit] [--only NAME ...]
    .venv/bin/python benchmarks/mutate.py --list
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.simulation.mutation import (
    MUTANTS,
    MutantNotAnchored,
    by_name,
    mutated_tree,
    replay,
    run_simulator,
    run_unit_tests,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--schedules",
        type=int,
        default=2000,
        help="schedules per mutant at most (it stops at the first violation)",
    )
    parser.add_argument("--start", type=int, default=0, help="the first seed")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--unit", action="store_true", help="also run each mutant's module's unit tests")
    parser.add_argument("--no-simulator", action="store_true", help="with --unit: the unit tests only")
    parser.add_argument("--only", nargs="*", help="these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="with one --only mutant: replay this seed on it (benchmarks/simulate.py --seed)",
    )
    parser.add_argument("--trace", action="store_true", help="with --seed: print every S3 call attempt too")
    args = parser.parse_args()
    mutants = by_name(args.only)
    if args.seed is not None:
        if len(mutants) != 1:
            raise SystemExit("--seed replays one mutant: name it with --only")
        print(replay(mutants[0], args.seed, args.trace))
        return 0
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:<36} {m.module:<26} {m.what}" + (" [equivalent]" if m.equivalent else ""))
        return 0
    import tempfile

    for m in mutants:  # every snippet anchors, before anything runs
        with tempfile.TemporaryDirectory() as tmp:
            try:
                mutated_tree(m, Path(tmp))
            except MutantNotAnchored as err:
                print(err, file=sys.stderr)
                return 2
    started = time.perf_counter()
    if args.no_simulator:
        args.schedules = 0
    baseline = run_simulator(None, args.schedules, args.start)
    print(
        f"real code: {baseline['schedules']} schedules, "
        + (
            f"VIOLATION {baseline['checks']} at seed {baseline.get('seed')}"
            if baseline["caught"]
            else "clean"
        )
    )

    def one(m):
        sim = (
            run_simulator(m, args.schedules, args.start)
            if args.schedules
            else {"caught": False, "schedules": 0}
        )
        unit = run_unit_tests(m) if args.unit else None
        # As it comes (the table below sums up): a long campaign shows where it is.
        print(
            f"  {m.name}: "
            + (
                f"caught by {', '.join(sim['checks'])} after {sim['schedules']}"
                if sim["caught"]
                else "survived"
            )
            + ("" if unit is None else f"; unit tests {'caught' if unit['caught'] else 'survived'}"),
            flush=True,
        )
        return m, sim, unit

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(one, mutants))
    scored = [(m, s, u) for m, s, u in results if not m.equivalent]
    print(f"\n{'mutant':<36} {'module':<26} simulator{'':<40} unit tests")
    for m, sim, unit in results:
        if sim["caught"]:
            verdict = f"caught by {', '.join(sim['checks'])} after {sim['schedules']} schedule(s) (seed {sim.get('seed')})"
        else:
            verdict = f"SURVIVED {sim['schedules']} schedules"
        if m.equivalent:
            verdict = "equivalent; " + verdict
        u = (
            ""
            if unit is None
            else (
                "caught: " + (unit["failed"][0] if unit["failed"] else "failed")
                if unit["caught"]
                else "SURVIVED"
            )
        )
        print(f"{m.name:<36} {m.module:<26} {verdict:<50} {u}")
    caught = sum(s["caught"] for _, s, _ in scored)
    print(
        f"\nsimulator: {caught} of {len(scored)} non-equivalent mutants caught ({100 * caught / max(len(scored), 1):.0f}%), "
        f"at most {args.schedules} schedules each"
    )
    if args.unit:
        ucaught = sum(u["caught"] for _, _, u in scored)
        print(f"unit tests: {ucaught} of {len(scored)} caught ({100 * ucaught / max(len(scored), 1):.0f}%)")
    survivors = [m for m, s, _ in scored if not s["caught"]]
    if survivors:
        print("survivors: " + ", ".join(m.name for m in survivors))
    for m, _, _ in results:
        if m.equivalent:
            print(f"equivalent: {m.name}: {m.equivalent}")
    print(f"campaign took {time.perf_counter() - started:.0f}s")
    return 1 if baseline["caught"] else 0


if __name__ == "__main__":
    sys.exit(main())
