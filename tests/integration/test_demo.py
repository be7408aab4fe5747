"""``make demo`` and ``make demo-api``, the README's first commands, run the way the Makefile runs them: fresh processes.

The suite's own fixtures import the embedded default's modules; the demos run them as
``python -m``, where a module is ``__main__``. That difference once broke the demo on a
fresh clone while every test passed, so these tests take each demo's command from the
Makefile itself and run it in a child process with a user's environment (none of the
test session's Airflow settings).

Fresh processes: what is tested is a user's command that starts everything it needs from
nothing (SeaweedFS, the tiny model's engine, for ``demo-api`` an Airflow deployment with
the OpenAI API's plugin) and stops it all; the session's servers and deployments would
hide a start that fails on a clone.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from openai.types.chat import ChatCompletion

from vllm_batch_embedded.demo_api import N_REQUESTS

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.engine]


def demo_command(target: str = "demo") -> list[str]:
    """The recipe of the Makefile's ``target``, with ``$(BIN)`` as this virtualenv's bin directory.

    :param target: ``demo`` or ``demo-api``.
    """
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, f"the Makefile has no {target} target"
    lines = [line.strip() for line in recipe.group(1).splitlines()]
    assert len(lines) == 1, f"expected one command in the {target} recipe, got {lines}"
    return shlex.split(lines[0].replace("$(BIN)", str(Path(sys.executable).parent)))


def user_env() -> dict[str, str]:
    """This process's environment without the session's Airflow and vLLM settings: a user's shell."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VLLM_"))}


def test_make_demo_publishes_the_pipeline_and_prints_its_manifest():
    done = subprocess.run(
        demo_command(), cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    out = done.stdout.splitlines()
    manifest = json.loads(out[out.index("=== manifest ===") + 1])
    assert manifest["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
    assert manifest["output_uri"].startswith("s3://vllm-batch/vllm-batch/vllm_batch_pipeline/")
    first = json.loads(out[out.index("=== first results ===") + 1])
    assert first["response"]["status_code"] == 200
    assert out[-1].startswith("=== demo finished in ")


def _left_behind(under: Path) -> list[str]:
    """The processes still running whose working directory or command line is under ``under``."""
    left = []
    for process in psutil.process_iter(["pid", "cwd", "cmdline"]):
        if process.info["pid"] == os.getpid():
            continue
        cwd, cmdline = process.info["cwd"] or "", " ".join(process.info["cmdline"] or [])
        if str(under) in cwd or str(under) in cmdline:
            left.append(f"{process.info['pid']}: {cmdline[:200]}")
    return left


def test_make_demo_api_ends_with_the_batch_output_the_sdk_downloaded_and_stops_everything():
    done = subprocess.run(
        demo_command("demo-api"),
        cwd=REPO,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    out = done.stdout.splitlines()
    assert out[-1].startswith("=== demo-api finished in ")
    (start,) = [i for i, line in enumerate(out) if line.startswith("=== output file file-")]
    lines = [json.loads(line) for line in out[start + 1 : -1]]
    # Each request answered once, in OpenAI's shape, as the SDK downloaded the output file.
    assert sorted(line["custom_id"] for line in lines) == [f"request-{i}" for i in range(N_REQUESTS)]
    for line in lines:
        assert line["id"].startswith("batch_req_")
        assert line["error"] is None
        assert line["response"]["status_code"] == 200
        ChatCompletion.model_validate(line["response"]["body"])
    assert "client.batches.retrieve: batch_" in done.stdout
    assert _left_behind(REPO / ".cache" / "demo-api") == []


def test_the_left_behind_check_sees_a_process_working_under_the_demos_directory(tmp_path):
    # What makes the demo-api test's last assertion able to fail: a process the demo left running.
    straggler = subprocess.Popen(["sleep", "30"], cwd=tmp_path)
    try:
        assert [line.split(":")[0] for line in _left_behind(tmp_path)] == [str(straggler.pid)]
    finally:
        straggler.kill()
        straggler.wait()
    assert _left_behind(tmp_path) == []
