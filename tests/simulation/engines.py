"""Engine stand-ins that run the real engines' code around a simulated vLLM.

:class:`SimRunnerEngine` is the real :class:`~airflow_vllm_batch.engines.runner.RunnerEngine`
(its ``produce``, staging, input re-check, dead-engine classification, the "Starting the vLLM
engine" line and :class:`~airflow_vllm_batch.hooks.vllm.VLLMEngineHook`'s relay of the
engine's log lines) with only the process replaced: :class:`SimRunnerProcess` answers the
requests one step at a time, reporting each in vLLM's progress report, and can crash (exit 1),
die the vLLM 0.32 way (exit 0, every request left answered with ``EngineCore`` 500s), stall
(for less than the stall bound), wedge (no progress ever again, its answers so far in its
output as vLLM 0.33 writes them, until the runner's stall bound stops it), or answer a request
as failed.

:class:`SimServerEngine` is the real server engines' ``produce`` (checkpoint parts, resume
from them, the last try's set-aside lines) with the HTTP stream replaced by
:class:`SimServer`, which answers through the real :class:`~airflow_vllm_batch.serving.Journal`
(each checkpoint handed over with ``Journal.adopt``, uploaded by the engine's own
lease-checked ``on_part``). The server can die (the try fails, retryable), answer a
request twice, answer 429/5xx until the retries run out (set aside), stall, or write a line no
results check accepts (cut short, or answering a request not in the input). Either may find the
worker's disk full while it writes (the runner's output, a checkpoint part): the write stops
half-way and the engine fails.

An answer echoes its request's message, so the invariants can tell an answer to the current
input from a stale one (One identity).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_vllm_batch.engines.base import EngineInfo
from airflow_vllm_batch.engines.local import LocalEngine
from airflow_vllm_batch.engines.options import VLLMRunner, VLLMServer
from airflow_vllm_batch.engines.runner import RunnerEngine
from airflow_vllm_batch.engines.server import _Streaming
from airflow_vllm_batch.engines.vllm.command import FALLBACK_SUPPORTED_URLS
from airflow_vllm_batch.engines.vllm.model_names import ServedModels, served_models
from airflow_vllm_batch.exceptions import ServerUnavailableError
from airflow_vllm_batch.gpus import GPUPlan
from airflow_vllm_batch.hooks.vllm import VLLMEngineHook
from airflow_vllm_batch.serving import StreamStats

if TYPE_CHECKING:
    from tests.simulation.world import World

SIM_VLLM_VERSION = "0.32.0+sim"


def answer_line(request: dict, status: int = 200, *, dead: bool = False, tag: str = "") -> bytes:
    """vLLM's batch output line for ``request``: an answer echoing its last message, or an error.

    :param tag: who answered (the try): in the line's ids, as vLLM's request ids differ from run to run,
        so two tries' results are never byte for byte the same (a racing conditional write then shows).
    """
    cid = request["custom_id"]
    rid = f"r-{cid}-{tag}" if tag else f"r-{cid}"
    if status == 200:
        content = request["body"]["messages"][-1]["content"]
        body = {
            "id": f"chatcmpl-{cid}",
            "object": "chat.completion",
            "model": request["body"].get("model", "m"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"echo:{content}"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
        line = {
            "id": f"vllm-{cid}",
            "custom_id": cid,
            "response": {"status_code": 200, "request_id": rid, "body": body},
            "error": None,
        }
    else:
        message = (
            "EngineCore encountered an issue. See stack trace (above) for the root cause."
            if dead
            else f"HTTP {status}"
        )
        line = {
            "id": f"vllm-{cid}",
            "custom_id": cid,
            "response": {"status_code": status, "request_id": rid, "body": None},
            "error": {
                "message": message,
                "type": "BadRequestError" if status < 500 else "InternalServerError",
                "code": status,
            },
        }
    return json.dumps(line).encode()


# -- the runner ------------------------------------------------------------------------


class SimRunnerProcess:
    """The batch runner's process: reads ``-i``, answers each request as a step, writes ``-o``."""

    def __init__(self, world: World, argv: list[str]) -> None:
        self.world = world
        self.argv = argv
        self.returncode: int | None = None
        self.pid = -1

    def lines(self) -> Any:
        world, argv = self.world, self.argv
        source, target = argv[argv.index("-i") + 1], argv[argv.index("-o") + 1]
        # vLLM prints its arguments at start: a secret flag's value is in this line (what the relay must hide).
        yield f"INFO 01-01 00:00:00 [api_server.py:1] vLLM API server version {SIM_VLLM_VERSION}".encode()
        yield (
            "INFO 01-01 00:00:00 [run_batch.py:1] args: Namespace(" + ", ".join(_namespace(argv)) + ")"
        ).encode()
        requests = world.read_engine_input(source)
        actor = world.scheduler.current_actor()
        tag = actor.try_label if actor is not None and actor.try_label else ""
        out: list[bytes] = []
        dead = False
        for number, request in enumerate(requests, start=1):
            if dead:
                out.append(answer_line(request, 500, dead=True, tag=tag))
                continue
            fate = world.engine_fate(runner=True)
            if self.returncode is not None:
                return  # stopped meanwhile (the stall bound fired while a long stall ran): nothing more is written
            if fate == "wedge":
                with open(target, "wb") as f:
                    f.write(b"".join(line + b"\n" for line in out))
                yield WAITING_LINE
                # No progress ever again: only the runner's stall bound (its hook's terminate) ends this.
                world.scheduler.wait_until(lambda: self.returncode is not None, None)
                return
            if fate == "crash":
                self.returncode = 1
                yield b"RuntimeError: CUDA error: an illegal memory access was encountered"
                return
            if fate == "die":
                dead = True
                yield b"ERROR [core.py:1] EngineCore encountered a fatal error."
                out.append(answer_line(request, 500, dead=True, tag=tag))
                continue
            out.append(answer_line(request, 400 if fate == "fail" else 200, tag=tag))
            world.note_sent(request["custom_id"], Path(target).parent)
            yield f"Running batch: {100 * number / len(requests):3.0f}% Completed | {number}/{len(requests)} [00:01<00:01]".encode()
        text = b"\n".join(out) + (b"\n" if out and world.rng.random() < 0.8 else b"")
        with open(target, "wb") as f:
            if world.disk_is_full():
                # The disk fills while vLLM writes its output: part of it written, the process fails.
                f.write(text[: len(text) // 2])
                self.returncode = 1
                yield b"OSError: [Errno 28] No space left on device"
                return
            f.write(text)
        self.returncode = 0

    def wait(self) -> int:
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode


#: vLLM's warning that a process of its engine waits for a hung one (no progress).
WAITING_LINE = b"WARNING [shm_broadcast.py:1] No available shared memory broadcast block found in 60 seconds."


def _namespace(argv: list[str]) -> list[str]:
    pairs, i = [], 0
    while i < len(argv):
        if argv[i].startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append(f"{argv[i][2:].replace('-', '_')}='{argv[i + 1]}'")
            i += 2
        else:
            i += 1
    return pairs


class SimEngineHook(VLLMEngineHook):
    """The real hook (its relay, redaction and tail) reading a :class:`SimRunnerProcess` instead of a pipe."""

    def _output_lines(self, process: Any) -> Any:
        yield from process.lines()

    def terminate(self) -> None:
        # The real stop path's effect (SIGTERM to the group): a process still running ends, killed.
        process = self.process
        if isinstance(process, SimRunnerProcess) and process.returncode is None:
            process.returncode = -15
            process.world.engine_stopped(process)


class SimRunnerEngine(RunnerEngine):
    """The runner engine with a simulated vLLM process."""

    name = "sim-runner"
    world: World | None = None

    def inspect(self) -> EngineInfo:
        return EngineInfo(vllm_version=SIM_VLLM_VERSION, supported_urls=FALLBACK_SUPPORTED_URLS)

    def gpu_plan(self) -> GPUPlan:
        return GPUPlan(0)

    def leased_gpus(self, env: dict[str, str], holder: Any) -> Any:
        return contextlib.nullcontext(())

    def engine_arguments(self, info: EngineInfo) -> list[str]:
        # The real one runs vLLM's parser in the engine's Python (seconds); the arguments are the user's.
        return list(self.options.args)

    @cached_property
    def hook(self) -> VLLMEngineHook:
        hook = SimEngineHook(kill_grace_s=self.options.kill_grace_s)
        hook._log = logging.getLogger("airflow.task.hooks.sim_engine")  # captured like the task log
        return hook


# -- the server ------------------------------------------------------------------------


class SimServer:
    """What ``VLLMServerEngine.run`` does, answered by the simulation: stream into the journal, skip what parts answer."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.pass_fds: tuple[int, ...] = ()
        self.max_in_flight = 4

    def run(self, requests: Any, *, journal: Any, skip: Any = None, **_: Any) -> StreamStats:
        world = self.world
        stats = StreamStats()
        chunk: list[bytes] = []
        checkpoint_every = world.rng.randint(1, 4)
        actor = world.scheduler.current_actor()
        tag = actor.try_label if actor is not None and actor.try_label else ""
        for _number, raw in requests:
            if not raw.strip():
                continue
            request = json.loads(raw)
            stats.read += 1
            if skip is not None and skip(request["custom_id"]):
                stats.skipped += 1
                continue
            fate = world.engine_fate(runner=False)
            if fate == "die":
                self._checkpoint(journal, chunk)
                raise ServerUnavailableError(
                    "The vLLM server stopped answering (simulated death); the task's retry resumes."
                )
            if fate == "transient":
                # 429/5xx through every retry: not a final answer, set aside (never in a checkpoint).
                journal.set_aside(answer_line(request, 503, tag=tag))
                stats.unanswered += 1
                stats.unanswered_reasons["HTTP 503"] = stats.unanswered_reasons.get("HTTP 503", 0) + 1
                stats.unanswered_example = stats.unanswered_example or request["custom_id"]
                continue
            line = answer_line(request, 400 if fate == "fail" else 200, tag=tag)
            if fate == "garbled" and world.rng.random() < 0.5:
                # The line cut short (a server that died mid-write): no answer, and a part no check accepts.
                chunk.append(line[: len(line) // 2])
                stats.done += 1
                continue
            world.note_sent(request["custom_id"], journal.directory.parent)
            chunk.append(line)
            if fate == "garbled":
                # An answer to a request the input does not hold (a mixed-up id).
                chunk.append(answer_line({**request, "custom_id": f"{request['custom_id']}-stray"}, tag=tag))
            if fate == "twice":
                chunk.append(line)
            stats.done += 1
            stats.failed += fate == "fail"
            if len(chunk) >= checkpoint_every:
                self._checkpoint(journal, chunk)
        self._checkpoint(journal, chunk)
        stats.durable = journal.lines_durable
        return stats

    def _checkpoint(self, journal: Any, chunk: list[bytes]) -> None:
        """Hand the answers so far to the journal as one sealed part (uploaded by the engine's ``on_part``)."""
        if not chunk:
            return
        path = journal.directory / f"sim-part-{journal.next_index}.jsonl"
        data = b"".join(line + b"\n" for line in chunk)
        if self.world.disk_is_full():
            # The disk fills while the journal writes the part: part of it on disk, never sealed nor adopted.
            path.write_bytes(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        path.write_bytes(data)
        chunk.clear()
        journal.adopt(path)

    def terminate(self) -> None:
        pass


class SimServerEngine(_Streaming):
    """The server engine's real ``produce`` around a :class:`SimServer`."""

    name = "sim-server"
    world: World | None = None
    #: A server has no command prefix (the real ServerEngine's, from LocalEngine); the identity reads it.
    command: tuple[str, ...] | None = None

    @cached_property
    def served(self) -> ServedModels:
        return served_models(self.settings.model, list(self.options.args))

    def inspect(self) -> EngineInfo:
        return self.restrict(
            EngineInfo(vllm_version=SIM_VLLM_VERSION, supported_urls=FALLBACK_SUPPORTED_URLS)
        )

    def identity(self) -> dict[str, Any]:
        return {**LocalEngine.identity(self), "engine": "server"}  # type: ignore[arg-type]

    @cached_property
    def server(self) -> SimServer:  # type: ignore[override]
        assert self.world is not None
        return SimServer(self.world)


# -- their options (``engine=`` of the run's settings) ---------------------------------------


class SimRunner(VLLMRunner):
    """The runner's options, naming the simulated runner engine."""

    def engine_class(self) -> type[SimRunnerEngine]:
        return SimRunnerEngine


class SimServerOptions(VLLMServer):
    """The server's options, naming the simulated server engine."""

    def engine_class(self) -> type[SimServerEngine]:
        return SimServerEngine


#: The options class of each engine a schedule may draw.
SIM_ENGINES = {"sim-runner": SimRunner, "sim-server": SimServerOptions}
