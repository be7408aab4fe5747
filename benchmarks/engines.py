"""The two engines on the same chat file: vLLM's batch runner against a warm vLLM server.

Runs one N-request chat file (tiny model, CPU) through

* ``runner``: ``python -m vllm.entrypoints.openai.run_batch -i input.jsonl -o out.jsonl``,
  timed *after its start*: from the line it logs once its engine is built ("Reading batch
  from ...") to its output written (the file's modification time), so neither the model
  load nor the engine's teardown counts (the time to its exit is printed too); and
* ``server``: one ``VLLMServerProcess`` started once, then :func:`run_stream` over the
  same file, timed from the call to its return (the journal written and sealed),

``--repeats`` times each (runner first: only one vLLM process runs at a time), and prints
the medians and their ratio (server ÷ runner), the server's time to ready, a check that
both write lines of the same shape, and the server's time at other in-flight bounds.
Usage::

    .venv/bin/python benchmarks/engines.py [--requests 5000] [--repeats 3] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "dags"))  # the example settings live beside the example DAGs

import vllm_batch_examples as examples  # noqa: E402

from vllm_batch_embedded.demo import CPU_ENGINE_ARGS, CPU_ENGINE_ENV  # noqa: E402
from vllm_batch_embedded.tiny_model import build_tiny_chat_model  # noqa: E402

#: What the runner hook runs (``RUN_BATCH_MODULE``): run as ``__main__``, the module in
#: ``vllm.entrypoints.launchers`` logs through an unconfigured logger, so its progress
#: lines (and the marker below) never appear; this wrapper imports it under its own name.
RUNNER_MODULE = "vllm.entrypoints.openai.run_batch"
#: Logged by the runner once its engine is built and before it reads the input.
BATCH_PHASE_MARKER = b"Reading batch from"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--sweep", default="64,128,256", help="other in-flight bounds to time once each ('' for none)"
    )
    parser.add_argument(
        "--engine-multiprocessing",
        action="store_true",
        help="run vLLM's engine core in a process of its own (vLLM's default; the embedded default turns it off)",
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vllm-batch-engines-"))
    # The hook imports Airflow, which would otherwise make a home in ~/airflow.
    os.environ.setdefault("AIRFLOW_HOME", str(work / "airflow"))
    model = str(build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat"))
    local_input = work / "input.jsonl"
    local_input.write_bytes(examples.chat_requests(args.requests, model, args.max_tokens, 0.0))
    env = {**os.environ, **CPU_ENGINE_ENV}
    if args.engine_multiprocessing:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    engine_args = CPU_ENGINE_ARGS.split()

    runner_after_start, runner_to_exit, runner_total = [], [], []
    for rep in range(args.repeats):
        after, to_exit, total = run_runner(local_input, work / f"runner-{rep}.jsonl", model, engine_args, env)
        runner_after_start.append(after)
        runner_to_exit.append(to_exit)
        runner_total.append(total)
        print(
            f"runner {rep + 1}: {after:.2f}s after its start to its output ({to_exit:.2f}s to its exit, {total:.1f}s in all)",
            flush=True,
        )

    server_times, sweep, ready_s = run_server(local_input, work, model, engine_args, env, args)
    runner, server = statistics.median(runner_after_start), statistics.median(server_times)
    shape = compare_shapes(work / "runner-0.jsonl", work / "server-0")
    print(
        json.dumps(
            {
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "engine_multiprocessing": args.engine_multiprocessing,
                "repeats": args.repeats,
                "runner_after_start_s": [round(t, 2) for t in runner_after_start],
                "runner_after_start_to_exit_s": [round(t, 2) for t in runner_to_exit],
                "runner_total_s": [round(t, 2) for t in runner_total],
                "server_time_to_ready_s": round(ready_s, 2),
                "server_after_ready_s": [round(t, 2) for t in server_times],
                "runner_median_s": round(runner, 2),
                "server_median_s": round(server, 2),
                "ratio_server_over_runner": round(server / runner, 3),
                "server_s_by_max_in_flight": sweep,
                "output_shape": shape,
            }
        )
    )


def run_runner(
    local_input: Path, output: Path, model: str, engine_args: list[str], env: dict[str, str]
) -> tuple[float, float, float]:
    """Run vLLM's runner once; return seconds from its batch phase to its output written, to its exit, and in all.

    The output's modification time marks when the runner finished writing it; after that
    it only tears its engine down, which the server engine also pays, once, at the end.
    """
    argv = [
        sys.executable,
        "-m",
        RUNNER_MODULE,
        "-i",
        str(local_input),
        "-o",
        str(output),
        "--model",
        model,
        *engine_args,
    ]
    started = time.monotonic()
    batch_phase_wall = None
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    for line in proc.stdout:
        if batch_phase_wall is None and BATCH_PHASE_MARKER in line:
            batch_phase_wall, batch_phase = time.time(), time.monotonic()
    if proc.wait() != 0 or batch_phase_wall is None:
        raise SystemExit(f"the runner failed (exit {proc.returncode})")
    ended = time.monotonic()
    return output.stat().st_mtime - batch_phase_wall, ended - batch_phase, ended - started


def run_server(
    local_input: Path,
    work: Path,
    model: str,
    engine_args: list[str],
    env: dict[str, str],
    args: argparse.Namespace,
) -> tuple[list[float], dict[str, float], float]:
    """Start one server; stream the file ``repeats`` times, then once per sweep bound."""
    from airflow_vllm_batch.engines.vllm.server_process import VLLMServerProcess
    from airflow_vllm_batch.serving import DEFAULT_MAX_IN_FLIGHT

    times: list[float] = []
    sweep: dict[str, float] = {}
    with VLLMServerProcess(model, engine_args=engine_args, env=env, startup_timeout_s=600) as server:
        hook = server.hook
        hook.check_serves(model)
        for rep in range(args.repeats):
            times.append(
                stream_once(local_input, work / f"server-{rep}", hook, DEFAULT_MAX_IN_FLIGHT, args.requests)
            )
            print(f"server {rep + 1}: {times[-1]:.2f}s (max_in_flight {DEFAULT_MAX_IN_FLIGHT})", flush=True)
        for bound in filter(None, args.sweep.split(",")):
            sweep[bound] = round(
                stream_once(local_input, work / f"sweep-{bound}", hook, int(bound), args.requests), 2
            )
            print(f"server at max_in_flight {bound}: {sweep[bound]:.2f}s", flush=True)
        ready_s = server.time_to_ready_s or 0.0
    sweep[str(DEFAULT_MAX_IN_FLIGHT)] = round(statistics.median(times), 2)
    return times, dict(sorted(sweep.items(), key=lambda kv: int(kv[0]))), ready_s


def stream_once(local_input: Path, directory: Path, hook, max_in_flight: int, expected: int) -> float:
    """Stream the file through the server once; return the seconds it took."""
    from airflow_vllm_batch.serving import Journal, run_stream

    journal = Journal(directory)
    with open(local_input, "rb") as lines:
        started, cpu = time.monotonic(), time.process_time()
        stats = run_stream(
            enumerate(lines, 1),
            base_url=hook.base_url,
            api_key=hook.api_key,
            journal=journal,
            max_in_flight=max_in_flight,
        )
        elapsed, cpu = time.monotonic() - started, time.process_time() - cpu
    if stats.done != expected or stats.failed:
        raise SystemExit(f"the server answered {stats.done} of {expected} requests, {stats.failed} failed")
    # The client shares the machine with the server: its CPU time is time the engine did not get.
    print(f"  client CPU {cpu:.2f}s of {elapsed:.2f}s wall", flush=True)
    return elapsed


def _shape(line: dict) -> dict:
    response = line.get("response") or {}
    return {
        "keys": list(line),
        "response_keys": list(response),
        "body_keys": sorted(response.get("body") or {}),
        "choice_keys": sorted(((response.get("body") or {}).get("choices") or [{}])[0]),
        "message_keys": sorted(
            (((response.get("body") or {}).get("choices") or [{}])[0]).get("message") or {}
        ),
    }


def compare_shapes(runner_output: Path, server_journal: Path) -> str:
    """Compare the key structure of the first runner line and the first server line."""
    with open(runner_output) as f:
        runner = _shape(json.loads(f.readline()))
    first_part = sorted(server_journal.glob("part-*.jsonl"))[0]
    with open(first_part) as f:
        server = _shape(json.loads(f.readline()))
    if runner == server:
        return "identical keys (line, response, body, choice, message)"
    return "differs: " + json.dumps(
        {k: {"runner": runner[k], "server": server[k]} for k in runner if runner[k] != server[k]}
    )


if __name__ == "__main__":
    main()
