"""The server engine's client cost: CPU per request of our stream against a bare aiohttp loop.

Against a local server that answers at once (so only the client is timed), running as a
separate process, this sends the same short chat requests

* ``stream``: through :func:`airflow_vllm_batch.serving.run_stream` with a real
  :class:`~airflow_vllm_batch.serving.Journal` in a temporary directory, as the server
  engine uses it, and
* ``bare``: through a bare ``aiohttp`` loop that posts the same bodies with the same
  bound on requests in flight and reads each answer (no parsing, no journal),

alternating the two (A B A B ...) so that drift of a noisy machine hits both alike. Each
run is a fresh client process; its CPU is its user + system time (all its threads and
its worker processes), divided by the requests. It prints the medians of the runs: CPU
microseconds per request, requests per second, and the ratio stream ÷ bare.

``--processes 1,2`` runs the stream (and the bare loop) also spread over that many client
processes, each sending a disjoint slice of the lines (line number modulo N) with its own
session and its own journal, as a multi-process client would; requests/s is then the
whole batch over the wall time of the slowest worker.

``--clients engine --processes 1,2`` times the server engine's own multi-process path
instead: :func:`airflow_vllm_batch.serving.run_stream` for 1 and
:func:`airflow_vllm_batch.serving.processes.run_stream_processes` for N (spawned workers fed
by the client process, each sealed part adopted by its journal, as with
``client_processes=N``; only the S3 upload of the parts is left out). Its requests/s
include starting the workers.

``--baseline DIR`` adds a third client, ``stream@base``: the stream as imported from
another checkout (e.g. ``git worktree add /tmp/base <commit>``), for before/after figures
measured side by side; nothing of it is kept.

Usage::

    .venv/bin/python benchmarks/client_overhead.py [--requests 20000] [--in-flight 256] [--runs 3]
        [--processes 1,2] [--baseline /tmp/base] [--clients stream,bare]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: What the instant server answers to every POST: a short chat completion with usage, as vLLM would.
ANSWER = json.dumps(
    {
        "id": "chatcmpl-0123456789abcdef",
        "object": "chat.completion",
        "created": 1764000000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi! How can I help?"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
    },
    separators=(",", ":"),
).encode()


# -- the instant server (its own process) ----------------------------------------------


#: ``--answer embedding``: what a small embedding model answers (384 floats, as MiniLM/bge-small), the
#: case that needs more than one client core: the client copies and scans a ~8 KB body per request.
EMBEDDING = json.dumps(
    {
        "id": "embd-0123456789abcdef",
        "object": "list",
        "created": 1764000000,
        "model": "m",
        "data": [
            {
                "index": 0,
                "object": "embedding",
                "embedding": [round(0.001 * ((i * 7919) % 2000) - 1, 6) for i in range(384)],
            }
        ],
        "usage": {"prompt_tokens": 9, "total_tokens": 9, "completion_tokens": 0},
    },
    separators=(",", ":"),
).encode()


class _Instant(asyncio.Protocol):
    """HTTP/1.1 keep-alive on a bare asyncio protocol: read a request, answer ``ANSWER`` at once.

    Not aiohttp.web: its per-request cost (~100 µs) would take much of a 2-core machine
    from the clients being measured.
    """

    response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(ANSWER)
        + ANSWER
    )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        answers = 0
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                break
            head = self.buffer[:end].lower()
            at = head.find(b"content-length:")
            length = (
                int(head[at + 15 : head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None])
                if at >= 0
                else 0
            )
            if len(self.buffer) < end + 4 + length:
                break
            self.buffer = self.buffer[end + 4 + length :]
            answers += 1
        if answers:
            self.transport.write(self.response * answers)  # type: ignore[attr-defined]


def serve(port: int, answer: str = "chat") -> None:
    """Run the instant server on 127.0.0.1:``port`` until killed, answering ``answer`` (chat or embedding)."""
    if answer == "embedding":
        _Instant.response = (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % len(EMBEDDING)
            + EMBEDDING
        )

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Instant, "127.0.0.1", port, backlog=4096)
        print("ready", flush=True)
        await server.serve_forever()

    asyncio.run(main())


# -- the clients (each run a process of its own) ----------------------------------------


def request_lines(n: int) -> list[tuple[int, bytes]]:
    """``n`` short chat request lines, numbered from 1 as the engine numbers input lines."""
    return [
        (
            i + 1,
            b'{"custom_id":"request-%d","method":"POST","url":"/v1/chat/completions","body":'
            b'{"model":"m","messages":[{"role":"user","content":"Say hello to number %d."}],"max_tokens":8}}'
            % (i, i),
        )
        for i in range(n)
    ]


def _stream_worker(base_url: str, lines: list[tuple[int, bytes]], in_flight: int, work: str) -> int:
    from airflow_vllm_batch.serving import Journal, run_stream

    journal = Journal(Path(work))
    stats = run_stream(
        lines, base_url=base_url, api_key="bench-key", journal=journal, max_in_flight=in_flight
    )
    return stats.done


def _bare_worker(base_url: str, lines: list[tuple[int, bytes]], in_flight: int, work: str) -> int:
    import aiohttp

    bodies = [line[line.index(b'"body":') + 7 : -1] for _, line in lines]
    url = base_url + "/v1/chat/completions"
    headers = {"Content-Type": "application/json", "Authorization": "Bearer bench-key"}

    async def main() -> int:
        done = 0
        todo = iter(bodies)
        connector = aiohttp.TCPConnector(limit=in_flight, limit_per_host=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def worker() -> None:
                nonlocal done
                for body in todo:
                    async with session.post(url, data=body, headers=headers) as response:
                        await response.read()
                    done += 1

            await asyncio.gather(*(worker() for _ in range(in_flight)))
        return done

    return asyncio.run(main())


def _engine_client(
    base_url: str, lines: list[tuple[int, bytes]], in_flight: int, work: str, processes: int
) -> int:
    """The server engine's stream as ``client_processes=processes`` runs it (checkpoint parts kept locally)."""
    from airflow_vllm_batch.serving import Journal, run_stream
    from airflow_vllm_batch.serving.processes import run_stream_processes

    journal = Journal(Path(work) / "journal")
    stream = {"base_url": base_url, "api_key": "bench-key", "journal": journal, "max_in_flight": in_flight}
    if processes == 1:
        return run_stream(lines, **stream).done
    return run_stream_processes(lines, processes=processes, **stream).done


_WORKERS = {"stream": _stream_worker, "stream@base": _stream_worker, "bare": _bare_worker}


def _slice_worker(
    client: str, base_url: str, lines: list, in_flight: int, work: str, out: multiprocessing.Queue
) -> None:
    out.put(_WORKERS[client](base_url, lines, in_flight, work))


def client_run(client: str, port: int, requests: int, in_flight: int, processes: int) -> dict[str, float]:
    """One timed run in this process (and, for ``processes`` > 1, its workers); returns the figures."""
    base_url = f"http://127.0.0.1:{port}"
    lines = request_lines(requests)
    # Imports are not the client's per-request cost: load them before the clock starts.
    import aiohttp  # noqa: F401

    import airflow_vllm_batch.serving  # noqa: F401

    with tempfile.TemporaryDirectory(prefix="client-overhead-") as work:
        before = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        started = time.perf_counter()
        if client == "engine":
            done = _engine_client(base_url, lines, in_flight, work, processes)
        elif processes == 1:
            done = _WORKERS[client](base_url, lines, in_flight, work)
        else:
            # One connection pool and one journal per worker, each on its own slice, as the engine would.
            context = multiprocessing.get_context("fork")
            out = context.Queue()
            workers = [
                context.Process(
                    target=_slice_worker,
                    args=(
                        client,
                        base_url,
                        [line for line in lines if line[0] % processes == k],
                        in_flight // processes,
                        f"{work}/{k}",
                        out,
                    ),
                )
                for k in range(processes)
            ]
            for worker in workers:
                worker.start()
            done = sum(out.get() for _ in workers)
            for worker in workers:
                worker.join()
        wall = time.perf_counter() - started
        after = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum((a.ru_utime + a.ru_stime) - (b.ru_utime + b.ru_stime) for a, b in zip(after, before))
    if done != requests:
        raise SystemExit(f"{client}: {done} of {requests} requests answered")
    return {"cpu_us_per_request": cpu / requests * 1e6, "requests_per_s": requests / wall, "wall_s": wall}


# -- the driver -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_client(client: str, port: int, args: argparse.Namespace, processes: int) -> dict[str, float]:
    tree = args.baseline if client == "stream@base" else str(REPO)
    env = {**os.environ, "PYTHONPATH": tree}
    argv = [
        sys.executable,
        __file__,
        "--client",
        client,
        "--port",
        str(port),
        "--requests",
        str(args.requests),
    ]
    argv += ["--in-flight", str(args.in_flight), "--processes", str(processes)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"client {client} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--processes", default="1", help="client process counts to compare, e.g. 1,2")
    parser.add_argument("--baseline", help="another checkout whose stream to time too (stream@base)")
    parser.add_argument(
        "--clients",
        default="stream,bare",
        help="clients to time: stream, bare, engine (the engine's multi-process path)",
    )
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--answer", default="chat", choices=("chat", "embedding"), help="what the instant server answers"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.serve:
        serve(args.port, args.answer)
        return
    if args.client:
        # A client run: import the stream from the tree the driver chose (PYTHONPATH), not from the venv.
        sys.path.insert(0, os.environ["PYTHONPATH"])
        print(
            json.dumps(client_run(args.client, args.port, args.requests, args.in_flight, int(args.processes)))
        )
        return

    counts = [int(n) for n in args.processes.split(",")]
    clients = args.clients.split(",") + (["stream@base"] if args.baseline else [])
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--port", str(port), "--answer", args.answer],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        runs: dict[tuple[str, int], list[dict[str, float]]] = {(c, n): [] for n in counts for c in clients}
        for _ in range(args.runs):
            for n in counts:
                for client in clients:
                    runs[client, n].append(_run_client(client, port, args, n))
    finally:
        server.terminate()
        server.wait(10)

    def median(client: str, n: int, key: str) -> float:
        return statistics.median(run[key] for run in runs[client, n])

    print(
        f"{args.requests} short requests, {args.answer} answers, {args.in_flight} in flight, instant local server; median of {args.runs} alternating run(s)"
    )
    # The least CPU of the runs too: on a shared machine, other processes only ever add to a run's CPU time.
    print(f"{'client':<12}{'processes':>10}{'CPU µs/request':>16}{'requests/s':>12}{'least µs/request':>18}")
    for n in counts:
        for client in clients:
            least = min(run["cpu_us_per_request"] for run in runs[client, n])
            print(
                f"{client:<12}{n:>10}{median(client, n, 'cpu_us_per_request'):>16.0f}"
                f"{median(client, n, 'requests_per_s'):>12.0f}{least:>18.0f}"
            )
    for n in counts if {"stream", "bare"} <= set(clients) else ():
        ratio = median("stream", n, "cpu_us_per_request") / median("bare", n, "cpu_us_per_request")
        line = f"ratio stream ÷ bare, {n} process(es): CPU per request {ratio:.2f}"
        if args.baseline:
            base = median("stream@base", n, "cpu_us_per_request") / median("bare", n, "cpu_us_per_request")
            line += f" (stream@base ÷ bare {base:.2f})"
        print(line)
    if len(counts) > 1:
        one, most = counts[0], counts[-1]
        for client in clients:
            gain = median(client, most, "requests_per_s") / median(client, one, "requests_per_s")
            print(f"{client} requests/s, {most} processes ÷ {one}: {gain:.2f}")


if __name__ == "__main__":
    main()
