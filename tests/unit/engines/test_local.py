"""An engine this task starts checks ``engine_args`` with its own entrypoint's parser (issue 18, bug 1).

The check runs in the engine's own process, in its launcher, before the entry point
(issue 26 item 2); here the launcher's preparation runs vLLM's real parsers (about 10 s).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_vllm_batch.engines.base import EngineInfo
from airflow_vllm_batch.engines.options import VLLMRunner, VLLMServer
from airflow_vllm_batch.engines.runner import RunnerEngine
from airflow_vllm_batch.engines.server import ServerEngine
from airflow_vllm_batch.engines.vllm import launcher as engine_launcher
from airflow_vllm_batch.run.settings import BatchSettings

#: Flags only vLLM's OpenAI server has: the batch runner's parser refuses ``--uvicorn-log-level``.
SERVER_FLAGS = ["--enforce-eager", "--uvicorn-log-level", "warning"]
INFO = EngineInfo(vllm_version="0.32.0", supported_urls=frozenset({"/v1/chat/completions"}))


def _settings(results_dir: Path, engine: str) -> BatchSettings:
    return BatchSettings.from_rendered(
        input_uri="s3://b/in.jsonl",
        output_uri="s3://b/out/results.jsonl",
        model="m",
        engine=(VLLMServer if engine == "server" else VLLMRunner)(args=SERVER_FLAGS),
        results_dir=str(results_dir),
    )


def _server_engine(results_dir: Path) -> ServerEngine:
    return ServerEngine(_settings(results_dir, "server"), logging.getLogger(__name__))


#: Runs the launcher's preparation for each engine's launch (not the entry point) in one process, prints the reports.
PREPARE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("launcher", sys.argv[1])
launcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launcher)
for module, launch in json.loads(sys.argv[2]):
    print(json.dumps(launcher.prepare(module, [], launch)[1]["check"]))
"""


@pytest.mark.vllm  # the installed vLLM's own api_server and run_batch parsers, in the engine's launcher
def test_each_engine_launcher_checks_with_its_own_entrypoints_parser(tmp_path):
    server, runner = (
        _server_engine(tmp_path),
        RunnerEngine(_settings(tmp_path, "runner"), logging.getLogger(__name__)),
    )
    launches = [
        ["vllm.entrypoints.openai.api_server", server.launch(INFO, tmp_path / "s.json")],
        [INFO.runner_module, runner.launch(INFO, tmp_path / "r.json")],
    ]
    done = subprocess.run(
        [sys.executable, "-c", PREPARE, engine_launcher.__file__, json.dumps(launches)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    served, ran = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert served["ok"], served  # the server's own flags pass its parser
    # The same flags on the same worker: the runner's parser refuses the server's --uvicorn-log-level.
    assert not ran["ok"]
    assert "--uvicorn-log-level" in ran["error"]
