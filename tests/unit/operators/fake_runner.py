"""A stand-in for vLLM's batch runner, for the fast operator tests only (never integration).

Called as ``python fake_runner.py -i INPUT -o OUTPUT --model M [...]`` through the
operator's ``engine_command``. It answers every chat line the way vLLM 0.32 does, reading
and writing local paths or presigned URLs. The environment steers it:

* ``FAKE_ENGINE_CALLS``: a file that gets one line per start (how tests count engine runs);
* ``FAKE_ENGINE_DROP``: answer that many fewer lines (a results mismatch);
* ``FAKE_ENGINE_EXIT``: exit with this code after writing nothing;
* ``FAKE_ENGINE_FAIL``: answer that many of the first lines with vLLM's HTTP 500 error
  (its message ``FAKE_ENGINE_FAIL_MESSAGE`` when set).
* ``FAKE_ENGINE_DIES_AFTER``: answer that many lines, then every other one with the 500 that
  vLLM 0.32 writes once its engine core died (``EngineDeadError``), and exit 0 as it does.
* ``FAKE_ENGINE_ECHO_ARGS``: print the arguments it was not told about, as vLLM logs its
  ``args: Namespace(...)`` (secret flags' values included), and its input as vLLM's ``Reading batch
  from ...`` line; fail with them on stderr when set to ``fail``.
* ``FAKE_ENGINE_DIES_ONCE``: a file; with ``FAKE_ENGINE_DIES_AFTER``, only the start that finds
  it missing dies (and creates it): a transient death.
* ``FAKE_ENGINE_KILLER``: the custom_id of a request that kills the engine core whenever it runs.
  The stand-in runs the requests in order, ``--max-num-seqs`` (or ``--max-inflight``) at a
  time (4 by default): the group holding the killer and every later one are left unanswered.
* ``FAKE_ENGINE_VLLM``: ``0.32`` (default) or ``0.33``, how a death is reported. 0.32 writes
  every line at the end, the unanswered ones as its engine-dead 500s, and exits 0; 0.33
  writes its answers as it goes, in input order, stops at the first unanswered one and exits
  1 with vLLM's ``EngineDeadError`` traceback.
* ``FAKE_ENGINE_SENT``: a file that gets, per start, the custom_ids the engine was given.
* ``FAKE_ENGINE_GPU_PROBE``: a file that gets the engine's ``CUDA_VISIBLE_DEVICES`` and,
  for each device, whether its GPU lease lock is held while the engine runs.
* ``FAKE_ENGINE_WEDGE_AFTER``: answer that many requests (reporting each in vLLM's progress
  report; 0.33 also writes each to its output as it goes), then wedge: no new answer ever, only
  its last progress report again and vLLM's waiting-for-a-hung-process warning, every 0.2 s.
* ``FAKE_ENGINE_SLOW``: seconds between two answers, each reported in vLLM's progress report
  (a slow but steady engine).
* ``FAKE_ENGINE_PID``: a file that gets the engine's process id.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
import urllib.parse
import urllib.request

#: vLLM's batch progress report (its run_batch ``_BAR_FORMAT``).
PROGRESS = "Running batch: {pct:3.0f}% Completed | {n}/{total} [00:01<00:01, 1.00req/s]"
#: vLLM's warning that a process of the engine waits for a hung one (repeated every minute).
WAITING = (
    "WARNING [shm_broadcast.py:1] No available shared memory broadcast block found in 60 seconds. This typically "
    "happens when some processes are hanging or doing some time-consuming work (e.g. compilation)."
)


def read(location: str) -> bytes:
    if location.startswith("http"):
        parts = urllib.parse.urlsplit(location)
        request = urllib.request.Request(location)
        if parts.username is not None:  # as vLLM's aiohttp reads one: HTTP Basic authentication
            token = base64.b64encode(f"{parts.username}:{parts.password or ''}".encode()).decode()
            host = parts.netloc.rpartition("@")[2]
            request = urllib.request.Request(
                urllib.parse.urlunsplit(parts._replace(netloc=host)),
                headers={"Authorization": f"Basic {token}"},
            )
        with urllib.request.urlopen(request) as response:
            return response.read()
    with open(location, "rb") as f:
        return f.read()


def write(location: str, data: bytes) -> None:
    if location.startswith("http"):
        urllib.request.urlopen(urllib.request.Request(location, data=data, method="PUT")).close()
    else:
        with open(location, "wb") as f:
            f.write(data)


def answer(request: dict, model: str) -> dict:
    body = {
        "id": "chatcmpl-" + request["custom_id"],
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    return {
        "id": "vllm-" + request["custom_id"],
        "custom_id": request["custom_id"],
        "response": {"status_code": 200, "request_id": "r-" + request["custom_id"], "body": body},
        "error": None,
    }


def fail(request: dict) -> dict:
    """vLLM 0.32's line for a request that failed in the engine."""
    return {
        "id": "vllm-" + request["custom_id"],
        "custom_id": request["custom_id"],
        "response": {"status_code": 500, "request_id": "r-" + request["custom_id"], "body": None},
        "error": {
            "message": os.environ.get(
                "FAKE_ENGINE_FAIL_MESSAGE",
                "Internal error while generating (see https://example.invalid/x?X-Amz-Signature=abc)",
            ),
            "type": "InternalServerError",
            "code": 500,
        },
    }


def engine_dead(request: dict) -> dict:
    """vLLM 0.32's line for a request left when its engine core died (the process still exits 0)."""
    message = "EngineCore encountered an issue. See stack trace (above) for the root cause."
    return {
        "id": "vllm-" + request["custom_id"],
        "custom_id": request["custom_id"],
        "response": {"status_code": 500, "request_id": "r-" + request["custom_id"], "body": None},
        "error": {"message": message, "type": "InternalServerError", "code": 500},
    }


def write_gpu_probe(path: str) -> None:
    import fcntl

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    locked = {}
    lock_dir = os.environ.get("AIRFLOW_VLLM_BATCH_GPU_LOCK_DIR", "")
    for device in os.environ.get("AIRFLOW_VLLM_BATCH_GPUS", "").split(","):
        if not device:
            continue
        # A new open file: it conflicts with the lease's lock even in the process that inherited it.
        with open(os.path.join(lock_dir, f"gpu-{device}.lock"), "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked[device] = False
            except OSError:
                locked[device] = True
    with open(path, "w") as f:
        json.dump(
            {
                "CUDA_VISIBLE_DEVICES": visible,
                "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER"),
                "locked": locked,
            },
            f,
        )


def answer_slowly(output: str, answers: list[dict], wedge_after: int | None) -> int:
    """Answer one request at a time, each in a progress report; wedge after ``wedge_after`` of them."""
    # vLLM 0.33 writes its local output as it goes; 0.32 only at the end.
    # Not a with block: a wedged engine never closes it (it is killed), as vLLM 0.33's runner would not.
    out = open(output, "w") if os.environ.get("FAKE_ENGINE_VLLM", "0.32") == "0.33" else None  # noqa: SIM115
    pause = float(os.environ.get("FAKE_ENGINE_SLOW", "0"))
    total = len(answers)
    for n, a in enumerate(answers, start=1):
        if wedge_after is not None and n > wedge_after:
            while True:  # wedged: the same count again, and the hung-process warning; never an answer
                print(PROGRESS.format(pct=100 * (n - 1) / total, n=n - 1, total=total), flush=True)
                print(WAITING, flush=True)
                time.sleep(0.2)
        time.sleep(pause)
        if out is not None:
            out.write(json.dumps(a) + "\n")
            out.flush()
        print(PROGRESS.format(pct=100 * n / total, n=n, total=total), flush=True)
    if out is None:
        write(output, b"".join(json.dumps(a).encode() + b"\n" for a in answers))
    else:
        out.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("-i", required=True)
    parser.add_argument("-o", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-inflight", type=int, default=None)
    args, unknown = parser.parse_known_args()
    if echo := os.environ.get("FAKE_ENGINE_ECHO_ARGS"):
        print(f"INFO [arg_utils.py:1] non-default args: {unknown!r}", flush=True)
        print(f"INFO [run_batch.py:1] Reading batch from {args.i}...", flush=True)
        if echo == "fail":
            print(f"error: unrecognized arguments: {' '.join(unknown)}", flush=True)
            return 2
    if calls := os.environ.get("FAKE_ENGINE_CALLS"):
        with open(calls, "a") as f:
            f.write(" ".join(sys.argv[1:3]).split("?")[0] + "\n")
    if probe := os.environ.get("FAKE_ENGINE_GPU_PROBE"):
        write_gpu_probe(probe)
    if pid := os.environ.get("FAKE_ENGINE_PID"):
        with open(pid, "w") as f:
            f.write(str(os.getpid()))
    if code := int(os.environ.get("FAKE_ENGINE_EXIT", "0")):
        return code
    requests = [json.loads(line) for line in read(args.i).splitlines() if line.strip()]
    requests = requests[: len(requests) - int(os.environ.get("FAKE_ENGINE_DROP", "0"))]
    failing = int(os.environ.get("FAKE_ENGINE_FAIL", "0"))
    # vLLM names the adapter that answered (or the base model): the request's own name here.
    answers = [
        fail(r) if i < failing else answer(r, r["body"].get("model") or args.model)
        for i, r in enumerate(requests)
    ]
    if sent := os.environ.get("FAKE_ENGINE_SENT"):
        with open(sent, "a") as f:
            f.write(",".join(r["custom_id"] for r in requests) + "\n")
    if (wedge := os.environ.get("FAKE_ENGINE_WEDGE_AFTER")) is not None or os.environ.get("FAKE_ENGINE_SLOW"):
        return answer_slowly(args.o, answers, int(wedge) if wedge is not None else None)
    dies_at = None
    if (dies_after := os.environ.get("FAKE_ENGINE_DIES_AFTER")) is not None and int(dies_after) < len(
        requests
    ):
        once = os.environ.get("FAKE_ENGINE_DIES_ONCE")
        if not once or not os.path.exists(once):
            dies_at = int(dies_after)
            if once:
                open(once, "w").close()
    if (killer := os.environ.get("FAKE_ENGINE_KILLER")) in [r["custom_id"] for r in requests]:
        at_once = args.max_inflight or args.max_num_seqs
        position = [r["custom_id"] for r in requests].index(killer)
        dies_at = position - position % at_once  # the start of the group it runs in
    if dies_at is None:
        write(args.o, b"".join(json.dumps(a).encode() + b"\n" for a in answers))
        return 0
    if os.environ.get("FAKE_ENGINE_VLLM", "0.32") == "0.33":
        write(args.o, b"".join(json.dumps(a).encode() + b"\n" for a in answers[:dies_at]))
        print("Traceback (most recent call last):")
        print(
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause."
        )
        return 1
    answers[dies_at:] = [engine_dead(r) for r in requests[dies_at:]]
    write(args.o, b"".join(json.dumps(a).encode() + b"\n" for a in answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
