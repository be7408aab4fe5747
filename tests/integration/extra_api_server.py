"""Another ``airflow api-server`` beside a running deployment: the same database, DAGs and S3, a configuration of its own.

What an operator's restart of the API server with a new configuration makes (a rotated
signing key, per-user limits, more users), without stopping the deployment the module
shares: :func:`extra_api_server` starts one more ``airflow api-server`` process from the
deployment's environment plus some options, on a port of its own, and stops it (with its
workers) at the end. Its users log in to it and get tokens it issued.

With ``clock_offset_s`` it runs under libfaketime (Debian's ``faketime``; ``make
system-deps`` installs it): the real app with a clock that many seconds ahead (or behind),
so that a batch's ``expires_at`` passes without waiting for its window (at least an hour):
ahead, a batch created on the real clock is past its window there; behind by a little
less than the window, a batch it creates expires a few seconds later for everyone else. SeaweedFS
refuses an S3 request signed more than 15 minutes off its own clock
(``RequestTimeTooSkewed``), so that server reaches S3 through :class:`ResigningS3Proxy`,
which signs each request again with the real clock and forwards it unchanged otherwise.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
from openai import OpenAI

from airflow_vllm_batch.openai_api.settings import URL_PREFIX
from vllm_batch_embedded.airflow_deployment import LOOPBACK, Deployment, signal_group, wait_until
from vllm_batch_embedded.seaweedfs import SeaweedFS, _free_ports

#: libfaketime's preload library (Debian's ``libfaketime``, pulled in by ``faketime``), under the machine's multiarch directory.
LIBFAKETIME = next(
    iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))),
    Path("/usr/lib/faketime/libfaketime.so.1"),
)
#: Compiled and preloaded before libfaketime when the monotonic clock is not faked (see the file).
SLEEP_FIX_SOURCE = Path(__file__).resolve().parents[2] / "benchmarks" / "monotonic_sleep_fix.c"


class FaketimeUnavailable(RuntimeError):
    """libfaketime is not installed, or its sleep fix does not compile here; the message says what to install."""


def faketime_preload(work: Path) -> str:
    """``LD_PRELOAD`` for a process whose wall clock libfaketime moves while its monotonic clock does not.

    libfaketime 0.9.10 (Debian's) fails every ``time.sleep`` of Python 3.11 with ``EINVAL`` when
    ``FAKETIME_DONT_FAKE_MONOTONIC`` is set, at any offset (wolfcw/libfaketime#426), so
    :data:`SLEEP_FIX_SOURCE` is compiled into ``work`` (``cc``) and goes before it. A preload of
    the caller's environment stays first.

    :param work: a directory of the caller's for the compiled library.
    :raises FaketimeUnavailable: with what to install (``make system-deps`` installs both).
    """
    if not LIBFAKETIME.exists():
        raise FaketimeUnavailable(f"{LIBFAKETIME} is missing: install Debian's faketime (make system-deps)")
    fix = work / "monotonic_sleep_fix.so"
    built = subprocess.run(
        ["cc", "-shared", "-fPIC", "-O2", "-o", str(fix), str(SLEEP_FIX_SOURCE), "-ldl"],
        capture_output=True,
        text=True,
        check=False,
    )
    if built.returncode != 0:
        raise FaketimeUnavailable(
            f"compiling {SLEEP_FIX_SOURCE.name} failed ({built.stderr.strip()[-500:]}): "
            "install a C compiler (make system-deps)"
        )
    return " ".join(p for p in (os.environ.get("LD_PRELOAD"), str(fix), str(LIBFAKETIME)) if p)


#: Headers the proxy does not pass on: the signature (made again), and the hop's own.
_DROPPED = {"authorization", "x-amz-date", "x-amz-content-sha256", "host", "connection", "content-length"}


class ResigningS3Proxy:
    """An S3 endpoint on loopback that signs each request again (SigV4, the real clock) and forwards it to SeaweedFS.

    For a client whose clock is moved: its own signature carries its own time, which
    SeaweedFS refuses. Requests and answers are read whole (the API's S3 calls here are
    small: records, listings, a result file).

    :param s3: the SeaweedFS to forward to (its keys sign the forwarded requests).
    """

    def __init__(self, s3: SeaweedFS) -> None:
        from botocore.auth import S3SigV4Auth
        from botocore.credentials import Credentials

        self.s3 = s3
        self.upstream = urllib.parse.urlsplit(s3.endpoint_url)
        signer = S3SigV4Auth(Credentials(s3.access_key, s3.secret_key), "s3", s3.region)
        upstream = self.upstream

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                from botocore.awsrequest import AWSRequest

                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _DROPPED}
                request = AWSRequest(
                    method=self.command,
                    url=f"{upstream.scheme}://{upstream.netloc}{self.path}",
                    data=body,
                    headers=headers,
                )
                signer.add_auth(request)
                connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=60)
                try:
                    connection.request(
                        self.command, self.path, body=body, headers=dict(request.headers.items())
                    )
                    answer = connection.getresponse()
                    data = answer.read()
                finally:
                    connection.close()
                self.send_response(answer.status, answer.reason)
                for name, value in answer.getheaders():
                    if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

            def log_message(self, format: str, *args: object) -> None:
                """Quiet: a query string may hold a presigned URL's signature."""

        (port,) = _free_ports(1)
        self.server = ThreadingHTTPServer((LOOPBACK, port), Handler)
        self.endpoint_url = f"http://{LOOPBACK}:{port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def connection_json(self) -> str:
        """The Airflow AWS connection of SeaweedFS's, pointed at this proxy."""
        conn = json.loads(self.s3.airflow_connection_json())
        conn["extra"]["endpoint_url"] = self.endpoint_url
        return json.dumps(conn)

    def __enter__(self) -> ResigningS3Proxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class ExtraApiServer:
    """One more API server of a deployment.

    :param name: its name (its log is ``<home>/<name>.log``).
    :param api_url: ``http://127.0.0.1:<port>``.
    :param process: the ``airflow api-server`` process (leader of its own session).
    :param home: the deployment's ``AIRFLOW_HOME``.
    """

    name: str
    api_url: str
    process: subprocess.Popen
    home: Path

    def token(self, user: str) -> str:
        """A token this server issues to ``user`` (the simple auth manager's password file of the deployment)."""
        password = json.loads((self.home / "passwords.json").read_text())[user]
        probe = Deployment(home=self.home, api_url=self.api_url, env={})
        return probe.request("POST", "/auth/token", {"username": user, "password": password})["access_token"]

    def client(self, user: str, max_retries: int = 0) -> OpenAI:
        """The unmodified SDK, as ``user``, against this server's OpenAI API."""
        return OpenAI(
            base_url=self.api_url + URL_PREFIX, api_key=self.token(user), max_retries=max_retries, timeout=60
        )

    def log(self) -> str:
        return (self.home / f"{self.name}.log").read_text(errors="replace")


def start_api_server(
    dep: Deployment,
    name: str,
    options: Mapping[str, str],
    clock_offset_s: int = 0,
    s3_connection: str | None = None,
) -> ExtraApiServer:
    """Start one more ``airflow api-server`` of ``dep`` (not waited for: :func:`wait_ready`).

    :param dep: the running deployment (its database, DAGs and S3).
    :param name: the process's name, for its log file.
    :param options: environment variables that differ from the deployment's (``AIRFLOW__VLLM_BATCH__...``).
    :param clock_offset_s: seconds to move its clock by (libfaketime), ahead or (negative) behind; 0 for the real clock.
    :param s3_connection: the ``aws_default`` connection it uses instead of the deployment's.
    """
    (port,) = _free_ports(1)
    env = {
        **dep.env,
        **options,
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://{LOOPBACK}:{port}",
    }
    if s3_connection is not None:
        env["AIRFLOW_CONN_AWS_DEFAULT"] = s3_connection
    if clock_offset_s:
        # Only the wall clock moves: timers and timeouts (monotonic) keep their pace.
        env.update(
            {
                "LD_PRELOAD": faketime_preload(dep.home),
                "FAKETIME": f"{clock_offset_s:+d}",
                "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            }
        )
    airflow = str(Path(sys.executable).with_name("airflow"))
    with open(dep.home / f"{name}.log", "ab") as log:
        process = subprocess.Popen(
            [airflow, "api-server", "--host", LOOPBACK, "--port", str(port), "--workers", "1"],
            env=env,
            cwd=dep.home,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return ExtraApiServer(name, f"http://{LOOPBACK}:{port}", process, dep.home)


def wait_ready(server: ExtraApiServer, timeout: float = 240) -> None:
    """Wait until ``server`` answers its health check; raise with its log if it exits first."""

    def ready() -> bool:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{server.name} exited with {server.process.returncode}:\n{server.log()[-3000:]}"
            )
        probe = Deployment(home=server.home, api_url=server.api_url, env={})
        return bool(probe.request("GET", "/api/v2/monitor/health", timeout=5))

    wait_until(f"the API server {server.name}", ready, timeout, interval=0.5)


def stop(server: ExtraApiServer) -> None:
    """Stop ``server`` and its workers (its session)."""
    try:
        tracked = [
            psutil.Process(server.process.pid),
            *psutil.Process(server.process.pid).children(recursive=True),
        ]
    except psutil.Error:
        tracked = []
    signal_group(server.process.pid, 15)
    _, alive = psutil.wait_procs(tracked, timeout=20)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.process.wait(timeout=10)


@contextlib.contextmanager
def extra_api_servers(
    dep: Deployment, s3: SeaweedFS, configs: Mapping[str, Mapping]
) -> Iterator[dict[str, ExtraApiServer]]:
    """Start several API servers of ``dep`` at once (their start-ups overlap), each of its own configuration; stop them at the end.

    :param configs: name -> ``{"options": {...}, "clock_offset_s": n}``.
    """
    started: dict[str, ExtraApiServer] = {}
    with contextlib.ExitStack() as stack:
        try:
            for name, config in configs.items():
                offset = int(config.get("clock_offset_s") or 0)
                connection = stack.enter_context(ResigningS3Proxy(s3)).connection_json() if offset else None
                started[name] = start_api_server(dep, name, config.get("options") or {}, offset, connection)
            for server in started.values():
                wait_ready(server)
            yield started
        finally:
            for server in started.values():
                stop(server)
