"""GPU acceptance: the same generated chat file through both engines, as VLLMBatchOperator runs them.

Run it on a GPU node with a local model directory::

    python benchmarks/gpu_acceptance.py --model /models/Llama-3.1-8B-Instruct [--requests 5000] \\
        [--max-tokens 128] [--engine-args --max-model-len 4096 ...]

Each engine runs once through the provider's own code (``VLLMBatchOperator.execute`` in a
child process, as a worker runs it) against a local S3 (SeaweedFS, as ``make demo``
starts it): the runner (vLLM's batch runner), then a server the task starts. It prints
one table: requests/s and output tokens/s (over the engine's time, its start-up
included, as a task pays it), the scheduler sizes each engine reports it resolved (its
own log: the runner's ``args: Namespace``, the server's ``non-default args``, and the
scheduler's "Chunked prefill is enabled with max_num_batched_tokens=N"), the in-flight
bound of the server's stream, the GPU utilisation sampled from ``nvidia-smi`` every
second while the engine runs ("n/a" without it), and the ratio server ÷ runner.

With ``--neighbour`` it then measures a batch beside interactive users on one warm server
run with ``--scheduling-policy priority`` (``benchmarks/neighbour.py``'s comparison, on this
model and these engine arguments): an interactive probe's TTFT p50/p95 alone, beside an ungated
batch and beside a yielding one (``WarmVLLMServer(yield_to_interactive=True)``), and the two
batches' wall times alone, printed as JSON after the table.

On a machine without a GPU it runs on the CPU (``tests/integration/test_gpu_acceptance.py``
runs it with the tiny model), so it keeps working.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "dags"))  # the example settings live beside the example DAGs
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="vllm-batch-acceptance-airflow-"))

import vllm_batch_examples as examples  # noqa: E402

from vllm_batch_embedded.seaweedfs import SeaweedFS  # noqa: E402

BUCKET = "acceptance"
COLUMNS = (
    "engine",
    "requests",
    "requests/s",
    "output tokens/s",
    "max_num_seqs",
    "max_num_batched_tokens",
    "in flight",
    "GPU util %",
)


class _TI:
    dag_id, task_id, run_id, try_number, map_index = "gpu_acceptance", "vllm_batch", "acceptance", 1, -1

    def xcom_push(self, key, value):
        pass


class GPUSampler:
    """Samples ``nvidia-smi``'s utilisation of every GPU once a second; the mean, or "n/a" without it."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GPUSampler:
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._sample, name="nvidia-smi", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=True,
                ).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            values = [float(v) for v in out.split() if v.strip().replace(".", "", 1).isdigit()]
            if values:
                self.samples.append(sum(values) / len(values))

    @property
    def mean(self) -> str:
        return f"{sum(self.samples) / len(self.samples):.0f}" if self.samples else "n/a"


def resolved_sizes(lines: list[str]) -> tuple[str, str]:
    """The scheduler sizes the engine reports it resolved, from its own log lines ("?" when it did not say)."""
    text = "\n".join(lines)
    seqs = re.findall(r"max_num_seqs=(\d+)", text) or re.findall(r"'max_num_seqs': (\d+)", text)
    tokens = re.findall(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)", text) or re.findall(
        r"max_num_batched_tokens=(\d+)|'max_num_batched_tokens': (\d+)", text
    )
    token = tokens[-1] if tokens else "?"
    if isinstance(token, tuple):
        token = next(t for t in token if t)
    return (seqs[-1] if seqs else "?"), token


def in_flight(lines: list[str]) -> str:
    found = re.findall(r"In flight: at most (\d+) requests", "\n".join(lines))
    return found[-1] if found else "-"


def run_engine(engine: str, common: dict) -> dict:
    """One operator task with ``engine``, in a child process as a worker runs it; return its row of the table.

    A child, so that its whole log (the engine's own lines included) can be read back as
    the task log would show it.
    """
    with GPUSampler() as gpu:
        child = subprocess.run(
            [sys.executable, __file__, "_task", engine, json.dumps(common)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
    lines = child.stdout.splitlines()
    if child.returncode != 0 or not lines or not lines[-1].startswith("{"):
        raise SystemExit(f"the {engine} task failed (exit {child.returncode}):\n" + "\n".join(lines[-40:]))
    manifest = json.loads(lines[-1])
    counts = manifest["request_counts"]
    if counts["failed"] or counts["completed"] != counts["total"]:
        raise SystemExit(f"the {engine} engine answered {counts}")
    seconds = manifest["engine_duration_s"]
    seqs, tokens = resolved_sizes(lines)
    return {
        "engine": engine,
        "requests": counts["total"],
        "requests/s": counts["total"] / seconds,
        "output tokens/s": manifest["usage"]["completion_tokens"] / seconds,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": tokens,
        "in flight": in_flight(lines) if engine == "server" else "-",
        "GPU util %": gpu.mean,
    }


def _task(engine: str, common: str) -> None:
    """The child: one operator task; its log on stdout, then its manifest as the last line."""
    from airflow_vllm_batch.engines import VLLMRunner, VLLMServer
    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    _TI.run_id = f"acceptance-{engine}-{time.time_ns()}"
    settings = json.loads(common)
    args = settings.pop("engine_args")
    options = VLLMRunner(args=args) if engine == "runner" else VLLMServer(args=args)
    op = VLLMBatchOperator(
        task_id="vllm_batch",
        output_uri=f"s3://{BUCKET}/out/{_TI.run_id}/results.jsonl",
        engine=options,
        **settings,
    )
    manifest = op.execute({"ti": _TI(), "outlet_events": {}})
    sys.stderr.flush()
    print("\n" + json.dumps(manifest), flush=True)


def table(rows: list[dict]) -> str:
    """The rows as a fixed-width table, then the ratio server ÷ runner."""
    cells = [[f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in COLUMNS] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    by = {row["engine"]: row for row in rows}
    ratio = [
        f"{c} {by['server'][c] / by['runner'][c]:.2f}"
        for c in ("requests/s", "output tokens/s")
        if by["runner"][c]
    ]
    lines.append("ratio server ÷ runner: " + ", ".join(ratio))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local model directory")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--neighbour",
        action="store_true",
        help="also measure a batch beside interactive users (benchmarks/neighbour.py)",
    )
    parser.add_argument(
        "--probe-every",
        type=float,
        default=0.3,
        help="with --neighbour: seconds between interactive requests",
    )
    parser.add_argument(
        "--alone-s", type=float, default=30.0, help="with --neighbour: seconds the probe runs alone"
    )
    parser.add_argument(
        "--engine-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="further engine arguments, the rest of the line: --engine-args --max-model-len 4096",
    )
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="vllm-batch-acceptance-"))
    with SeaweedFS(work / "s3") as s3:
        s3.create_bucket(BUCKET)
        os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = s3.airflow_connection_json()
        body = examples.chat_requests(args.requests, args.model, args.max_tokens, 0.0)
        s3.client().put_object(Bucket=BUCKET, Key="in/input.jsonl", Body=body)
        common = {
            "input_uri": f"s3://{BUCKET}/in/input.jsonl",
            "model": args.model,
            "engine_args": list(args.engine_args),
            "results_dir": str(work / "results"),
            "resume": False,
        }
        rows = [run_engine(engine, common) for engine in ("runner", "server")]
        shown = table(rows)
        print(shown, flush=True)
        if args.neighbour:
            sys.path.insert(0, str(REPO / "benchmarks"))
            import neighbour

            figures = neighbour.measure(
                args.model,
                list(args.engine_args),
                dict(os.environ),
                input_uri=common["input_uri"],
                requests=args.requests,
                results_dir=common["results_dir"],
                probe_every_s=args.probe_every,
                alone_s=args.alone_s,
            )
            print("beside interactive users: " + json.dumps(figures), flush=True)
    return shown


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_task":
        _task(sys.argv[2], sys.argv[3])
    else:
        main()
