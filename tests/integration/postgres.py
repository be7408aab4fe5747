"""A throw-away PostgreSQL server for an Airflow deployment under test (Debian's ``postgresql``).

Airflow refuses backfill creation on SQLite under concurrent access ("Backfill creation
is not supported on SQLite under concurrent access. Please use PostgreSQL or MySQL", the
REST API's 503): it reads the latest DAG run and then clears it in one transaction, and
SQLite fails that transaction at once, whatever its busy timeout, when the scheduler
commits in between. A deployment that runs ``airflow backfill create`` while its scheduler
works therefore runs on PostgreSQL, as ``docker-compose.yaml`` does.

The cluster lives in a temporary directory, listens on a free loopback port (no Unix
socket), trusts local connections and is tuned for speed over durability (no fsync): it
holds nothing worth keeping. PostgreSQL refuses to run as root, so under root the server
runs as the ``postgres`` user the Debian package creates. :meth:`Postgres.stop` stops it
and deletes the directory.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from vllm_batch_embedded.seaweedfs import _free_ports

LOOPBACK = "127.0.0.1"
DATABASE = "airflow"
#: What to tell someone whose machine lacks the server.
MISSING = "PostgreSQL's server binaries (initdb, postgres) are missing: run `make system-deps` (Debian package postgresql)."


def server_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<major>/bin`` with ``initdb`` in it, or None."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name)
    )
    return Path(found[-1]).parent if found else None


class Postgres:
    """One PostgreSQL cluster with an ``airflow`` database; a context manager.

    :param startup_timeout_s: how long to wait for the server to accept connections.
    """

    def __init__(self, startup_timeout_s: float = 60) -> None:
        bin_dir = server_bin_dir()
        if bin_dir is None:
            raise RuntimeError(MISSING)
        self.bin_dir = bin_dir
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self._root: Path | None = None
        self._process: subprocess.Popen | None = None
        # initdb and postgres will not run as root; the package's own user owns the cluster.
        self._user = "postgres" if os.geteuid() == 0 else None

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the ``airflow`` database (psycopg2; Airflow derives asyncpg from it)."""
        return f"postgresql+psycopg2://airflow@{LOOPBACK}:{self.port}/{DATABASE}"

    def _run(self, *argv: str) -> None:
        done = subprocess.run(argv, check=False, user=self._user, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )

    def start(self) -> Postgres:
        """Create the cluster, start the server and create the database."""
        self._root = Path(tempfile.mkdtemp(prefix="airflow-vllm-batch-pg-"))
        data = self._root / "data"
        if self._user:
            entry = pwd.getpwnam(self._user)
            os.chown(self._root, entry.pw_uid, entry.pw_gid)
        self._run(
            str(self.bin_dir / "initdb"),
            "-D",
            str(data),
            "-U",
            "airflow",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        )
        (self.port,) = _free_ports(1)
        settings = {
            "listen_addresses": LOOPBACK,
            "port": str(self.port),
            "unix_socket_directories": "",
            # Throw-away data: durability costs time on a busy machine and buys nothing here.
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
        }
        argv = [str(self.bin_dir / "postgres"), "-D", str(data)]
        for name, value in settings.items():
            argv += ["-c", f"{name}={value}"]
        log = open(self._root / "postgres.log", "ab")  # noqa: SIM115 - closed once handed to the server
        try:
            self._process = subprocess.Popen(
                argv,
                user=self._user,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        self._wait_ready()
        self._run(
            str(self.bin_dir / "createdb"), "-h", LOOPBACK, "-p", str(self.port), "-U", "airflow", DATABASE
        )
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"postgres exited with code {self._process.returncode}:\n{self.log()[-3000:]}"
                )
            ready = subprocess.run(
                [str(self.bin_dir / "pg_isready"), "-h", LOOPBACK, "-p", str(self.port), "-q"],
                check=False,
                capture_output=True,
                timeout=30,
            )
            if ready.returncode == 0:
                return
            time.sleep(0.3)
        raise RuntimeError(
            f"postgres did not accept connections within {self.startup_timeout_s:.0f}s:\n{self.log()[-3000:]}"
        )

    def log(self) -> str:
        """The server's output so far."""
        try:
            return (self._root / "postgres.log").read_text(errors="replace") if self._root else ""
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server (a fast shutdown: SIGINT) and delete its directory."""
        if self._process is not None and self._process.poll() is None:
            # SIGINT is PostgreSQL's "fast" shutdown: it ends client sessions and exits.
            self._process.send_signal(signal.SIGINT)
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        self._process = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __enter__(self) -> Postgres:
        try:
            return self.start()
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise

    def __exit__(self, *exc_info) -> None:
        self.stop()
