"""When the batch runner's engine dies mid-run: what it finished, what it had in flight, and what runs next.

vLLM's runner reports a dead engine in two ways, read from its own sources:

* **vLLM 0.32** exits 0. It submits every request at once and writes its output only at
  the end, in input order; every request still unfinished when the engine core died is a
  line whose error is the message of vLLM's dead-engine error type, ``EngineDeadError``
  (:data:`ENGINE_DEAD_MESSAGE`, an HTTP 500).
* **vLLM 0.33** exits non-zero, its traceback ending in ``EngineDeadError``. It checks
  every line before loading the model, then writes its (local) output as it goes, in input
  order: the lines written before the death are a prefix of final answers. It writes no
  line for a request the dead engine failed (its client message no longer says
  "EngineCore"; :data:`ENGINE_DEAD_CLIENT_MESSAGE` is taken as unanswered all the same in a
  run that died).

So a death is: a non-zero exit after the runner started writing its output (or with
``EngineDeadError`` in its log), or an exit 0 with :data:`ENGINE_DEAD_MESSAGE` lines. What is
answered either way is the output's final lines; everything else of the run's input is
unanswered.

**The rule** (invariants *Durability* and *Bounded*, see ``docs/protocol.md``):

1. The final answers of a dying runner are staged as a checkpoint part of the run (as the
   server engine's), and a retry, in this try or Airflow's, sends only what no part answers.
2. The *suspects* of a death are the requests it may have had in flight: the first
   ``max_num_seqs`` of its unanswered requests, in input order (vLLM's scheduler runs no
   more than ``--max-num-seqs`` at once, first come first served, and the runner submits
   in input order; 256 when the sizes are unknown). They are recorded durably in the run's
   staging (``<run>/deaths/``).
3. After a death of a full run, the next run takes its suspects *isolated*: only them,
   one in flight at a time (0.33: ``--max-inflight 1``; 0.32: ``--max-num-seqs 1``). Its
   first unanswered request is then the only one that was in flight.
4. A request in flight at two deaths in a row (a suspect of a full run's death, then the
   one request in flight when the isolated run died) is answered as failed, ``error.code``
   ``"engine_crash"``, in a part like any answer: it lands in the error file and the
   manifest's ``failed_by_reason``, and the rest of the batch goes on.
5. An isolated run that ends without a death (its suspects were innocent: a transient
   death, or a killer beyond them) is recorded too; the next run is a full run again.

Every death thus answers or isolates at least one request, so a batch whose requests
kill the engine still completes; a wrong guess in 2 costs only another isolated run.
Plain Python: no Airflow, no S3.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec

from airflow_vllm_batch.batchfile import CustomIdIndex
from airflow_vllm_batch.batchfile.models import error_message
from airflow_vllm_batch.batchfile.results import ENGINE_DEAD_MESSAGE
from airflow_vllm_batch.docs_links import doc_ref

#: The type of vLLM's dead-engine error, as its traceback names it (0.33's runner dies with it).
DEAD_ENGINE_ERROR = "EngineDeadError"
#: ``EngineDeadError.CLIENT_MESSAGE`` of vLLM 0.33: what a request failed by the dead engine is answered.
ENGINE_DEAD_CLIENT_MESSAGE = "The server had an error while processing your request."
#: ``error.code`` of a request answered as failed because it was in flight at two engine deaths in a row.
ENGINE_CRASH = "engine_crash"
#: Suspects of one death when the engine's ``--max-num-seqs`` is unknown (vLLM's default on GPUs).
DEFAULT_SUSPECTS = 256


class _Status(msgspec.Struct, gc=False):
    status_code: Any = None


class _Line(msgspec.Struct, gc=False):
    custom_id: Any = None
    response: _Status | None = None
    error: Any = None


_decode_line = msgspec.json.Decoder(_Line).decode


def engine_died_in_log(tail: Sequence[str]) -> bool:
    """Whether the engine's last log lines name vLLM's dead-engine error type."""
    return any(DEAD_ENGINE_ERROR in line for line in tail)


def is_engine_dead_line(raw: bytes, *, died: bool) -> bool:
    """Whether a result line is vLLM's answer of a dead engine (not a final answer).

    :param raw: one result line.
    :param died: whether the run is known to have died (then 0.33's client message counts too).
    """
    if b"encountered an issue" not in raw and not (died and b"had an error while processing" in raw):
        return False  # the common case, without decoding
    try:
        line = _decode_line(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return False
    message = error_message(line.error)
    return message == ENGINE_DEAD_MESSAGE or (died and message == ENGINE_DEAD_CLIENT_MESSAGE)


@dataclass
class Split:
    """A runner's output, split: final answers (written out) and the dead engine's lines.

    :param answered: the custom_ids of the final answers.
    :param dead_lines: lines that are the dead engine's answers (0.32).
    :param cut: lines left out after the first unreadable one of a run that died (a line cut by the death).
    """

    answered: CustomIdIndex = field(default_factory=CustomIdIndex)
    dead_lines: int = 0
    cut: int = 0


def split_output(lines: Iterable[bytes], answers_out: IO[bytes], *, died: bool) -> Split:
    """Write the final answers of a runner's output to ``answers_out``; count what is not one.

    :param lines: the output's lines.
    :param answers_out: gets every final answer, newline-terminated, byte for byte.
    :param died: whether the run died (exit status or log): a line that cannot be read ends its
        output (the death cut it), and 0.33's client message is the dead engine's.
    """
    split = Split()
    number = 0
    stop = False
    for raw in lines:
        if stop:
            split.cut += 1
            continue
        if not raw.strip():
            continue
        if is_engine_dead_line(raw, died=died):
            split.dead_lines += 1
            continue
        try:
            custom_id = _decode_line(raw).custom_id
        except (msgspec.DecodeError, UnicodeDecodeError):
            if died:
                stop = True
                split.cut += 1
                continue
            custom_id = None  # the results check names it
        number += 1
        if isinstance(custom_id, str):
            split.answered.add(custom_id, number)
        answers_out.write(raw if raw.endswith(b"\n") else raw + b"\n")
    return split


def unanswered(ids: Iterable[str], *answered: CustomIdIndex) -> Iterator[str]:
    """The custom_ids no index answers, in their order."""
    for custom_id in ids:
        if all(index.line_of(custom_id) is None for index in answered):
            yield custom_id


@dataclass
class Death:
    """One engine run that the rule remembers (see the module docs), as staged in ``<run>/deaths/``.

    :param suspects: the requests it may have had in flight (one for an isolated run's death).
    :param isolated: whether it was an isolated run (its suspects one at a time).
    :param died: False for an isolated run that ended without a death.
    :param exit: how the engine ended, for the task log.
    """

    suspects: list[str]
    isolated: bool = False
    died: bool = True
    exit: str = ""

    def to_json(self) -> bytes:
        return msgspec.json.encode(
            {"suspects": self.suspects, "isolated": self.isolated, "died": self.died, "exit": self.exit}
        )

    @classmethod
    def from_json(cls, data: bytes) -> Death:
        raw = msgspec.json.decode(data)
        return cls(
            suspects=[str(s) for s in raw.get("suspects", [])],
            isolated=bool(raw.get("isolated")),
            died=bool(raw.get("died", True)),
            exit=str(raw.get("exit", "")),
        )


def to_isolate(deaths: Sequence[Death], answered: CustomIdIndex) -> list[str]:
    """The requests the next run takes isolated: the unanswered suspects of the last death, when a full run died."""
    if not deaths or deaths[-1].isolated or not deaths[-1].died:
        return []
    return list(unanswered(deaths[-1].suspects, answered))


def crash_line(custom_id: str, deaths: int) -> bytes:
    """The failed answer of a request that was in flight at two engine deaths in a row."""
    message = (
        f"The vLLM engine died twice in a row with this request in flight, the second time alone ({deaths} deaths "
        "in this run), so it is answered as failed. Look for the engine's crash in the task log "
        f"({doc_ref('Troubleshooting', 'The engine kept dying')})."
    )
    return (
        msgspec.json.encode(
            {
                "id": f"vllm-engine-crash-{custom_id}",
                "custom_id": custom_id,
                "response": {"status_code": 500, "request_id": None, "body": None},
                "error": {"code": ENGINE_CRASH, "message": message, "line": None},
            }
        )
        + b"\n"
    )
