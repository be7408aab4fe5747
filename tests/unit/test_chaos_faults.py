"""The chaos campaign's clock jumps, full scratch disk and seeded schedule (``benchmarks/chaos.py``), without its stack.

The campaign itself runs them on the real stack (``tests/integration/test_chaos_smoke.py``,
docs/reliability.md); these check what it relies on: the steps' sizes and bound, that the
processes it preloads libfaketime into can still sleep, that a fill really fills the disk
and leaves nothing behind, and that a seed replays its faults whatever they find live.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.extra_api_server import LIBFAKETIME
from tests.small_disk import small_tmpfs

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import chaos  # noqa: E402


def _campaign(tmp_path: Path, seed: int = 3, **args: object) -> chaos.Campaign:
    return chaos.Campaign(argparse.Namespace(seed=seed, **args), tmp_path)


def test_clock_jumps_step_20_s_to_5_min_either_way_and_keep_the_offset_within_10_minutes(tmp_path):
    campaign = _campaign(tmp_path)
    campaign.set_clock(0)
    low, high = chaos.CLOCK_JUMP_S
    steps = []
    for _ in range(500):
        before = campaign.clock_offset
        campaign.clock_jump()
        step = campaign.clock_offset - before
        steps.append(step)
        assert low - 1 <= abs(step) <= high + 1
        assert abs(campaign.clock_offset) <= chaos.CLOCK_MAX_OFFSET_S
        # What libfaketime reads: the offset in seconds, signed.
        assert campaign.clock_file.read_text() == f"{campaign.clock_offset:+d}\n"
    assert min(steps) < 0 < max(steps)
    assert campaign.figures.faults["clock_jump"] == 500
    # Each is logged with its step and the offset after it.
    assert all("wall clock" in line and "offset" in line for line in campaign.log_lines)


def test_the_same_seed_steps_the_clock_the_same_way(tmp_path):
    offsets = []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        campaign = _campaign(tmp_path / run, seed=11)
        campaign.set_clock(0)
        for _ in range(20):
            campaign.clock_jump()
        offsets.append(campaign.clock_offset)
    assert offsets[0] == offsets[1]


@pytest.mark.skipif(not LIBFAKETIME.exists() or shutil.which("cc") is None, reason="needs libfaketime and cc")
@pytest.mark.parametrize("offset", [0, -300, 300])
def test_a_python_under_the_campaigns_preload_sleeps_and_reads_the_stepped_wall_clock(tmp_path, offset):
    campaign = _campaign(tmp_path, clock_jumps=True)
    env = campaign.clock_env()
    campaign.set_clock(offset)
    probe = (
        "import time, threading\n"
        "start, wall = time.monotonic(), time.time()\n"
        "time.sleep(0.2)\n"
        "threading.Event().wait(0.2)\n"
        "print(round(time.monotonic() - start, 1), round(wall - float(__import__('sys').argv[1])))\n"
    )
    import time

    done = subprocess.run(
        [sys.executable, "-c", probe, str(time.time())],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    slept, moved = done.stdout.split()
    assert float(slept) == pytest.approx(0.4, abs=0.15)  # the monotonic clock is not faked
    assert abs(int(moved) - offset) <= 2
    # Without the fix before libfaketime, Python 3.11's sleep fails (libfaketime 0.9.10's bug,
    # which benchmarks/monotonic_sleep_fix.c works around): the fix is what makes the preload usable.
    bare = {**env, "LD_PRELOAD": str(LIBFAKETIME)}
    broken = subprocess.run(
        [sys.executable, "-c", "import time; time.sleep(0.1)"],
        env={**os.environ, **bare},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if broken.returncode == 0:
        pytest.skip("this libfaketime sleeps without the fix (newer than 0.9.10)")
    assert "Invalid argument" in broken.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (the campaign's scratch disk, smaller); skipped where ``mount`` is not allowed."""
    with small_tmpfs(tmp_path / "disk") as disk:
        yield disk


def test_a_scratch_fill_leaves_no_byte_free_while_it_lasts_and_removes_its_file(
    tmp_path, small_disk, monkeypatch
):
    campaign = _campaign(tmp_path)
    campaign.results_dir = small_disk
    owned = small_disk / "airflow-vllm-batch"
    owned.mkdir()
    during: list[object] = []

    def held(seconds: float) -> None:
        assert 2 <= seconds <= 10
        during.append(shutil.disk_usage(small_disk).free)
        with pytest.raises(OSError, match="No space left") as full:
            (owned / "part.jsonl").write_bytes(b"x" * 4096)  # a task's write meanwhile
        during.append(full.value.errno)

    monkeypatch.setattr(chaos.time, "sleep", held)
    campaign.fill_scratch()
    assert during == [0, errno.ENOSPC]
    assert sorted(p.name for p in small_disk.iterdir()) == ["airflow-vllm-batch"]  # the filler is gone
    assert shutil.disk_usage(small_disk).free > 3 << 20
    assert campaign.figures.faults["scratch_full"] == 1


def test_a_seed_replays_its_fault_schedule_whatever_each_fault_finds_live(tmp_path, monkeypatch):
    """The same seed draws the same kinds and each fault the same amounts, though one machine has more live targets than another.

    A fault's target is picked among the processes live then, which differ from one machine (and
    run) to the next; it draws from the fault's own RNG, so it never shifts a later draw.
    """
    schedules = []
    for run, live in (("few", [0, 1, 2]), ("many", [9, 5, 14, 3])):
        (tmp_path / run).mkdir()
        campaign = _campaign(
            tmp_path / run,
            seed=5,
            fault_weights={},
            smoke=False,
            clock_jumps=True,
            scratch_disk=True,
            fault_s=600,
            gap_s=0.0,
            max_faults=60,
        )
        drawn: list[tuple[str, int | None, float | None]] = []

        def inject(
            kind: str,
            campaign: chaos.Campaign = campaign,
            live: list[int] = live,
            drawn: list[tuple[str, int | None, float | None]] = drawn,
        ) -> None:
            # What ``inject`` does with a target: none live, it returns; else it picks one, then
            # draws how long (a pause's seconds).
            targets = range(live[len(drawn) % len(live)])
            if not targets:
                drawn.append((kind, None, None))
                return
            target = campaign.pick(targets)
            drawn.append((kind, target, campaign.fault_rng.uniform(1, 5)))

        monkeypatch.setattr(campaign, "inject", inject)
        monkeypatch.setattr(campaign, "all_ended", lambda: False)
        monkeypatch.setattr(
            campaign, "proxy", argparse.Namespace(set_faults=lambda rate: None), raising=False
        )
        campaign.run_faults()
        schedules.append(drawn)
    few, many = schedules
    assert len(few) == len(many) == 60
    assert [kind for kind, _, _ in few] == [kind for kind, _, _ in many]
    # Where both found targets, the same amounts; the targets differ only as the live lists do.
    both = [(a, b) for a, b in zip(few, many) if a[1] is not None and b[1] is not None]
    assert len(both) > 10
    assert all(a[2] == b[2] for a, b in both)
    assert len({kind for kind, _, _ in few}) > 5


def test_the_tail_waits_for_a_published_batchs_dag_run_to_end(tmp_path, monkeypatch):
    """A batch reads ended once published; its task, killed after the publish, runs on in Airflow until the scheduler fails it.

    The checks read the tasks' states, so the tail waits for that run too (seed 7 of the smoke
    slice at 76dff41 checked while the task was still ``running``).
    """
    campaign = _campaign(tmp_path, tail_s=60)
    job = chaos.Job("batch", "batch_1", [], chaos.BATCH_DAG_ID, "batch_1", ("o", "e", "m"), chaos.API_BUCKET)
    job.ended_at = 1.0
    campaign.jobs = [job]
    states = iter(["running", "running", "success"])
    reads: list[tuple[str, str]] = []

    def dag_run(dag_id: str, run_id: str) -> dict:
        reads.append((dag_id, run_id))
        return {"state": next(states)}

    monkeypatch.setattr(campaign, "dep", argparse.Namespace(dag_run=dag_run), raising=False)
    monkeypatch.setattr(chaos.time, "sleep", lambda seconds: None)
    campaign.tail()
    assert reads == [(chaos.BATCH_DAG_ID, "batch_1")] * 3
    assert campaign.figures.failures == []
