"""The scheduler sizes and in-flight bounds the engines start with, every branch without an engine.

One test reads vLLM's own table (``EngineArgs.get_batch_defaults``) with the device
mocked, to show the offline row is what is read on a GPU; the rest are pure rules. The
real engines report what they resolved in ``tests/integration/test_engine_sizing.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_vllm_batch.engines.base import EngineInfo
from airflow_vllm_batch.engines.options import VLLMRunner, VLLMServer
from airflow_vllm_batch.engines.runner import RunnerEngine
from airflow_vllm_batch.engines.server import ServerEngine
from airflow_vllm_batch.engines.sizing import (
    connection_in_flight,
    scheduler_sizes,
    started_server_in_flight,
    world_size,
)
from airflow_vllm_batch.engines.vllm import launcher as engine_launcher
from airflow_vllm_batch.engines.vllm.checks import OfflineDefaults
from airflow_vllm_batch.run.settings import BatchSettings

H100 = OfflineDefaults(max_num_seqs=1024, max_num_batched_tokens=16384, device="NVIDIA H100 80GB HBM3")
GiB = 1 << 30


def _gpu(name: str, memory_gib: int) -> SimpleNamespace:
    """A stand-in for vLLM's current platform on a CUDA GPU (only what the table asks)."""
    return SimpleNamespace(
        get_device_total_memory=lambda device_id=0: memory_gib * GiB,
        get_device_name=lambda device_id=0: name,
        is_tpu=lambda: False,
        is_cpu=lambda: False,
        device_type="cuda",
    )


@pytest.mark.parametrize(
    ("name", "memory_gib", "offline", "server"),
    [
        ("NVIDIA H100 80GB HBM3", 80, (1024, 16384), (1024, 8192)),
        ("NVIDIA A100-SXM4-80GB", 80, (256, 8192), (256, 2048)),
        ("NVIDIA B200", 180, (1024, 16384), (1024, 16384)),
    ],
    ids=["h100", "a100", "b200"],
)
def test_offline_defaults_are_vllms_llm_class_row_for_the_gpu(monkeypatch, name, memory_gib, offline, server):
    vllm_platforms = pytest.importorskip("vllm.platforms")
    from vllm.engine import arg_utils
    from vllm.usage.usage_lib import UsageContext

    from airflow_vllm_batch.engines.vllm import argcheck as engine_argcheck

    gpu = _gpu(name, memory_gib)
    monkeypatch.setattr(arg_utils, "current_platform", gpu)
    monkeypatch.setattr(vllm_platforms, "_current_platform", gpu)
    read = engine_argcheck.offline_defaults(1)
    assert (read["max_num_seqs"], read["max_num_batched_tokens"]) == offline
    assert read["device"] == name
    # The row read is the offline one, not the server's (nor the runner's, which has none).
    tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(1)
    assert (seqs[UsageContext.OPENAI_API_SERVER], tokens[UsageContext.OPENAI_API_SERVER]) == server
    assert UsageContext.OPENAI_BATCH_RUNNER not in seqs


def test_neither_size_set_adds_both_offline_defaults():
    sizes = scheduler_sizes(["--enforce-eager"], H100, model_kind="generate")
    assert sizes.flags == ["--max-num-seqs", "1024", "--max-num-batched-tokens", "16384"]
    assert "NVIDIA H100" in sizes.note
    assert "override" in sizes.note


@pytest.mark.parametrize(
    "spelling",
    [["--max-num-seqs", "64"], ["--max-num-seqs=64"], ["--max_num_seqs", "64"]],
    ids=["space", "equals", "underscores"],
)
def test_users_max_num_seqs_is_kept_and_only_tokens_are_added(spelling):
    sizes = scheduler_sizes(spelling, H100, model_kind="generate")
    assert sizes.flags == ["--max-num-batched-tokens", "16384"]
    assert sizes.max_num_seqs == 64


def test_users_max_num_batched_tokens_is_kept_and_caps_the_added_sequences():
    sizes = scheduler_sizes(["--max-num-batched-tokens=512"], H100, model_kind="generate")
    # vLLM refuses fewer tokens per step than sequences.
    assert sizes.flags == ["--max-num-seqs", "512"]
    assert sizes.max_num_batched_tokens == 512


def test_both_sizes_set_adds_nothing_and_needs_no_defaults():
    sizes = scheduler_sizes(["--max-num-seqs", "8", "--max-num-batched-tokens", "64"], None, model_kind=None)
    assert sizes.flags == []
    assert (sizes.max_num_seqs, sizes.max_num_batched_tokens) == (8, 64)


def test_unreadable_defaults_add_nothing():
    assert scheduler_sizes([], None, model_kind="generate").flags == []


def test_throughput_mode_doubles_the_added_defaults_as_vllm_does():
    sizes = scheduler_sizes(["--performance-mode", "throughput"], H100, model_kind="generate")
    assert sizes.flags == ["--max-num-seqs", "2048", "--max-num-batched-tokens", "32768"]


@pytest.mark.parametrize(
    ("engine_args", "kind"),
    [
        ([], "pooling"),
        (["--no-enable-chunked-prefill"], "generate"),
        (["--disable-chunked-prefill"], "generate"),
        (["--enable-chunked-prefill", "--disable_chunked_prefill"], "generate"),
        (["--enable-chunked-prefill=false"], "generate"),
    ],
    ids=["pooling-model", "chunked-prefill-off", "disable-form-0.33", "disabled-last", "enable-false"],
)
def test_without_chunked_prefill_the_token_budget_is_left_to_vllm(engine_args, kind):
    sizes = scheduler_sizes(engine_args, H100, model_kind=kind)
    assert sizes.flags == ["--max-num-seqs", "1024"]
    assert sizes.max_num_batched_tokens is None


@pytest.mark.parametrize(
    "engine_args", [["--disable-chunked-prefill", "--enable-chunked-prefill"], ["--enable-chunked-prefill"]]
)
def test_chunked_prefill_switched_on_last_keeps_the_offline_token_budget(engine_args):
    sizes = scheduler_sizes(engine_args, H100, model_kind="generate")
    assert sizes.max_num_batched_tokens == 16384


def test_without_chunked_prefill_a_given_max_model_len_raises_the_token_budget():
    sizes = scheduler_sizes(["--max-model-len", "32768"], H100, model_kind="pooling")
    assert sizes.flags == ["--max-num-seqs", "1024", "--max-num-batched-tokens", "32768"]


def test_world_size_is_tensor_times_pipeline_parallel():
    assert world_size(["-tp", "2", "--pipeline-parallel-size=2", "-dp", "4"]) == 4


def test_started_server_in_flight_is_twice_max_num_seqs_times_data_parallel():
    sizes = scheduler_sizes(["-dp", "2"], H100, model_kind="generate")
    assert started_server_in_flight(None, sizes, ["-dp", "2"])[0] == 4096


def test_started_server_in_flight_follows_the_users_max_num_seqs():
    sizes = scheduler_sizes(["--max-num-seqs", "64"], H100, model_kind="generate")
    assert started_server_in_flight(None, sizes, ["--max-num-seqs", "64"]) == (
        128,
        "twice the server's max_num_seqs 64 times its data-parallel size 1",
    )


def test_the_options_max_in_flight_wins_for_a_started_server_and_the_log_names_it():
    sizes = scheduler_sizes([], H100, model_kind="generate")
    assert started_server_in_flight(7, sizes, []) == (7, "VLLMServer(max_in_flight=...)")


def test_started_server_of_unknown_size_gets_the_streams_default():
    assert started_server_in_flight(None, scheduler_sizes([], None, model_kind=None), [])[0] == 512


@pytest.mark.parametrize(
    ("user", "extra", "expected", "reason"),
    [
        (7, 100, 7, "WarmVLLMServer(max_in_flight=...)"),
        (None, 100, 100, "connection's max_in_flight extra"),
        (None, None, 512, "does not say its max_num_seqs"),
    ],
    ids=["options-win", "connection-extra", "default"],
)
def test_connection_in_flight(user, extra, expected, reason):
    chosen, why = connection_in_flight(user, extra)
    assert chosen == expected
    assert reason in why


# -- the engines: the sizes their launcher chooses in the engine's own process ---------


class _Argcheck:
    """Stands in for ``engine_argcheck`` in the launcher: accepts every argument, answers fixed defaults."""

    def __init__(self, defaults: OfflineDefaults | None = H100, fail: bool = False) -> None:
        self.defaults_read: list[int] = []
        self.defaults = defaults
        self.fail = fail

    def check(self, entrypoint, argv, entry_module=None):
        return {"ok": True, "entrypoint": entrypoint}

    def offline_defaults(self, world_size):
        self.defaults_read.append(world_size)
        if self.fail:
            raise RuntimeError("no table here")
        return dataclasses.asdict(self.defaults)


def _engine(cls, tmp_path: Path, **options):
    """The engine ``cls`` with its options (``VLLMServer``'s for the server, else ``VLLMRunner``'s)."""
    options = {"args": (), **options}
    engine = (VLLMServer if cls is ServerEngine else VLLMRunner)(**options).rendered()
    settings = BatchSettings(
        output_uri="s3://b/out.jsonl", model="m", results_dir=str(tmp_path), engine=engine
    )
    return cls(settings, logging.getLogger("test"))


INFO = EngineInfo(vllm_version="0.32.0", supported_urls=frozenset(), model_kind="generate")


def _launched(
    monkeypatch, engine, tmp_path: Path, argcheck: _Argcheck, argv: list[str] | None = None, insert_at=None
) -> list[str]:
    """What the engine's launcher does in the engine's process, with ``argcheck`` for vLLM; return the arguments it starts with."""
    monkeypatch.setattr(engine_launcher, "_argcheck", lambda: argcheck)
    report = tmp_path / "engine-launch.json"
    launch = json.loads(
        json.dumps(engine.launch(INFO, report, insert_at=insert_at))
    )  # what the environment carries
    args = list(engine.engine_arguments(INFO) if argv is None else argv)
    started, decided = engine_launcher.prepare("vllm.entrypoints.launchers.run_batch", args, launch)
    engine_launcher._write_report(launch["report"], decided)
    engine.settle_launch(report)
    return started


@pytest.mark.parametrize("cls", [RunnerEngine, ServerEngine], ids=["runner", "server"])
def test_engine_starts_with_the_offline_sizes_its_launcher_read_in_its_own_process(
    monkeypatch, tmp_path, cls
):
    engine = _engine(cls, tmp_path, args=["--enforce-eager"])
    args = _launched(monkeypatch, engine, tmp_path, _Argcheck())
    assert args == ["--enforce-eager", "--max-num-seqs", "1024", "--max-num-batched-tokens", "16384"]
    assert engine.scheduler_sizes == scheduler_sizes(["--enforce-eager"], H100, model_kind="generate")


def test_size_flags_go_between_the_users_flags_and_an_isolated_runs_bound(monkeypatch, tmp_path):
    engine = _engine(RunnerEngine, tmp_path, args=["--enforce-eager"])
    args = _launched(
        monkeypatch,
        engine,
        tmp_path,
        _Argcheck(),
        argv=["--enforce-eager", "--max-num-seqs", "1"],
        insert_at=1,
    )
    # argparse keeps the last value: the isolated run's bound of one sequence wins over the default.
    assert args == [
        "--enforce-eager",
        "--max-num-seqs",
        "1024",
        "--max-num-batched-tokens",
        "16384",
        "--max-num-seqs",
        "1",
    ]


# The entrypoints are spelled out, not read from the class: a server checked with the
# runner's parser would refuse the server's own flags (--uvicorn-log-level) and accept
# flags the server does not know.
@pytest.mark.parametrize(
    ("cls", "entrypoint"),
    [(RunnerEngine, "run_batch"), (ServerEngine, "api_server")],
    ids=["runner", "server"],
)
def test_engine_launcher_checks_the_arguments_with_its_own_entrypoints_parser_as_the_task_did(
    tmp_path, cls, entrypoint
):
    launch = _engine(cls, tmp_path, args=["--enforce-eager"]).launch(INFO, tmp_path / "r.json")
    assert launch["entrypoint"] == entrypoint
    prefix = ["-i", "input.jsonl", "-o", os.devnull] if entrypoint == "run_batch" else []
    assert launch["check"] == [*prefix, "--model", "m", "--enforce-eager"]
    assert launch["sizing"]["world_size"] == 1
    assert not launch["sizing"]["max_num_seqs_set"]


def test_the_task_imports_no_vllm_and_starts_no_process_before_the_engine(monkeypatch, tmp_path):
    # A fresh worker used to import vLLM in a separate check process (seconds); the engine's process does it now.
    def no_process(*args, **kwargs):
        raise AssertionError("a process was started before the engine")

    monkeypatch.setattr(subprocess, "run", no_process)
    monkeypatch.setattr(subprocess, "Popen", no_process)
    engine = _engine(RunnerEngine, tmp_path, args=["--enforce-eager"])
    assert engine.engine_arguments(INFO) == ["--enforce-eager"]
    assert engine.launch(INFO, tmp_path / "r.json") is not None
    # No check or defaults remembered on the worker either: a fresh worker and a warm one start the engine alike.
    assert not (tmp_path / "airflow-vllm-batch").exists()


def test_engine_with_both_sizes_set_does_not_read_the_defaults(monkeypatch, tmp_path):
    argcheck = _Argcheck()
    args = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
    assert _launched(monkeypatch, _engine(RunnerEngine, tmp_path, args=args), tmp_path, argcheck) == args
    assert argcheck.defaults_read == []


def test_custom_engine_command_has_no_launcher_and_is_not_sized(tmp_path):
    engine = _engine(RunnerEngine, tmp_path, command=["my-engine"], args=["--enforce-eager"])
    assert engine.engine_arguments(INFO) == ["--enforce-eager"]
    assert engine.launch(INFO, tmp_path / "r.json") is None


def test_defaults_that_cannot_be_read_start_the_engine_unsized_with_a_warning(monkeypatch, tmp_path, caplog):
    engine = _engine(RunnerEngine, tmp_path, args=["--enforce-eager"])
    with caplog.at_level(logging.WARNING):
        assert _launched(monkeypatch, engine, tmp_path, _Argcheck(fail=True)) == ["--enforce-eager"]
    assert "no table here" in caplog.text
    assert "Could not read vLLM's offline scheduler defaults" in caplog.text


def test_started_server_gets_in_flight_sized_to_the_scheduler_its_launcher_chose(
    monkeypatch, tmp_path, caplog
):
    engine = _engine(ServerEngine, tmp_path, args=["--data-parallel-size", "2"])
    job = SimpleNamespace(work=tmp_path)
    engine.before_stream(INFO, job)
    assert engine.server.launch["entrypoint"] == "api_server"
    monkeypatch.setattr(engine_launcher, "_argcheck", lambda: _Argcheck())
    started, decided = engine_launcher.prepare(
        "vllm.entrypoints.openai.api_server", list(engine.server.engine_args), engine.server.launch
    )
    engine_launcher._write_report(engine.server.launch["report"], decided)
    assert started[-4:] == ["--max-num-seqs", "1024", "--max-num-batched-tokens", "16384"]
    with caplog.at_level(logging.INFO):
        engine.server.on_started()
    assert engine.server.max_in_flight == 2 * 1024 * 2
    assert "In flight: at most 4096 requests (twice the server's max_num_seqs 1024" in caplog.text


@pytest.mark.parametrize(
    "flag",
    [["--api-server-count", "2"], ["--api-server-count=2"], ["-asc", "2"]],
    ids=["space", "equals", "short"],
)
def test_started_server_warns_that_its_module_ignores_api_server_count(tmp_path, caplog, flag):
    engine = _engine(ServerEngine, tmp_path, args=flag)
    with caplog.at_level(logging.WARNING):
        engine.before_stream(INFO, SimpleNamespace(work=tmp_path))
    assert "--api-server-count has no effect here" in caplog.text
    assert engine.server.engine_args[: len(flag)] == flag  # passed through all the same
