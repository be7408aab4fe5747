"""Unit tests of the engine hook: argv, redaction, the probe, the process group."""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time

import pytest

from airflow_vllm_batch.batchfile import redact_urls
from airflow_vllm_batch.engines.vllm import RUN_BATCH_MODULE
from airflow_vllm_batch.engines.vllm.command import (
    build_engine_argv,
    conceal_arguments,
    expand_url_matchers,
    probe_engine,
)
from airflow_vllm_batch.hooks.vllm import VLLMEngineHook

GET = "http://127.0.0.1:8333/b/in%20put.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AK%2F2026&X-Amz-Signature=abc123"
PUT = "https://s3.example.com/b/out.jsonl?X-Amz-Expires=3600&X-Amz-Signature=def456"


def test_default_argv_runs_the_batch_runner_module_with_this_python():
    argv = build_engine_argv(
        input_location=GET, output_location=PUT, model="m", engine_args=["--enforce-eager"]
    )
    assert argv == [
        sys.executable,
        "-m",
        RUN_BATCH_MODULE,
        "-i",
        GET,
        "-o",
        PUT,
        "--model",
        "m",
        "--enforce-eager",
    ]


def test_engine_python_replaces_the_interpreter():
    argv = build_engine_argv(
        input_location="in", output_location="out", model="m", python="/opt/vllm/bin/python"
    )
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", RUN_BATCH_MODULE]


def test_engine_command_replaces_the_whole_prefix():
    argv = build_engine_argv(
        input_location="in", output_location="out", model="m", engine_command=["vllm-wrapper", "run-batch"]
    )
    assert argv == ["vllm-wrapper", "run-batch", "-i", "in", "-o", "out", "--model", "m"]


@pytest.mark.parametrize(
    "line",
    [
        f"INFO Reading batch from {GET}...",
        f"INFO Uploading outputs to {PUT}",
        f"args: Namespace(input_file='{GET}', output_file='{PUT}')",
        # vLLM sometimes cuts long values with "...": exact-string masking would miss these.
        "INFO Reading batch from http://h/b/k.jsonl?X-Amz-Algorithm=AWS4&X-Amz-Signature=abc1...",
        "cut before the url ends X-Amz-Signature=deadbeef and more",
    ],
)
def test_redaction_removes_every_signature(line):
    redacted = redact_urls(line)
    for secret in ("abc123", "def456", "abc1", "deadbeef", "AK%2F2026"):
        assert secret not in redacted


def test_redaction_keeps_bucket_and_key_visible():
    assert (
        redact_urls(f"Reading batch from {GET}...")
        == "Reading batch from http://127.0.0.1:8333/b/in%20put.jsonl?<redacted>"
    )


def test_suffix_matchers_expand_to_the_urls_a_line_may_use():
    urls = expand_url_matchers(["/v1/chat/completions"], ["/score"])
    assert urls == {"/v1/chat/completions", "/score", "/v1/score", "/v2/score"}


def test_probe_reads_the_installed_vllm_without_importing_it():
    pytest.importorskip("vllm", reason="needs the engine environment")
    info = probe_engine(sys.executable)
    assert info.vllm_version == "0.32.0"
    assert {"/v1/chat/completions", "/v1/embeddings", "/v1/score", "/v1/rerank"} <= info.supported_urls
    assert "/v1/completions" not in info.supported_urls  # the 0.32 runner does not serve it


def test_probe_reads_the_installed_servers_post_routes():
    pytest.importorskip("vllm", reason="needs the engine environment")
    info = probe_engine(sys.executable)
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v2/rerank"} <= info.server_urls
    assert "/v1/models" not in info.server_urls  # a GET route: no batch line can use it


def test_probe_of_an_environment_without_vllm_says_what_to_set(tmp_path):
    from airflow_vllm_batch.exceptions import EngineConfigurationError

    # -I isolates from site-packages' .pth files but a venv still sees its packages;
    # a fake python that prints no vLLM stands in for an environment without it.
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho \'{"distribution": null, "vllm_version": null}\'\n')
    fake.chmod(0o755)
    with pytest.raises(
        EngineConfigurationError, match=r"set VLLMRunner\(python=\.\.\.\) .*\(or command=\.\.\."
    ):
        probe_engine(str(fake))


def test_a_probe_killed_by_a_signal_is_a_retryable_engine_error_not_a_configuration_error(tmp_path):
    from airflow_vllm_batch.exceptions import EngineConfigurationError, EngineError

    # The chaos campaign (seed 2) SIGKILLed the probe's process: the task failed without retry
    # ("Could not ask the engine environment ... (exit -9)"), its retries unused and its batch unanswered.
    killed = tmp_path / "python"
    killed.write_text("#!/bin/sh\nkill -9 $$\n")
    killed.chmod(0o755)
    with pytest.raises(EngineError, match="was killed by signal 9") as err:
        probe_engine(str(killed))
    assert err.value.retryable
    assert not isinstance(err.value, EngineConfigurationError)


def test_run_streams_lines_redacted_and_returns_the_exit_code():
    script = f"print('Reading batch from {GET}...'); print('vLLM batch processing API version 9.9.9'); raise SystemExit(3)"
    lines: list[str] = []
    run = VLLMEngineHook().run([sys.executable, "-c", script], on_line=lines.append)
    assert run.returncode == 3
    assert run.vllm_version == "9.9.9"
    assert lines[0] == "Reading batch from http://127.0.0.1:8333/b/in%20put.jsonl?<redacted>"
    assert "abc123" not in "".join(run.tail)


def test_the_engines_lines_are_folded_in_one_log_group(capsys):
    VLLMEngineHook().run([sys.executable, "-c", "print('engine says hello')"])
    log = capsys.readouterr().out  # Airflow's structlog writes the task log here in tests
    assert (
        log.index("::group::vLLM engine output") < log.index("engine says hello") < log.index("::endgroup::")
    )


def test_the_engines_warnings_and_errors_keep_their_level_inside_the_group(capsys):
    script = (
        "print('(EngineCore pid=1) INFO 11-25 14:40:24 [core.py:1] loading'); "
        "print('(EngineCore pid=1) WARNING 11-25 14:40:24 [cpu.py:224] Triton is not installed.'); "
        "print('ERROR 11-25 14:40:25 [core.py:9] EngineCore failed')"
    )
    VLLMEngineHook().run([sys.executable, "-c", script])
    log = capsys.readouterr().out.splitlines()

    def level(text: str) -> str:
        """The level the line holding ``text`` was logged at: Airflow 3.1+'s structlog (``[info ...``) or 3.0's format (``} INFO -``)."""
        (line,) = [line for line in log if text in line]
        (found,) = re.findall(r"^\S*\s*\[(info|warning|error)\b|\} (INFO|WARNING|ERROR) - ", line)[:1] or [
            ("", "")
        ]
        return "".join(found).lower()

    assert level("loading") == "info"
    assert level("Triton is not installed") == "warning"
    assert level("EngineCore failed") == "error"


def test_terminate_kills_the_whole_process_group_children_included(tmp_path):
    pid_file = tmp_path / "child.pid"
    # A parent that ignores SIGTERM and a grandchild, like vLLM's frontend and EngineCore.
    script = textwrap.dedent(
        f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    hook = VLLMEngineHook(kill_grace_s=1)
    import threading

    done = threading.Event()

    def run():
        hook.run([sys.executable, "-c", script], on_line=lambda _: None)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    leader = hook.process.pid
    hook.terminate()
    assert done.wait(10)
    for pid in (leader, child):
        deadline = time.monotonic() + 5
        while _alive(pid):
            assert time.monotonic() < deadline, f"pid {pid} survived"
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes: only its parent's wait() is missing.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_concealed_arguments_reach_the_module_but_not_the_command_line(tmp_path):
    (tmp_path / "fake_runner.py").write_text(
        "import os, sys\n"
        "cmdline = open(f'/proc/{os.getpid()}/cmdline', 'rb').read()\n"
        "print('argv', sys.argv[1:])\n"
        "print('visible', b'abc123' in cmdline)\n"
        "print('env-left', 'AIRFLOW_VLLM_BATCH_ENGINE_ARGV' in os.environ)\n"
    )
    argv = build_engine_argv(input_location=GET, output_location=PUT, model="m", python=sys.executable)
    argv[2] = "fake_runner"  # stands in for vllm.entrypoints.launchers.run_batch
    launch, extra_env = conceal_arguments(argv)
    assert GET not in " ".join(launch)
    env = {**os.environ, **extra_env, "PYTHONPATH": str(tmp_path)}
    lines: list[str] = []
    run = VLLMEngineHook().run(launch, env=env, on_line=lines.append)
    assert run.returncode == 0, lines
    # The module got the real arguments (the log line shows them redacted).
    assert lines[0] == redact_urls("argv " + repr(["-i", GET, "-o", PUT, "--model", "m"]))
    assert lines[1:] == ["visible False", "env-left False"]


def test_run_returns_when_the_leader_dies_while_a_child_holds_the_log_pipe(tmp_path):
    pid_file = tmp_path / "child.pid"
    # The leader starts a child that inherits stdout (as EngineCore does), then is killed.
    script = textwrap.dedent(
        f"""
        import os, signal, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("engine up", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    started = time.monotonic()
    run = VLLMEngineHook(drain_s=1).run([sys.executable, "-c", script], on_line=lambda _: None)
    assert run.returncode == -9
    assert time.monotonic() - started < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child):
        assert time.monotonic() < deadline, "the child outlived the engine"
        time.sleep(0.05)


@pytest.mark.vllm
def test_the_probe_names_the_runner_module_the_engine_environment_has():
    info = probe_engine(sys.executable)
    # vLLM 0.32 keeps vllm.entrypoints.openai.run_batch only as a deprecated shim.
    assert info.runner_module == "vllm.entrypoints.launchers.run_batch"
    assert build_engine_argv(
        input_location="i", output_location="o", model="m", runner_module=info.runner_module
    )[1:3] == [
        "-m",
        "vllm.entrypoints.launchers.run_batch",
    ]


def test_terminate_from_on_kill_returns_while_the_interrupted_main_thread_holds_popens_wait_lock():
    import subprocess

    from airflow_vllm_batch.engines.vllm.process import start_bound_process
    from tests.processes import seconds_to_terminate_under_the_wait_lock

    hook = VLLMEngineHook(kill_grace_s=1)
    hook.process = start_bound_process(
        [sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL
    )
    assert seconds_to_terminate_under_the_wait_lock(hook.process, hook.terminate) < 5
    hook.process.wait(timeout=5)
    assert hook.process.returncode is not None


def test_what_an_engine_logs_while_the_task_stops_it_is_at_most_a_warning(caplog):
    import logging

    from airflow_vllm_batch.log_groups import HeldLines

    held = HeldLines()
    held.add("(APIServer pid=1) ERROR 11-25 15:08:33 [core.py:9] EngineCore died")
    held.add(
        "(APIServer pid=1) ERROR 11-25 15:08:33 [async_llm.py:906] AsyncLLM output_handler failed.",
        logging.WARNING,
    )
    log = logging.getLogger("test_held_lines")
    with caplog.at_level(logging.INFO, logger="test_held_lines"):
        held.flush(log, "server")
    levels = {record.getMessage(): record.levelno for record in caplog.records}
    assert levels["(APIServer pid=1) ERROR 11-25 15:08:33 [core.py:9] EngineCore died"] == logging.ERROR
    assert (
        levels["(APIServer pid=1) ERROR 11-25 15:08:33 [async_llm.py:906] AsyncLLM output_handler failed."]
        == logging.WARNING
    )
