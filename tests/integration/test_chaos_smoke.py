"""The chaos campaign's smoke slice: the real stack under a few seeded faults loses and duplicates nothing.

Runs ``benchmarks/chaos.py --smoke --seed 334`` as the benchmark page runs it (its own process,
from the repository root) and reads its final JSON line: 3 operator runs (the warm server,
with and without the answer cache, and vLLM's batch runner started by the task) and 2 OpenAI
API batches (one cancelled), and the 8 faults seed 334 draws on any machine (its schedule
replays: docs/reliability.md): 2 task processes killed and one paused, the tasks' scratch disk
filled, SeaweedFS killed, two windows of S3 faults through the proxy, the scheduler killed (no
clock step in the slice: see ``run_faults``); then the checks on what is really in S3 and in
Airflow's database (see the script's docstring). Where ``mount`` is not allowed (not root) the
slice runs without its scratch disk, and without libfaketime or a C compiler without the
preload (``--no-scratch-disk``, ``--no-clock-jumps``): other draws of the same seed.

Fresh processes: the campaign kills and pauses the scheduler, the API server, SeaweedFS,
the warm vLLM server and the tasks' processes: none of it can be the session's. About 3
minutes on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.integration.dagrun import REPO
from tests.integration.extra_api_server import LIBFAKETIME

pytestmark = [pytest.mark.integration, pytest.mark.engine]

SEED = 334


def test_the_smoke_campaign_loses_and_duplicates_no_answer_and_every_run_ends():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTEST_"))}
    missing = [
        *(["--no-scratch-disk"] if os.geteuid() != 0 else []),
        *(["--no-clock-jumps"] if not LIBFAKETIME.exists() or shutil.which("cc") is None else []),
    ]
    done = subprocess.run(
        [sys.executable, "benchmarks/chaos.py", "--smoke", "--seed", str(SEED), *missing],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-4000:]
    result = json.loads(lines[-1])
    summary = "\n".join(lines[-40:])
    assert result["faults"] > 0, summary
    assert result["runs_ended"], summary
    assert result["answers_lost"] == 0, summary
    assert result["duplicates_published"] == 0, summary
    assert result["failures"] == [], summary
    assert done.returncode == 0, summary + done.stderr[-3000:]
