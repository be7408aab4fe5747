"""Unit tests of the server hook and the server process, against stand-ins (no vLLM)."""

from __future__ import annotations

import http.server
import json
import os
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_vllm_batch.engines.vllm.server_process import (
    API_KEY_ENV,
    SERVER_MODULE,
    VLLMServerProcess,
    build_server_argv,
)
from airflow_vllm_batch.exceptions import EngineError
from airflow_vllm_batch.hooks.vllm import VLLMServerHook
from airflow_vllm_batch.serving import (
    ModelNotServedError,
    ServerAuthError,
    ServerUnavailableError,
)

KEY = "unit-test-api-key"
MODEL = "/models/tiny-llama-chat"


class _Models(http.server.BaseHTTPRequestHandler):
    """``/health`` for anyone, ``/v1/models`` only with the key."""

    def do_GET(self) -> None:
        if self.path == "/health":
            return self._send(200, b"")
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._send(401, b'{"error":"Unauthorized"}')
        self._send(200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode())

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def models_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def vllm_connection(monkeypatch) -> None:
    conn = {"conn_type": "vllm", "host": "gpu-node-1", "port": 8000, "schema": "https", "password": KEY}
    monkeypatch.setenv("AIRFLOW_CONN_VLLM_DEFAULT", json.dumps(conn))


def test_the_connection_gives_the_url_and_the_key(vllm_connection):
    hook = VLLMServerHook()
    assert hook.base_url == "https://gpu-node-1:8000"
    assert hook.api_key == KEY


def test_max_in_flight_comes_from_the_connections_extra(monkeypatch):
    conn = {"conn_type": "vllm", "host": "lb", "extra": {"max_in_flight": "1024"}}
    monkeypatch.setenv("AIRFLOW_CONN_LB", json.dumps(conn))
    assert VLLMServerHook("lb").max_in_flight == 1024
    assert VLLMServerHook(base_url="http://127.0.0.1:1").max_in_flight is None


def test_the_scheme_defaults_to_http_and_a_host_may_carry_its_own(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_PLAIN", json.dumps({"conn_type": "vllm", "host": "node"}))
    monkeypatch.setenv(
        "AIRFLOW_CONN_FULL", json.dumps({"conn_type": "vllm", "host": "https://lb.example.com/v1/"})
    )
    assert VLLMServerHook("plain").base_url == "http://node"
    assert VLLMServerHook("full").base_url == "https://lb.example.com"
    assert VLLMServerHook("plain").api_key is None


def test_the_api_key_is_registered_with_the_secrets_masker(vllm_connection):
    from tests.airflow_compat import redact

    assert redact(f"key={VLLMServerHook().api_key}") == "key=***"


def test_the_form_hides_login_and_calls_the_password_api_key():
    behaviour = VLLMServerHook.get_ui_field_behaviour()
    assert "login" in behaviour["hidden_fields"]
    assert behaviour["relabeling"]["password"] == "API Key"
    assert VLLMServerHook.conn_type == "vllm"
    assert VLLMServerHook.default_conn_name == "vllm_default"


def test_served_models_lists_the_model_ids(models_server):
    hook = VLLMServerHook(base_url=models_server, api_key=KEY)
    assert hook.health() is True
    assert hook.served_models() == [MODEL]
    hook.check_serves(MODEL)


def test_check_serves_names_the_models_the_server_does_serve(models_server):
    hook = VLLMServerHook(base_url=models_server, api_key=KEY)
    with pytest.raises(ModelNotServedError, match=f"does not serve model 'nope'; it serves '{MODEL}'"):
        hook.check_serves("nope")


def test_a_wrong_api_key_is_a_clear_error_that_does_not_show_it(models_server):
    hook = VLLMServerHook(base_url=models_server, api_key="wrong-key-12345")
    with pytest.raises(ServerAuthError, match="refused the API key") as raised:
        hook.served_models()
    assert "wrong-key-12345" not in str(raised.value)
    assert hook.test_connection()[0] is False


def test_an_unreachable_server_is_unhealthy_and_unavailable():
    hook = VLLMServerHook(base_url="http://127.0.0.1:9")
    assert hook.health() is False
    with pytest.raises(ServerUnavailableError, match=r"127.0.0.1:9"):
        hook.served_models()


def test_the_server_argv_runs_the_api_server_module_without_its_access_log():
    argv = build_server_argv("m", host="127.0.0.1", port=8123, engine_args=["--enforce-eager"])
    assert argv == [
        sys.executable, "-m", SERVER_MODULE, "--model", "m", "--host", "127.0.0.1", "--port", "8123",
        "--disable-uvicorn-access-log", "--enforce-eager",
    ]  # fmt: skip
    assert "--disable-uvicorn-access-log" not in build_server_argv(
        "m", host="h", port=1, engine_args=["--enable-uvicorn-access-log"]
    )


# A stand-in for vLLM's server: prints what vLLM would (a URL with a query string, and
# here also its key, which vLLM itself masks), binds --port before anything slow (as vLLM's
# setup_server does: a taken port fails with "[Errno 98] Address already in use"), then
# serves /health to anyone and /v1/... only with the key (vLLM's auth middleware).
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, json, os, sys, time
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    key = os.environ["VLLM_API_KEY"]
    print("loading from http://s3.example/b/k?X-Amz-Signature=secret123", flush=True)
    print("key is " + key, flush=True)
    if "--fail" in args:
        print("CUDA out of memory", flush=True)
        sys.exit(3)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/health":
                print("served " + self.path, flush=True)
            if self.path.startswith("/v1") and self.headers.get("Authorization") != "Bearer " + key:
                self.send_response(401); self.send_header("Content-Length", "0"); self.end_headers()
                return
            body = json.dumps({"data": [{"id": "m"}]}).encode() if self.path == "/v1/models" else b""
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    httpd = http.server.HTTPServer(("127.0.0.1", port), H)
    if "--slow" in args:
        time.sleep(60)
    print(os.getpid(), flush=True)
    httpd.serve_forever()
    """
)


@pytest.fixture
def fake_server(tmp_path: Path) -> list[str]:
    script = tmp_path / "fake_vllm_server.py"
    script.write_text(FAKE_SERVER)
    return [sys.executable, str(script)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except OSError:
        return False
    return state != "Z"


def test_a_started_server_is_ready_logged_redacted_and_stopped_with_its_group(fake_server, capsys):
    with VLLMServerProcess("m", server_command=fake_server) as server:
        assert server.hook.health()
        assert server.time_to_ready_s is not None
        assert server.hook.base_url.startswith("http://127.0.0.1:")
        key = server.hook.api_key
        deadline = time.monotonic() + 5
        while not any(line.isdigit() for line in server.tail) and time.monotonic() < deadline:
            time.sleep(0.05)  # the log pump may lag behind readiness
        engine_pid = int(next(line for line in server.tail if line.isdigit()))
        guard_pid = server.process.pid
    assert not _alive(engine_pid)
    assert not _alive(guard_pid)
    log = capsys.readouterr().out  # Airflow's structlog writes the task log here in tests
    assert "X-Amz-Signature=secret123" not in log
    assert "?<redacted>" in log
    assert log.index("::group::vLLM server start-up") < log.index("?<redacted>") < log.index("::endgroup::")
    assert key not in log
    assert "key is ***" in log


def test_the_api_key_is_not_on_the_command_line(fake_server):
    with VLLMServerProcess("m", server_command=fake_server) as server:
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
        assert server.hook.api_key.encode() not in cmdline
        assert (
            API_KEY_ENV.encode() + b"=" + server.hook.api_key.encode()
            in Path(f"/proc/{server.process.pid}/environ").read_bytes()
        )


def test_a_server_that_exits_during_start_up_fails_fast_with_its_last_lines(fake_server):
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"exited during start-up \(exit 3\)(.|\n)*CUDA out of memory"):
        VLLMServerProcess("m", server_command=fake_server, engine_args=["--fail"]).start()
    assert time.monotonic() - started < 10


def test_a_server_not_ready_in_time_is_stopped(fake_server):
    server = VLLMServerProcess("m", server_command=fake_server, engine_args=["--slow"], startup_timeout_s=1)
    with pytest.raises(EngineError, match="not healthy after 1s"):
        server.start()
    assert server.process.poll() is not None


def test_terminate_without_a_server_does_nothing():
    VLLMServerProcess("m").terminate()


def test_the_engine_gets_the_callers_environment(fake_server, monkeypatch):
    server = VLLMServerProcess("m", server_command=fake_server, env={**os.environ, "EXTRA": "1"})
    with server:
        environ = Path(f"/proc/{server.process.pid}/environ").read_bytes()
    assert b"EXTRA=1" in environ


def test_start_up_lines_are_one_group_and_lines_while_serving_are_logged_as_another_at_stop(
    fake_server, capsys
):
    with VLLMServerProcess("m", server_command=fake_server) as server:
        with urllib.request.urlopen(server.hook.base_url + "/ping", timeout=5):
            pass
        deadline = time.monotonic() + 5
        while "served /ping" not in server.tail and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "served /ping" not in capsys.readouterr().out  # held: the task's progress lines stay unfolded
    log = capsys.readouterr().out
    serving = log.index("::group::vLLM server log while serving (")
    assert serving < log.index("served /ping") < log.rindex("::endgroup::")


@pytest.fixture
def foreign_server() -> Iterator[int]:
    """Someone else's server on a loopback port: ``/health`` for anyone, ``/v1/models`` refused without *its* key."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_foreign_server_that_took_the_port_is_not_taken_for_ours_and_ours_starts_on_another_port(
    fake_server, foreign_server, monkeypatch, capsys
):
    import airflow_vllm_batch.engines.vllm.server_process as vllm_server

    ports = iter([foreign_server])
    real_free_port = vllm_server.free_port
    monkeypatch.setattr(vllm_server, "free_port", lambda host: next(ports, None) or real_free_port(host))
    with VLLMServerProcess("m", server_command=fake_server) as server:
        assert not server.hook.base_url.endswith(f":{foreign_server}")
        assert server.hook.served_models() == ["m"]  # our key works: it is our server
    assert f"Port {foreign_server} was taken before the vLLM server bound it" in capsys.readouterr().out


def test_a_given_port_that_is_taken_fails_fast_naming_it(fake_server, foreign_server):
    started = time.monotonic()
    with pytest.raises(
        EngineError, match=rf"could not listen on 127.0.0.1:{foreign_server}: another process holds"
    ):
        VLLMServerProcess("m", server_command=fake_server, port=foreign_server).start()
    assert time.monotonic() - started < 15


def test_terminate_from_on_kill_returns_while_the_interrupted_main_thread_holds_popens_wait_lock(fake_server):
    from tests.processes import seconds_to_terminate_under_the_wait_lock

    server = VLLMServerProcess("m", server_command=fake_server, grace_s=1)
    server.start()
    guard = server.process
    assert seconds_to_terminate_under_the_wait_lock(guard, server.terminate) < 10
    guard.wait(timeout=5)
    assert guard.returncode is not None
