"""The engine launcher checks the arguments, reads the defaults and starts the entry point, in one process (issue 26 item 2).

A stand-in ``vllm`` package (its runner's parser, its offline table, its platform) makes
each path fast here; the real vLLM's parser refusing a flag before the model loads is
shown in ``tests/integration/test_engine_launcher.py``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from airflow_vllm_batch.engines.base import EngineInfo
from airflow_vllm_batch.engines.options import VLLMRunner, VLLMServer
from airflow_vllm_batch.engines.runner import RunnerEngine
from airflow_vllm_batch.engines.server import ServerEngine
from airflow_vllm_batch.engines.vllm.command import build_engine_argv, conceal_arguments
from airflow_vllm_batch.engines.vllm.launcher import ARGUMENTS_REFUSED_EXIT
from airflow_vllm_batch.engines.vllm.server_process import VLLMServerEngine
from airflow_vllm_batch.exceptions import EngineArgsCheckError, EngineArgumentsError, EngineError
from airflow_vllm_batch.hooks.vllm import VLLMEngineHook
from airflow_vllm_batch.run.settings import BatchSettings

RUNNER = "vllm.entrypoints.launchers.run_batch"
INFO = EngineInfo(vllm_version="0.32.0", supported_urls=frozenset(), model_kind="generate")

#: A stand-in vLLM: what the argument check and the offline defaults import, and a runner that says what it got.
FAKE_VLLM = {
    "__init__.py": "",
    "utils/__init__.py": "",
    "utils/argparse_utils.py": "import argparse\nFlexibleArgumentParser = argparse.ArgumentParser\n",
    "entrypoints/__init__.py": "",
    "entrypoints/launchers/__init__.py": "",
    "entrypoints/launchers/run_batch.py": """
        import json, os, sys
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        def make_arg_parser(parser):
            for flag in ("-i", "-o", "--model"):
                parser.add_argument(flag, required=flag != "--model")
            for flag in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens"):
                parser.add_argument(flag, type=int)
            parser.add_argument("--enforce-eager", action="store_true")
            parser.add_argument("--hf-token")
            return parser

        def validate_run_batch_args(args):
            if args.max_model_len is not None and args.max_model_len < 1:
                raise ValueError("max_model_len must be positive")

        if __name__ == "__main__":
            args = make_arg_parser(FlexibleArgumentParser()).parse_args()
            open(os.environ["FAKE_RUNNER_RAN"], "w").write(json.dumps({"argv": sys.argv[1:], "main": __name__}))
    """,
    "config/__init__.py": "class SchedulerConfig:\n    DEFAULT_MAX_NUM_SEQS = 128\n    DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048\n",
    "usage/__init__.py": "",
    "usage/usage_lib.py": "import enum\nclass UsageContext(enum.Enum):\n    LLM_CLASS = 1\n    OPENAI_BATCH_RUNNER = 2\n",
    "engine/__init__.py": "",
    "engine/arg_utils.py": """
        import os
        from vllm.usage.usage_lib import UsageContext

        class EngineArgs:
            @staticmethod
            def get_batch_defaults(world_size):
                if os.environ.get("FAKE_NO_TABLE"):
                    raise AttributeError("get_batch_defaults")
                return {UsageContext.LLM_CLASS: 16384}, {UsageContext.LLM_CLASS: 1024}
    """,
    "platforms/__init__.py": "class _Platform:\n    device_type = 'cuda'\n    def get_device_name(self):\n        return 'NVIDIA H100 80GB HBM3'\ncurrent_platform = _Platform()\n",
}


@pytest.fixture
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``vllm`` is the stand-in; the runner writes what it got to ``FAKE_RUNNER_RAN``."""
    for name, text in FAKE_VLLM.items():
        path = tmp_path / "site" / "vllm" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "FAKE_RUNNER_RAN": str(tmp_path / "ran.json")}


def _settings(tmp_path: Path, engine_args: list[str], server: bool = False) -> BatchSettings:
    engine = (VLLMServer if server else VLLMRunner)(args=list(engine_args)).rendered()
    return BatchSettings(output_uri="s3://b/out.jsonl", model="m", results_dir=str(tmp_path), engine=engine)


def _start(
    tmp_path: Path, env: dict[str, str], engine_args: list[str], after: list[str] = ()
) -> tuple[RunnerEngine, object, list[str]]:
    """Start the runner as :meth:`RunnerEngine.start_engine` does, through the launcher; return the engine, the run and the log."""
    engine = RunnerEngine(_settings(tmp_path, engine_args), logging.getLogger("test"))
    argv = build_engine_argv(
        input_location="https://s3.example/in.jsonl?X-Amz-Signature=abc123",
        output_location=str(tmp_path / "out.jsonl"),
        model="m",
        engine_args=[*engine.engine_arguments(INFO), *after],
        python=sys.executable,
    )
    report = tmp_path / "engine-launch.json"
    argv, hidden = conceal_arguments(argv, engine.launch(INFO, report, insert_at=len(argv) - 3 - len(after)))
    lines: list[str] = []
    run = VLLMEngineHook().run(argv, env={**env, **hidden}, on_line=lines.append)
    return engine, run, lines


def test_a_refused_flag_stops_the_engine_before_its_entry_point_runs_with_the_checks_message(
    tmp_path, fake_vllm
):
    engine, run, _lines = _start(tmp_path, fake_vllm, ["--max-modle-len", "4096"])
    assert run.returncode == ARGUMENTS_REFUSED_EXIT
    assert not (tmp_path / "ran.json").exists()  # the runner (model, GPU) never started
    with pytest.raises(EngineArgumentsError) as refused:
        engine.settle_launch(tmp_path / "engine-launch.json")
    # The message the separate check gave, word for word; not retried.
    assert str(refused.value) == (
        "VLLMRunner(args=...): unrecognized arguments: --max-modle-len 4096 (did you mean --max-model-len for --max-modle-len?). "
        f"Fix args (see 'python -m {RUNNER} --help')."
    )
    assert refused.value.retryable is False


def test_a_refused_secret_flag_value_is_in_neither_the_engine_log_nor_the_error(tmp_path, fake_vllm):
    engine, run, lines = _start(
        tmp_path, fake_vllm, ["--hf-token", "hf_abcdefghijklmnopqrstuvwxyz", "--bogus"]
    )
    assert run.returncode == ARGUMENTS_REFUSED_EXIT
    assert not any("hf_abcdefghijklmnopqrstuvwxyz" in line for line in lines)
    with pytest.raises(EngineArgumentsError) as refused:
        engine.settle_launch(tmp_path / "engine-launch.json")
    assert "hf_abcdefghijklmnopqrstuvwxyz" not in str(refused.value)
    assert "--bogus" in str(refused.value)


def test_the_entry_points_own_quick_checks_refuse_before_it_runs(tmp_path, fake_vllm):
    engine, run, _ = _start(tmp_path, fake_vllm, ["--max-model-len", "0"])
    assert run.returncode == ARGUMENTS_REFUSED_EXIT
    assert not (tmp_path / "ran.json").exists()
    with pytest.raises(
        EngineArgumentsError, match=r"^VLLMRunner\(args=\.\.\.\): max_model_len must be positive"
    ):
        engine.settle_launch(tmp_path / "engine-launch.json")


def test_accepted_arguments_reach_the_entry_point_as_main_with_the_offline_sizes_in_one_process(
    tmp_path, fake_vllm
):
    engine, run, lines = _start(tmp_path, fake_vllm, ["--enforce-eager"], after=["--max-num-seqs", "1"])
    assert run.returncode == 0, lines
    ran = json.loads((tmp_path / "ran.json").read_text())
    assert ran["main"] == "__main__"
    assert ran["argv"] == [
        "-i", "https://s3.example/in.jsonl?X-Amz-Signature=abc123", "-o", str(tmp_path / "out.jsonl"), "--model", "m",
        "--enforce-eager", "--max-num-seqs", "1024", "--max-num-batched-tokens", "16384", "--max-num-seqs", "1",
    ]  # fmt: skip
    engine.settle_launch(tmp_path / "engine-launch.json")
    assert (engine.scheduler_sizes.max_num_seqs, engine.scheduler_sizes.max_num_batched_tokens) == (
        1024,
        16384,
    )
    assert any(line.startswith("Scheduler: --max-num-seqs 1024") and "NVIDIA H100" in line for line in lines)


def test_offline_defaults_the_engines_vllm_cannot_tell_leave_it_unsized_with_the_warning(
    tmp_path, fake_vllm, caplog
):
    engine, run, _ = _start(tmp_path, {**fake_vllm, "FAKE_NO_TABLE": "1"}, ["--enforce-eager"])
    assert run.returncode == 0
    assert json.loads((tmp_path / "ran.json").read_text())["argv"][-1] == "--enforce-eager"
    with caplog.at_level(logging.WARNING):
        engine.settle_launch(tmp_path / "engine-launch.json")
    assert "Could not read vLLM's offline scheduler defaults" in caplog.text
    assert "get_batch_defaults" in caplog.text
    assert engine.scheduler_sizes.flags == []


def test_a_parser_the_engines_python_cannot_load_fails_as_the_separate_check_did(tmp_path):
    engine = RunnerEngine(_settings(tmp_path, ["--enforce-eager"]), logging.getLogger("test"))
    report = tmp_path / "engine-launch.json"
    report.write_text(
        json.dumps(
            {"check": {"ok": False, "stage": "import", "error": "ImportError: No module named 'vllm'"}}
        )
    )
    with pytest.raises(EngineArgsCheckError, match="cannot load vLLM's argument parser") as failed:
        engine.settle_launch(report)
    assert failed.value.retryable is False


def test_an_engine_that_ends_before_its_launcher_decided_leaves_the_error_to_its_exit(tmp_path):
    engine = RunnerEngine(_settings(tmp_path, ["--enforce-eager"]), logging.getLogger("test"))
    engine.settle_launch(tmp_path / "never-written.json")
    assert engine.scheduler_sizes is None


def test_a_started_server_that_exits_on_a_refused_flag_raises_the_checks_error_not_a_start_up_failure(
    monkeypatch, tmp_path
):
    from airflow_vllm_batch.engines.vllm import server_process as vllm_server

    def exits_during_start_up(self):
        raise EngineError("The vLLM server exited during start-up (exit 78).")

    monkeypatch.setattr(vllm_server.VLLMServerProcess, "start", exits_during_start_up)
    engine = ServerEngine(_settings(tmp_path, ["--bogus"], server=True), logging.getLogger("test"))
    engine.before_stream(INFO, type("Job", (), {"work": tmp_path})())
    (tmp_path / "engine-launch.json").write_text(
        json.dumps(
            {
                "check": {
                    "ok": False,
                    "stage": "parse",
                    "error": "unrecognized arguments: --bogus",
                    "help": "vllm serve --help",
                }
            }
        )
    )
    assert isinstance(engine.server, VLLMServerEngine)
    with pytest.raises(
        EngineArgumentsError,
        match=r"^VLLMServer\(args=\.\.\.\): unrecognized arguments: --bogus\. Fix args \(see 'vllm serve --help'\)\.$",
    ):
        engine.server.run(iter(()), journal=None)


def test_the_launcher_runs_a_module_as_python_m_would_when_asked_for_nothing_else(tmp_path):
    (tmp_path / "plain.py").write_text("import sys\nprint('args', sys.argv[1:], __name__)\n")
    argv, env = conceal_arguments([sys.executable, "-m", "plain", "--x", "1"])
    done = subprocess.run(
        argv,
        env={**os.environ, **env, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == "args ['--x', '1'] __main__\n"


def test_after_one_engine_on_the_worker_a_misspelled_flag_is_refused_without_starting_another(
    tmp_path, fake_vllm
):
    engine, run, _ = _start(tmp_path, fake_vllm, ["--enforce-eager"])
    assert run.returncode == 0
    engine.settle_launch(tmp_path / "engine-launch.json")  # keeps the flags the engine's parser knew
    again = RunnerEngine(_settings(tmp_path, ["--max-modle-len", "4096"]), logging.getLogger("test"))
    with pytest.raises(
        EngineArgumentsError,
        match=r"unrecognized arguments: --max-modle-len \(did you mean --max-model-len for --max-modle-len\?\)",
    ):
        again.engine_arguments(INFO)
