"""An engine this task starts checks ``engine_args`` with its own entrypoint's parser (issue 18, bug 1).

The server's check runs vLLM's real parser in a child process (about 10 s); the runner's
refusal of the same flags is among the cases of ``tests/unit/engines/vllm/test_engine_checks.py``,
which share one run of that parser.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from airflow_vllm_batch.engines import local as local_engines
from airflow_vllm_batch.engines.local import arguments_marker_digest
from airflow_vllm_batch.engines.runner import RunnerEngine
from airflow_vllm_batch.engines.server import ServerEngine
from airflow_vllm_batch.engines.vllm.checks import OfflineDefaults
from airflow_vllm_batch.engines.base import EngineInfo
from airflow_vllm_batch.engines.options import VLLMRunner, VLLMServer
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


@pytest.mark.vllm  # the installed vLLM's own api_server parser
def test_a_task_started_server_accepts_its_own_flags_in_the_argument_check(tmp_path):
    engine = _server_engine(tmp_path)
    engine.engine_arguments(INFO)  # the installed vLLM's api_server parser: raises if it refuses them
    assert [p.name for p in (tmp_path / "airflow-vllm-batch").glob("engine-args-ok-*")] == [
        f"engine-args-ok-{arguments_marker_digest(sys.executable, '0.32.0', 'm', SERVER_FLAGS, 'api_server')}"
    ]


def test_arguments_that_passed_one_entrypoints_parser_are_checked_again_by_the_others(monkeypatch, tmp_path):
    checked: list[str] = []

    def parser_accepts(python, model, args, *, entrypoint, offline_defaults_for=None, env=None, module=None, options_file=None):
        checked.append(entrypoint)
        return OfflineDefaults(max_num_seqs=8, max_num_batched_tokens=64, device="cpu") if offline_defaults_for else None

    monkeypatch.setattr(local_engines, "check_engine_args", parser_accepts)
    _server_engine(tmp_path).engine_arguments(INFO)
    # Same worker, same results_dir, same flags: the server's marker must not let the
    # runner skip its own parser, which refuses --uvicorn-log-level.
    RunnerEngine(_settings(tmp_path, "runner"), logging.getLogger(__name__)).engine_arguments(INFO)
    assert checked == ["api_server", "run_batch"]
