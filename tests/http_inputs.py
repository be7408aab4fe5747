"""An http(s) batch input behind HTTP Basic authentication, and a watch on every process while an engine runs.

The input's URL carries its password (``http://reader:<password>@127.0.0.1:<port>/batches/in.jsonl``);
the tests assert that it never leaves the task for an engine (invariant *No secrets*).
"""

from __future__ import annotations

import base64
import http.server
import threading
from pathlib import Path


class BasicAuthInput:
    """An http server on 127.0.0.1 serving one batch file only to ``reader:<password>`` (401 otherwise).

    :ivar reads: the paths it served, one per read with the right credentials.
    """

    def __init__(self, data: bytes, password: str) -> None:
        self.reads: list[str] = []
        expected = "Basic " + base64.b64encode(f"reader:{password}".encode()).decode()
        reads = self.reads

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok = self.headers.get("Authorization") == expected
                self.send_response(200 if ok else 401)
                if not ok:
                    self.send_header("WWW-Authenticate", 'Basic realm="batches"')
                self.send_header("Content-Length", str(len(data) if ok else 0))
                self.end_headers()
                if ok:
                    reads.append(self.path)
                    self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://reader:{password}@127.0.0.1:{self.server.server_port}/batches/in.jsonl"

    def __enter__(self) -> BasicAuthInput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class SecretWatch:
    """Reads every process's command line, and the environment of the engine's processes, every 0.2 s until stopped.

    :param secret: what must appear in none of them.
    :param marker: a string only the engine's environment holds (its processes are found by it).
    :ivar leaks: where the secret was seen.
    :ivar engine_seen: the readings that found a process of the engine (0: it never ran while watched).
    """

    def __init__(self, secret: str, marker: str) -> None:
        self.secret, self.marker = secret.encode(), marker.encode()
        self.leaks: list[str] = []
        self.engine_seen = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="secret-watch", daemon=True)

    def watch(self) -> None:
        while not self.done.wait(0.2):
            engine = False
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:  # gone
                    continue
                if self.secret in cmdline:
                    self.leaks.append(f"command line of {entry.name}: {cmdline!r}")
                try:
                    environ = (entry / "environ").read_bytes()
                except OSError:  # gone, or another user's
                    continue
                if self.marker in environ:
                    engine = True
                    if self.secret in environ:
                        self.leaks.append(f"environment of engine process {entry.name}")
            self.engine_seen += engine

    def __enter__(self) -> SecretWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
