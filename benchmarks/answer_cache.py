"""The answer cache (``answer_cache=``): what a nightly run over a mostly unchanged table sends, and what the cache costs.

``nightly``: night 1 runs N chat rows (temperature 0) through one warm vLLM server with the
cache on; night 2 runs the same rows with a share of them changed, into a new output, with
the same cache. Prints the requests each night really sent (the server's own
``vllm:request_success_total`` from ``/metrics``), each night's wall time and their ratio,
whether night 2 answers every custom_id once, and whether each unchanged row's result line
is byte-equal to night 1's. It exits non-zero when night 2's output is not night 1's for
the unchanged rows, and with ``--check`` also when a target of ``TARGETS`` is missed.

``overhead``: the same N requests, nothing in the cache (a new, empty cache prefix each
run), against runs without the cache, side by side and alternating; each run is a child
process that runs one operator task, so its wall time and its peak RSS (``VmHWM``) are the
task's own. The server is a stand-in that answers at once (``--engine stand-in``, the
harshest case: the run's wall time is all client, S3 and cache work) or a real vLLM server
(``--engine vllm``, the tiny model on this CPU).

Usage::

    .venv/bin/python benchmarks/answer_cache.py nightly [--rows 20000] [--changed 0.05] [--check]
    .venv/bin/python benchmarks/answer_cache.py overhead [--requests 100000] [--runs 3] [--engine stand-in|vllm]

``nightly --server-url URL`` uses a running server instead of starting one (its API key,
if any, in the environment variable ``BENCH_VLLM_API_KEY``): the suite runs it small so
against its warm server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="vllm-batch-bench-airflow-"))

from server_engine import BUCKET, run_task, stand_in_server, vm_kb  # noqa: E402

from airflow_vllm_batch.engines import WarmVLLMServer  # noqa: E402
from airflow_vllm_batch.run import AnswerCacheOptions  # noqa: E402
from tests.integration.vllm_metrics import requests_answered  # noqa: E402
from vllm_batch_embedded.demo import CPU_ENGINE_ARGS, CPU_ENGINE_ENV  # noqa: E402
from vllm_batch_embedded.seaweedfs import SeaweedFS  # noqa: E402
from vllm_batch_embedded.tiny_model import build_tiny_chat_model  # noqa: E402

#: The issue's targets for the nightly run at 20,000 rows with 5 % changed.
TARGETS = {"night2_sent_at_most": 1000, "wall_ratio_at_most": 0.15}
CONN_ID = "vllm_bench"


def rows(n: int, model: str, max_tokens: int, changed: frozenset[int] = frozenset()) -> bytes:
    """``n`` chat rows (``row-0`` ...), temperature 0: cacheable. A changed row's text differs, its custom_id not."""
    lines = []
    for i in range(n):
        text = f"Ticket {i}: the printer on floor {i % 7} says paper jam; summarise in one line."
        if i in changed:
            text += " Update: it is on fire now."
        body = {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_completion_tokens": max_tokens,
            "temperature": 0,
        }
        lines.append(
            json.dumps(
                {"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
        )
    return ("\n".join(lines) + "\n").encode()


def result_lines(s3: SeaweedFS, uri: str) -> dict[str, bytes]:
    """The output's lines by custom_id, as bytes; a custom_id answered twice fails."""
    key = uri.removeprefix(f"s3://{BUCKET}/")
    by_id: dict[str, bytes] = {}
    for line in s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read().splitlines():
        custom_id = json.loads(line)["custom_id"]
        if custom_id in by_id:
            raise AssertionError(f"{custom_id} answered twice in {uri}")
        by_id[custom_id] = line
    return by_id


@contextlib.contextmanager
def vllm_server(url: str | None, model: str) -> Iterator[str]:
    """A vLLM server behind connection ``vllm_bench``: the one at ``url``, or one started here."""
    if url:
        _connect(url, os.environ.get("BENCH_VLLM_API_KEY"))
        yield url
        return
    from airflow_vllm_batch.engines.vllm.server_process import VLLMServerProcess

    with VLLMServerProcess(
        model,
        engine_args=CPU_ENGINE_ARGS.split(),
        env={**os.environ, **CPU_ENGINE_ENV},
        startup_timeout_s=300,
    ) as server:
        assert server.hook is not None
        _connect(server.hook.base_url, server.hook.api_key)
        yield server.hook.base_url


def _connect(url: str, api_key: str | None) -> None:
    host, port = url.removeprefix("http://").split(":")
    conn = {
        "conn_type": "vllm",
        "host": host,
        "port": int(port),
        **({"password": api_key} if api_key else {}),
    }
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(conn)


def nightly(args: argparse.Namespace, s3: SeaweedFS, work: Path) -> int:
    model = str(build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat"))
    changed = frozenset(range(0, args.rows, max(1, round(1 / args.changed))))
    stamp = time.time_ns()
    cache = f"s3://{BUCKET}/cache-{stamp}/"
    client = s3.client()
    client.put_object(
        Bucket=BUCKET, Key=f"nightly-{stamp}/night1.jsonl", Body=rows(args.rows, model, args.max_tokens)
    )
    client.put_object(
        Bucket=BUCKET,
        Key=f"nightly-{stamp}/night2.jsonl",
        Body=rows(args.rows, model, args.max_tokens, changed),
    )
    nights = {}
    with vllm_server(args.server_url, model) as url:
        for night in (1, 2):
            before = requests_answered(url)
            started = time.monotonic()
            manifest = run_task(
                night,
                input_uri=f"s3://{BUCKET}/nightly-{stamp}/night{night}.jsonl",
                output_uri=f"s3://{BUCKET}/nightly-{stamp}/out-{night}/results.jsonl",
                model=model,
                engine=WarmVLLMServer(conn_id=CONN_ID),
                answer_cache=AnswerCacheOptions(uri=cache),
                results_dir=str(work / "results"),
            )
            wall = time.monotonic() - started
            nights[night] = {
                "manifest": manifest,
                "wall_s": wall,
                "sent": round(requests_answered(url) - before),
            }
            print(
                f"night {night}: sent {nights[night]['sent']}, from cache {manifest.get('from_cache', 0)}, {wall:.1f}s",
                flush=True,
            )
    first = result_lines(s3, nights[1]["manifest"]["output_uri"])
    second = result_lines(s3, nights[2]["manifest"]["output_uri"])
    unchanged = [f"row-{i}" for i in range(args.rows) if i not in changed]
    differing = [cid for cid in unchanged if first[cid] != second[cid]]
    ratio = nights[2]["wall_s"] / nights[1]["wall_s"]
    figures = {
        "rows": args.rows,
        "changed": len(changed),
        "max_tokens": args.max_tokens,
        "night1_sent": nights[1]["sent"],
        "night2_sent": nights[2]["sent"],
        "night2_from_cache": nights[2]["manifest"].get("from_cache"),
        "night1_wall_s": round(nights[1]["wall_s"], 2),
        "night2_wall_s": round(nights[2]["wall_s"], 2),
        "wall_ratio": round(ratio, 3),
        "night2_answers_every_row_once": sorted(second) == sorted(f"row-{i}" for i in range(args.rows)),
        "unchanged_rows_byte_equal": not differing,
        "load": os.getloadavg(),
    }
    print(json.dumps(figures))
    if differing:
        print(
            f"{len(differing)} unchanged row(s) differ, e.g. {differing[0]}:\n{first[differing[0]]!r}\n{second[differing[0]]!r}"
        )
    missed = []
    if args.check:
        if nights[2]["sent"] > TARGETS["night2_sent_at_most"] * args.rows / 20000:
            missed.append(f"night 2 sent {nights[2]['sent']}")
        if ratio > TARGETS["wall_ratio_at_most"]:
            missed.append(f"night 2 took {ratio:.3f} x night 1")
    if differing or not figures["night2_answers_every_row_once"]:
        missed.append("night 2's output is not night 1's for the unchanged rows")
    for miss in missed:
        print("MISSED:", miss)
    return 1 if missed else 0


def overhead(args: argparse.Namespace, s3: SeaweedFS, work: Path) -> int:
    model = "m"
    if args.engine == "vllm":
        model = str(build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat"))
    s3.client().put_object(
        Bucket=BUCKET, Key="overhead/input.jsonl", Body=rows(args.requests, model, args.max_tokens)
    )
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    with contextlib.ExitStack() as stack:
        if args.engine == "vllm":
            stack.enter_context(vllm_server(None, model))
        else:
            url, _ = stand_in_server()
            _connect(url, None)
        for run in range(args.runs):
            # Alternating, and each pair in the other order than the last: drift in the machine's load hits both alike.
            for variant in ("without", "with") if run % 2 == 0 else ("with", "without"):
                cache = f"s3://{BUCKET}/overhead-cache-{time.time_ns()}/" if variant == "with" else ""
                child = subprocess.run(
                    [sys.executable, __file__, "_one", model, str(work / "results"), cache],
                    env=os.environ.copy(),
                    check=True,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                figures = json.loads(child.stdout.splitlines()[-1])
                runs[variant].append(figures)
                print(variant, figures, flush=True)
    wall = {variant: statistics.median(r["wall_s"] for r in rs) for variant, rs in runs.items()}
    peak = {variant: max(r["peak_rss_mb"] for r in rs) for variant, rs in runs.items()}
    print(
        json.dumps(
            {
                "requests": args.requests,
                "engine": args.engine,
                "runs": args.runs,
                "median_wall_s_without": round(wall["without"], 2),
                "median_wall_s_with": round(wall["with"], 2),
                "overhead_pct": round(100 * (wall["with"] / wall["without"] - 1), 2),
                "peak_rss_mb_without": peak["without"],
                "peak_rss_mb_with": peak["with"],
                "peak_rss_delta_mb": round(peak["with"] - peak["without"], 1),
                "load": os.getloadavg(),
            }
        )
    )
    return 0


def _one(model: str, results_dir: str, cache: str) -> None:
    """The measured child: one task over the overhead input, with the cache at ``cache`` or without; prints wall and peak RSS."""
    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator  # noqa: F401 - imports are not the task's work

    started = time.monotonic()
    extra = {"answer_cache": AnswerCacheOptions(uri=cache)} if cache else {}
    manifest = run_task(
        0,
        input_uri=f"s3://{BUCKET}/overhead/input.jsonl",
        model=model,
        engine=WarmVLLMServer(conn_id=CONN_ID),
        results_dir=results_dir,
        resume=False,
        **extra,
    )
    wall = time.monotonic() - started
    assert manifest["request_counts"]["completed"] == manifest["request_counts"]["total"], manifest[
        "request_counts"
    ]
    assert not manifest.get("from_cache"), "nothing may hit in the overhead runs"
    print(json.dumps({"wall_s": round(wall, 3), "peak_rss_mb": round(vm_kb("VmHWM") / 1024, 1)}), flush=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_one":
        _one(*sys.argv[2:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("nightly", "overhead"))
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--changed", type=float, default=0.05)
    parser.add_argument("--requests", type=int, default=100000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engine", choices=("stand-in", "vllm"), default="stand-in")
    parser.add_argument(
        "--server-url", help="a running vLLM server (nightly only); its key in BENCH_VLLM_API_KEY"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vllm-batch-cache-bench-"))
    with SeaweedFS(work / "s3") as s3:
        s3.create_bucket(BUCKET)
        os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = s3.airflow_connection_json()
        return (nightly if args.what == "nightly" else overhead)(args, s3, work)


if __name__ == "__main__":
    sys.exit(main())
