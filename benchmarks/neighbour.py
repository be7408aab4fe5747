"""A batch beside interactive users on one warm vLLM server: interactive latency with an ungated and a yielding batch.

One vLLM server (CPU, the tiny model, ``--scheduling-policy priority``) and, in a process
of its own, an interactive *probe*: a short streaming chat request every ``--probe-every``
seconds, recording its time to first token (TTFT) and its total latency. In one run:

* (a) the probe alone;
* (b) the probe beside an ungated batch (``WarmVLLMServer()``, today's behaviour);
* (c) the probe beside a yielding batch (``WarmVLLMServer(yield_to_interactive=...)``);
* (d) each batch alone, no probe: the yielding batch's wall time over the ungated one's.

Each batch is ``--requests`` chat requests through ``VLLMBatchOperator`` (real SeaweedFS), as a
worker runs a task. It prints TTFT p50/p95 for (a)-(c), the batches' wall times, and the two
target ratios: (c)'s p95 TTFT over (a)'s (target <= 1.5) and (d) (target <= 1.10).
``benchmarks/gpu_acceptance.py`` runs the same comparison on a GPU server (:func:`compare`).

Usage::

    .venv/bin/python benchmarks/neighbour.py [--requests 2000] [--max-tokens 16] [--probe-every 0.3] [--alone-s 30]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "dags"))  # the example settings live beside the example DAGs
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="vllm-batch-bench-airflow-"))

BUCKET = "bench"
CONN_ID = "vllm_neighbour"
#: What the probe asks: a short chat turn, streamed, as an interactive user's.
PROBE_PROMPT = "Say hello to the user in one short sentence."


# -- the interactive probe (a process of its own: the batch's client must not share its GIL) ----------


def probe(base_url: str, api_key: str, model: str, every_s: float, max_tokens: int) -> None:
    """Send a streaming chat request every ``every_s`` seconds until SIGTERM; print one JSON line per answer."""
    import aiohttp

    stop = asyncio.Event()

    async def one(session: aiohttp.ClientSession, sent_at: float) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROBE_PROMPT}],
            "max_completion_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
        }
        first = None
        try:
            async with session.post(
                f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}
            ) as response:
                async for raw in response.content:
                    if first is None and raw.startswith(b"data: {") and b'"content"' in raw:
                        first = time.monotonic() - sent_at
            done = time.monotonic() - sent_at
            print(
                json.dumps({"at": sent_at, "status": response.status, "ttft_s": first, "total_s": done}),
                flush=True,
            )
        except aiohttp.ClientError as err:
            print(json.dumps({"at": sent_at, "error": str(err)}), flush=True)

    async def main() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        pending: set[asyncio.Task] = set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            next_at = time.monotonic()
            while not stop.is_set():
                task = asyncio.create_task(one(session, time.monotonic()))
                pending.add(task)
                task.add_done_callback(pending.discard)
                next_at += every_s
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))
            await asyncio.gather(*pending)

    asyncio.run(main())


class Probe:
    """The probe process, started with ``with``; :attr:`samples` holds its answers once it stopped."""

    def __init__(self, base_url: str, api_key: str, model: str, every_s: float, max_tokens: int) -> None:
        self.argv = [
            sys.executable,
            __file__,
            "_probe",
            base_url,
            api_key,
            model,
            str(every_s),
            str(max_tokens),
        ]
        self.samples: list[dict] = []

    def __enter__(self) -> Probe:
        self.process = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.send_signal(signal.SIGTERM)
        out, _ = self.process.communicate(timeout=120)
        self.samples = [json.loads(line) for line in out.splitlines() if line.strip()]


def percentiles(samples: list[dict]) -> dict:
    """TTFT and total latency p50/p95 (ms) of the probe's answers, and how many failed."""
    ok = [s for s in samples if s.get("status") == 200 and s.get("ttft_s") is not None]
    ttft = sorted(s["ttft_s"] * 1000 for s in ok)
    total = sorted(s["total_s"] * 1000 for s in ok)

    def pct(values: list[float], q: float) -> float | None:
        return (
            round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 1)
            if len(values) >= 2
            else None
        )

    return {
        "n": len(ok),
        "failed": len(samples) - len(ok),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p95_ms": pct(ttft, 95),
        "total_p50_ms": pct(total, 50),
        "total_p95_ms": pct(total, 95),
    }


# -- one comparison, on whatever server ----------------------------------------------------------------


def compare(
    run_batch: Callable[[bool], dict],
    start_probe: Callable[[], Probe],
    *,
    alone_s: float,
    log: Callable[[str], None] = print,
) -> dict:
    """Run (a)-(d) on one server: the probe alone, beside each batch, and each batch alone.

    :param run_batch: ``run_batch(yielding)`` runs one batch task and returns its manifest.
    :param start_probe: a new, unstarted :class:`Probe` of the server.
    :param alone_s: seconds the probe runs alone (a).
    """
    with start_probe() as alone:
        time.sleep(alone_s)
    log(f"(a) probe alone: {percentiles(alone.samples)}")

    def beside(yielding: bool) -> tuple[dict, float]:
        with start_probe() as p:
            time.sleep(2.0)  # the probe's first answers before the batch begins
            started = time.monotonic()
            run_batch(yielding)
            wall = time.monotonic() - started
        # Only the answers sent while the batch ran count.
        during = [s for s in p.samples if started <= s["at"] <= started + wall]
        return percentiles(during), wall

    ungated, ungated_wall = beside(False)
    log(f"(b) beside an ungated batch ({ungated_wall:.1f}s): {ungated}")
    yielding, yielding_wall = beside(True)
    log(f"(c) beside a yielding batch ({yielding_wall:.1f}s): {yielding}")

    def alone_wall(yielding: bool) -> float:
        started = time.monotonic()
        run_batch(yielding)
        return time.monotonic() - started

    ungated_alone = alone_wall(False)
    yielding_alone = alone_wall(True)
    log(f"(d) batches alone: ungated {ungated_alone:.1f}s, yielding {yielding_alone:.1f}s")
    a = percentiles(alone.samples)
    return {
        "a_probe_alone": a,
        "b_beside_ungated": {**ungated, "batch_wall_s": round(ungated_wall, 1)},
        "c_beside_yielding": {**yielding, "batch_wall_s": round(yielding_wall, 1)},
        "d_alone_wall_s": {"ungated": round(ungated_alone, 1), "yielding": round(yielding_alone, 1)},
        "c_p95_ttft_over_a": _ratio(yielding["ttft_p95_ms"], a["ttft_p95_ms"]),
        "b_p95_ttft_over_a": _ratio(ungated["ttft_p95_ms"], a["ttft_p95_ms"]),
        "d_yielding_over_ungated_alone": round(yielding_alone / ungated_alone, 3),
    }


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return round(top / bottom, 2) if top is not None and bottom else None


# -- one warm server with priority scheduling, its batches through the operator ----------------------------


def measure(
    model: str,
    engine_args: list[str],
    env: dict[str, str],
    *,
    input_uri: str,
    requests: int,
    results_dir: str,
    probe_every_s: float = 0.3,
    probe_tokens: int = 8,
    alone_s: float = 30.0,
    startup_timeout_s: float = 600.0,
) -> dict:
    """Start one vLLM server with ``--scheduling-policy priority`` and run :func:`compare` on it.

    :param engine_args: the server's other arguments (the CPU's ``--enforce-eager``, a GPU's ``--max-model-len``...).
    :param input_uri: the batch (``requests`` lines), already in S3 (``aws_default``).
    """
    from airflow_vllm_batch.engines import WarmVLLMServer, YieldToInteractive
    from airflow_vllm_batch.engines.vllm.server_process import VLLMServerProcess
    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    class TI:
        dag_id, task_id, run_id, try_number, map_index = "bench", "vllm_batch", "bench", 1, -1

        def xcom_push(self, key, value):
            pass

    bucket = input_uri.removeprefix("s3://").split("/", 1)[0]
    with VLLMServerProcess(
        model,
        engine_args=[*engine_args, "--scheduling-policy", "priority"],
        env=env,
        startup_timeout_s=startup_timeout_s,
    ) as server:
        assert server.hook is not None
        host, port = server.hook.base_url.removeprefix("http://").split(":")
        os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(
            {
                "conn_type": "vllm",
                "host": host,
                "port": int(port),
                "password": server.hook.api_key,
                "extra": {"scheduling_policy": "priority"},
            }
        )

        def run_batch(yielding: bool) -> dict:
            TI.run_id = f"bench-{time.time_ns()}"
            engine = WarmVLLMServer(
                conn_id=CONN_ID, yield_to_interactive=YieldToInteractive() if yielding else False
            )
            op = VLLMBatchOperator(
                task_id="vllm_batch",
                input_uri=input_uri,
                output_uri=f"s3://{bucket}/out/{TI.run_id}/results.jsonl",
                model=model,
                engine=engine,
                results_dir=results_dir,
                resume=False,
            )
            manifest = op.execute({"ti": TI(), "outlet_events": {}})
            assert manifest["request_counts"]["completed"] == requests, manifest["request_counts"]
            return manifest

        return compare(
            run_batch,
            lambda: Probe(server.hook.base_url, server.hook.api_key, model, probe_every_s, probe_tokens),
            alone_s=alone_s,
        )


# -- this CPU ---------------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_probe":
        base_url, api_key, model, every_s, max_tokens = sys.argv[2:7]
        probe(base_url, api_key, model, float(every_s), int(max_tokens))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--probe-every", type=float, default=0.3)
    parser.add_argument("--probe-tokens", type=int, default=8)
    parser.add_argument("--alone-s", type=float, default=30.0)
    args = parser.parse_args()

    import logging

    import vllm_batch_examples as examples

    from vllm_batch_embedded.demo import CPU_ENGINE_ARGS, CPU_ENGINE_ENV
    from vllm_batch_embedded.seaweedfs import SeaweedFS
    from vllm_batch_embedded.tiny_model import build_tiny_chat_model

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(message)s")

    model = str(build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat"))
    work = Path(tempfile.mkdtemp(prefix="vllm-batch-neighbour-bench-"))
    env = {**os.environ, **CPU_ENGINE_ENV}
    os.environ.update(CPU_ENGINE_ENV)
    load_before = os.getloadavg()
    started = time.monotonic()
    with SeaweedFS(work / "s3") as s3:
        s3.create_bucket(BUCKET)
        os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = s3.airflow_connection_json()
        s3.client().put_object(
            Bucket=BUCKET,
            Key="in/input.jsonl",
            Body=examples.chat_requests(args.requests, model, args.max_tokens, 0.0),
        )
        figures = measure(
            model,
            CPU_ENGINE_ARGS.split(),
            env,
            input_uri=f"s3://{BUCKET}/in/input.jsonl",
            requests=args.requests,
            results_dir=str(work / "results"),
            probe_every_s=args.probe_every,
            probe_tokens=args.probe_tokens,
            alone_s=args.alone_s,
        )
    print(
        json.dumps(
            {
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "probe_every_s": args.probe_every,
                "probe_tokens": args.probe_tokens,
                **figures,
                "run_s": round(time.monotonic() - started, 1),
                "load_before_after": [load_before, os.getloadavg()],
                "cpus": os.cpu_count(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
