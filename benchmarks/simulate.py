"""The run protocol's fault simulator at scale: N seeded schedules, every invariant checked after each.

Prints the schedules run, the faults injected by kind (S3 errors, lost responses, slow
calls and outages; engine deaths, crashes, stalls, duplicate and failed answers; tries
killed, zombie tries, inputs rewritten), and the schedules that violated each invariant
with the first few seeds and how to replay one. Exits non-zero on any violation.

The simulator itself (tests/simulation/) drives the real run code on an in-memory S3
and engine stand-ins; see docs/reliability.md ("The fault simulator") and docs/protocol.md.

Usage::

    .venv/bin/python benchmarks/simulate.py [--schedules 20000] [--start 0] [--jobs 2]
    .venv/bin/python benchmarks/simulate.py --seed 1234        # replay one schedule, with its plan and violations
    .venv/bin/python benchmarks/simulate.py --seed 1234 --trace  # ... and every S3 call attempt and log line first
    .venv/bin/python benchmarks/simulate.py --shards [--schedules 5000] [--seed N [--trace]]  # split -> shards -> merge
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tests.conftest  # noqa: F401 - the throw-away AIRFLOW_HOME, before Airflow is imported


def _run(seeds: list[int]):
    from tests.simulation.campaign import run_campaign

    with tempfile.TemporaryDirectory(prefix="vllm-batch-sim-") as workdir:
        return run_campaign(seeds, Path(workdir))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=20000)
    parser.add_argument("--start", type=int, default=0, help="the first seed")
    parser.add_argument("--jobs", type=int, default=1, help="processes (each runs a share of the seeds)")
    parser.add_argument("--seed", type=int, default=None, help="replay this one seed and print its details")
    parser.add_argument("--first", type=int, default=5, help="failing seeds to list per check")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="with --seed: print every S3 call attempt (who, conditions, fault, outcome), engine answer and log line",
    )
    parser.add_argument(
        "--coverage", action="store_true", help="print the (call site x fault kind) coverage table"
    )
    parser.add_argument("--save", help="write the campaign's coverage and violation counts to this JSON file")
    parser.add_argument(
        "--merge", nargs="+", help="print the coverage of these saved campaigns added up, and exit"
    )
    parser.add_argument(
        "--shards",
        action="store_true",
        help="the shard scenario instead: split -> shard runs -> merge under faults (tests/simulation/shards.py)",
    )
    args = parser.parse_args()
    if args.shards:
        return shards(args)
    if args.merge:
        return merge(args.merge)
    if args.seed is not None:
        from tests.simulation.world import make_plan

        print(f"seed {args.seed}: {make_plan(args.seed).describe()}")
        if args.trace:
            from tests.simulation.world import run_schedule

            with tempfile.TemporaryDirectory(prefix="vllm-batch-sim-") as workdir:
                print("\n".join(run_schedule(args.seed, Path(workdir) / "schedule").s3.trace))
        report = _run([args.seed])
        print(report.format(first=args.first))
        return 1 if report.failing_seeds else 0
    seeds = list(range(args.start, args.start + args.schedules))
    started = time.perf_counter()
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            reports = pool.map(_run, [seeds[i :: args.jobs] for i in range(args.jobs)])
        report = reports[0]
        for other in reports[1:]:
            report.schedules += other.schedules
            report.faults = Counter(report.faults) + Counter(other.faults)
            for check, found in other.violations.items():
                report.violations[check] = sorted(report.violations.get(check, []) + found)
            report.details.update(other.details)
            report.crashes.update(other.crashes)
            report.coverage = Counter(report.coverage) + Counter(other.coverage)
            report.clean_last_tries += other.clean_last_tries
    else:
        report = _run(seeds)
    report.seconds = time.perf_counter() - started
    print(report.format(first=args.first))
    if args.coverage:
        print(report.coverage_table())
    if args.save:
        # A campaign in chunks (``--start``): ``--merge`` adds their coverage up.
        Path(args.save).write_text(
            json.dumps(
                {
                    "schedules": report.schedules,
                    "seconds": report.seconds,
                    "coverage": [[s, k, n] for (s, k), n in report.coverage.items()],
                    "violations": {c: len(v) for c, v in report.violations.items()},
                }
            )
        )
    return 1 if report.failing_seeds else 0


def _run_shards(seeds: list[int]):
    import contextlib
    import io

    from tests.simulation.shards import run_shard_campaign

    # The operators log through Airflow's structlog to stdout: kept out of the report.
    with (
        tempfile.TemporaryDirectory(prefix="vllm-batch-sim-") as workdir,
        contextlib.redirect_stdout(io.StringIO()),
    ):
        return run_shard_campaign(seeds, Path(workdir))


def shards(args: argparse.Namespace) -> int:
    """The shard scenario's campaign (or one seed's replay): its report, non-zero on any violation."""
    from tests.simulation.shards import make_shard_plan, run_shard_schedule

    if args.seed is not None:
        print(f"seed {args.seed}: {make_shard_plan(args.seed).describe()}")
        if args.trace:
            with tempfile.TemporaryDirectory(prefix="vllm-batch-sim-") as workdir:
                print("\n".join(run_shard_schedule(args.seed, Path(workdir) / "schedule").s3.trace))
        seeds = [args.seed]
    else:
        seeds = list(range(args.start, args.start + args.schedules))
    started = time.perf_counter()
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            reports = pool.map(_run_shards, [seeds[i :: args.jobs] for i in range(args.jobs)])
        report = reports[0]
        for other in reports[1:]:
            report.merge(other)
    else:
        report = _run_shards(seeds)
    report.seconds = time.perf_counter() - started
    print(report.format(first=args.first))
    if args.coverage:
        print(report.coverage_table())
    return 1 if report.violations else 0


def merge(paths: list[str]) -> int:
    """Print the (call site x fault kind) coverage of several saved campaigns (``--save``) added up."""
    from tests.simulation.campaign import CampaignReport

    report = CampaignReport()
    violations: Counter = Counter()
    for path in paths:
        saved = json.loads(Path(path).read_text())
        report.schedules += saved["schedules"]
        report.seconds += saved["seconds"]
        report.coverage.update({(s, k): n for s, k, n in saved["coverage"]})
        violations.update(saved["violations"])
    print(
        f"{report.schedules} schedules in {report.seconds:.1f}s (summed); schedules violating each check: {dict(violations) or 0}"
    )
    print(report.coverage_table())
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
