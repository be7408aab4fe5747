"""The server engine inside VLLMBatchOperator: warm-server tasks against runner tasks, and operator-side memory.

``tasks``: five operator tasks of N chat requests each (tiny model, CPU, real SeaweedFS),
first as five runner tasks (each starts vLLM's batch runner), then as five tasks through
one warm vLLM server (started once, before the first, its start counted in the total),
and prints each total wall time, their ratio and each task's share of wall time spent
answering requests (the manifest's ``engine_duration_s`` over the task's ``duration_s``).

``rss``: the operator's peak RSS (``VmHWM`` of a child process that runs one task)
for each size, through a stand-in server in *this* process (so the server's own memory is
not counted, and the figure is the operator's: preflight, stream, journal, checks).

Usage::

    .venv/bin/python benchmarks/server_engine.py tasks [--requests 2000] [--tasks 5]
    .venv/bin/python benchmarks/server_engine.py rss [--sizes 10000,100000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "dags"))  # the example settings live beside the example DAGs
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="vllm-batch-bench-airflow-"))

import vllm_batch_examples as examples  # noqa: E402

from airflow_vllm_batch.engines import VLLMRunner, WarmVLLMServer  # noqa: E402
from vllm_batch_embedded.demo import CPU_ENGINE_ARGS, CPU_ENGINE_ENV  # noqa: E402
from vllm_batch_embedded.seaweedfs import SeaweedFS  # noqa: E402
from vllm_batch_embedded.tiny_model import build_tiny_chat_model  # noqa: E402

BUCKET = "bench"


class _TI:
    dag_id, task_id, run_id, try_number, map_index = "bench", "vllm_batch", "bench", 1, -1

    def xcom_push(self, key, value):
        pass


def run_task(index: int, **kwargs) -> dict:
    """One operator task, in this process (as a worker runs it); return its manifest."""
    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    _TI.run_id = f"bench-{index}-{time.time_ns()}"
    kwargs.setdefault("output_uri", f"s3://{BUCKET}/out/{_TI.run_id}/results.jsonl")
    op = VLLMBatchOperator(task_id="vllm_batch", **kwargs)
    return op.execute({"ti": _TI(), "outlet_events": {}})


def tasks(args: argparse.Namespace, s3: SeaweedFS, work: Path) -> None:
    from airflow_vllm_batch.engines.vllm.server_process import VLLMServerProcess

    model = str(build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat"))
    s3.client().put_object(
        Bucket=BUCKET,
        Key="in/input.jsonl",
        Body=examples.chat_requests(args.requests, model, args.max_tokens, 0.0),
    )
    common = {
        "input_uri": f"s3://{BUCKET}/in/input.jsonl",
        "model": model,
        "results_dir": str(work / "results"),
        "resume": False,
    }
    env = {**os.environ, **CPU_ENGINE_ENV}
    os.environ.update(CPU_ENGINE_ENV)

    runner_shares, started = [], time.monotonic()
    for i in range(args.tasks):
        manifest = run_task(i, engine=VLLMRunner(args=CPU_ENGINE_ARGS.split()), **common)
        runner_shares.append(manifest["engine_duration_s"] / manifest["duration_s"])
        print(f"runner task {i + 1}: {manifest['duration_s']:.1f}s", flush=True)
    runner_wall = time.monotonic() - started

    started = time.monotonic()
    with VLLMServerProcess(model, engine_args=CPU_ENGINE_ARGS.split(), env=env) as server:
        assert server.hook is not None
        host, port = server.hook.base_url.removeprefix("http://").split(":")
        os.environ["AIRFLOW_CONN_VLLM_BENCH"] = json.dumps(
            {"conn_type": "vllm", "host": host, "port": int(port), "password": server.hook.api_key}
        )
        ready_s = time.monotonic() - started
        server_shares = []
        for i in range(args.tasks):
            manifest = run_task(i, engine=WarmVLLMServer(conn_id="vllm_bench"), **common)
            server_shares.append(manifest["engine_duration_s"] / manifest["duration_s"])
            print(f"server task {i + 1}: {manifest['duration_s']:.1f}s", flush=True)
        server_wall = time.monotonic() - started
    print(
        json.dumps(
            {
                "tasks": args.tasks,
                "requests_per_task": args.requests,
                "max_tokens": args.max_tokens,
                "runner_total_wall_s": round(runner_wall, 1),
                "server_total_wall_s_incl_start": round(server_wall, 1),
                "server_time_to_ready_s": round(ready_s, 1),
                "ratio_server_over_runner": round(server_wall / runner_wall, 3),
                "runner_answering_share": [round(s, 2) for s in runner_shares],
                "server_answering_share": [round(s, 2) for s in server_shares],
                "load_before_after": os.getloadavg(),
            }
        )
    )


def stand_in_server() -> tuple[str, threading.Thread]:
    """A minimal OpenAI-compatible chat server (aiohttp) on a thread of this process."""
    from aiohttp import web

    body = json.dumps(
        {
            "id": "chatcmpl-x",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok ok ok"},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23},
        }
    )

    async def chat(request):
        await request.read()
        return web.Response(text=body, content_type="application/json")

    async def models(request):
        return web.json_response({"data": [{"id": "m"}]})

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()

    async def start():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    return f"http://127.0.0.1:{port}", thread


def rss(args: argparse.Namespace, s3: SeaweedFS, work: Path) -> None:
    base_url, _ = stand_in_server()
    host, port = base_url.removeprefix("http://").split(":")
    env = {
        **os.environ,
        "AIRFLOW_CONN_VLLM_BENCH": json.dumps({"conn_type": "vllm", "host": host, "port": int(port)}),
    }
    figures = {}
    for n in (int(x) for x in args.sizes.split(",")):
        s3.client().put_object(
            Bucket=BUCKET, Key=f"in/{n}.jsonl", Body=examples.chat_requests(n, "m", 16, 0.0)
        )
        started = time.monotonic()
        child = subprocess.run(
            [sys.executable, __file__, "_one", f"s3://{BUCKET}/in/{n}.jsonl", str(work / "results")],
            env=env,
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        figures[n] = {
            **json.loads(child.stdout.splitlines()[-1]),
            "wall_s": round(time.monotonic() - started, 1),
        }
        print(n, figures[n], flush=True)
    print(json.dumps({"operator_peak_rss": figures, "load": os.getloadavg()}))


def vm_kb(field: str) -> int:
    """A ``/proc/self/status`` figure in kB. ``VmHWM`` is this process's own peak: unlike
    ``ru_maxrss``, it does not inherit the parent's RSS at the fork before ``exec``."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))


def _one(input_uri: str, results_dir: str) -> None:
    """The measured child: one server-engine task through connection ``vllm_bench``; prints its peaks as JSON."""
    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator  # noqa: F401 - the floor: imports

    imports_kb = vm_kb("VmHWM")
    manifest = run_task(
        0,
        input_uri=input_uri,
        model="m",
        engine=WarmVLLMServer(conn_id="vllm_bench"),
        results_dir=results_dir,
        resume=False,
    )
    print(manifest["request_counts"], f"{manifest['duration_s']:.1f}s", file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "peak_after_imports_mb": round(imports_kb / 1024, 1),
                "peak_rss_mb": round(vm_kb("VmHWM") / 1024, 1),
            }
        ),
        flush=True,
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_one":
        _one(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("tasks", "rss"))
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tasks", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--sizes", default="10000,100000")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vllm-batch-server-bench-"))
    with SeaweedFS(work / "s3") as s3:
        s3.create_bucket(BUCKET)
        os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = s3.airflow_connection_json()
        (tasks if args.what == "tasks" else rss)(args, s3, work)


if __name__ == "__main__":
    main()
