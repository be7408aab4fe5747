"""``make demo``, the README's first command, run the way the Makefile runs it: a fresh process.

The suite's own fixtures import the embedded default's modules; the demo runs them as
``python -m``, where a module is ``__main__``. That difference once broke the demo on a
fresh clone while every test passed, so this test takes the demo's command from the
Makefile itself and runs it in a child process with a user's environment (none of the
test session's Airflow settings).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.engine]


def demo_command() -> list[str]:
    """The recipe of the Makefile's ``demo`` target, with ``$(BIN)`` as this virtualenv's bin directory."""
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, "the Makefile has no demo target"
    lines = [line.strip() for line in recipe.group(1).splitlines()]
    assert len(lines) == 1, f"expected one command in the demo recipe, got {lines}"
    return shlex.split(lines[0].replace("$(BIN)", str(Path(sys.executable).parent)))


def test_make_demo_publishes_the_pipeline_and_prints_its_manifest():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VLLM_"))}
    done = subprocess.run(
        demo_command(), cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    out = done.stdout.splitlines()
    manifest = json.loads(out[out.index("=== manifest ===") + 1])
    assert manifest["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
    assert manifest["output_uri"].startswith("s3://vllm-batch/vllm-batch/vllm_batch_pipeline/")
    first = json.loads(out[out.index("=== first results ===") + 1])
    assert first["response"]["status_code"] == 200
    assert out[-1].startswith("=== demo finished in ")
