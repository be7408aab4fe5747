"""Parse engine arguments with the engine environment's own vLLM argument parser.

This file runs as a script in the *engine's* Python (``python -I argcheck.py``),
which may be a different environment from Airflow's, so it imports nothing from
``airflow_vllm_batch`` (only :mod:`probe` beside it, by path, which is standard
library); it imports only the vLLM module that builds the parser of the chosen
entrypoint (no engine, no model, no GPU), found by following the entrypoint's module (what
``python -m <module>`` runs) to its ``make_arg_parser``. It reads one JSON object on
stdin, a list of argument lists to check (several share one import, which is the slow
part); ``module`` is optional (default: :data:`ENTRY_MODULES`)::

    {"checks": [{"entrypoint": "run_batch", "module": "vllm.entrypoints.launchers.run_batch",
                 "argv": ["-i", "x", "-o", "y", "--model", "m", ...]}]}

and prints one JSON object as the last line of stdout, a result for each check::

    {"engine_argcheck": 1, "results": [{"ok": false, "stage": "parse",
     "error": "argument --max-model-len: invalid human_readable_int_or_auto value: 'abc'",
     "help": "python -m vllm.entrypoints.launchers.run_batch --help", "import_s": 7.9, "parse_s": 0.2}]}

With ``"offline_defaults": {"world_size": N}`` in the request, the result line also holds
the scheduler sizes this vLLM gives its offline entry point on this machine's device
(:func:`offline_defaults`), read in the same run, so the slow import is paid once::

    "offline_defaults": {"max_num_seqs": 256, "max_num_batched_tokens": 4096, "device": "cpu", "world_size": 1}

``stage`` is ``"import"`` (the parser could not be built: no or broken vLLM),
``"parse"`` (argparse refused the arguments) or ``"validate"`` (the entrypoint's own
quick checks, run before it loads a model, refused them).

The engines a task starts call :func:`check` and :func:`offline_defaults` in their own
process instead, from :mod:`engine_launcher` (which loads this file by its path), so a
task imports vLLM once.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

#: The module each entrypoint is started as (``python -m``), unless the request names another.
ENTRY_MODULES = {
    "run_batch": "vllm.entrypoints.launchers.run_batch",
    "api_server": "vllm.entrypoints.openai.api_server",
}

#: The quick checks each entrypoint runs on its parsed arguments before loading a model.
VALIDATORS = {"run_batch": "validate_run_batch_args", "api_server": "validate_parsed_serve_args"}

#: Marks the result line, so log lines a vLLM import prints to stdout are never mistaken for it.
RESULT_KEY = "engine_argcheck"


class ArgumentsRejected(Exception):
    """argparse refused the arguments (raised instead of printing usage and exiting)."""


@functools.lru_cache(maxsize=1)
def _entry_point_reader():
    """Load :mod:`probe` (next to this file) for its :func:`follow_entry_point`.

    Both files run as scripts in the engine's Python with ``-I``, which keeps this
    directory off ``sys.path``, so it is loaded by its path.
    """
    spec = importlib.util.spec_from_file_location("_engine_probe", Path(__file__).with_name("probe.py"))
    # A .py file next to this one: it has a spec and a loader.
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _help_command(entrypoint: str, module: str) -> str:
    return "vllm serve --help" if entrypoint == "api_server" else f"python -m {module} --help"


def _load_parser_module(entrypoint: str, entry_module: str | None = None):
    """Import the module whose ``make_arg_parser`` the entry point uses; return it, its help command and its validator.

    The parser is found by following the entry point's own code (what its ``__main__``
    block runs), not from a list of places it has lived: vLLM 0.33 moved the server's
    parser to ``vllm.entrypoints.common.cli_args`` behind the same entry point.
    """
    entry_module = entry_module or ENTRY_MODULES[entrypoint]
    reader = _entry_point_reader()
    root = reader.vllm_root()
    if root is None:
        raise ImportError("No module named 'vllm'")
    if reader.module_path(root, entry_module) is None:
        raise ImportError(f"No module named {entry_module!r} (the {entrypoint} entry point)")
    parser_module = reader.follow_entry_point(root, entry_module, "make_arg_parser")
    if parser_module is None:
        raise ImportError(f"{entry_module}: its entry point leads to no make_arg_parser")
    module = importlib.import_module(parser_module)
    if not hasattr(module, "make_arg_parser"):
        raise ImportError(f"{parser_module}: no make_arg_parser")
    validator = None
    validator_module = reader.follow_entry_point(root, entry_module, VALIDATORS[entrypoint])
    if validator_module is not None:
        validator = getattr(importlib.import_module(validator_module), VALIDATORS[entrypoint], None)
    return module, _help_command(entrypoint, entry_module), validator


def _raising_parser_class():
    """Return vLLM's ``FlexibleArgumentParser`` changed to raise on a bad argument instead of exiting."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # where 0.32 and 0.33 keep it

    class RaisingArgumentParser(FlexibleArgumentParser):
        def error(self, message):
            # argparse's hook for every refusal: it would print usage and exit(2).
            raise ArgumentsRejected(message)

        def exit(self, status=0, message=None):
            raise ArgumentsRejected(
                f"asks the parser to print and exit (--help or --version?){': ' + message.strip() if message else ''}"
            )

    return RaisingArgumentParser


def _hint(message: str) -> str:
    """Add what to use instead of an option vLLM removed."""
    if message.startswith("unrecognized arguments:") and re.search(r"(^|\s)--task(=|\s|$)", message):
        return message + (
            " (--task was removed: use --runner pooling, and --convert embed or classify"
            " to adapt a generative model)"
        )
    return message


def known_options(parser) -> list[str]:
    """The long options ``parser`` knows (``--max-model-len``, ``--no-enable-prefix-caching``...)."""
    return sorted(o for o in getattr(parser, "_option_string_actions", {}) if o.startswith("--"))


def _did_you_mean(message: str, parser) -> str:
    """Add the closest known flags to an ``unrecognized arguments`` message (a misspelled flag: ``--max-modle-len``)."""
    if parser is None:
        return message
    return did_you_mean(message, known_options(parser))


def did_you_mean(message: str, known: list[str]) -> str:
    """Add the closest of the ``known`` flags to an ``unrecognized arguments`` message."""
    if not message.startswith("unrecognized arguments:"):
        return message
    guesses = []
    for token in message.removeprefix("unrecognized arguments:").split():
        flag = token.split("=", 1)[0].replace("_", "-")
        if flag.startswith("--") and flag not in known:
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
            if close:
                guesses.append(f"{close[0]} for {token.split('=', 1)[0]}")
    return message + (f" (did you mean {', '.join(guesses)}?)" if guesses else "")


def check(entrypoint: str, argv: list[str], entry_module: str | None = None) -> dict:
    """Parse ``argv`` as ``entrypoint`` would; return the result object (see the module docstring).

    :param entrypoint: ``"run_batch"`` or ``"api_server"``.
    :param argv: the arguments.
    :param entry_module: the module the entrypoint is started as; default :data:`ENTRY_MODULES`'.
    """
    result: dict = {"ok": False, "stage": "import", "entrypoint": entrypoint}
    started = time.monotonic()
    try:
        module, help_cmd, validator = _load_parser_module(entrypoint, entry_module)
        parser_class = _raising_parser_class()
    except Exception as exc:  # noqa: BLE001 - any failure here means no usable vLLM parser
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["import_s"] = round(time.monotonic() - started, 3)
        return result
    result["import_s"] = round(time.monotonic() - started, 3)
    result["help"] = help_cmd
    result["parser_module"] = module.__name__

    started = time.monotonic()
    result["stage"] = "parse"
    parser = None
    try:
        parser = module.make_arg_parser(parser_class())
        # What this vLLM's parser knows, so that a misspelling can be refused next time without the import.
        result["options"] = known_options(parser)
        args = parser.parse_args(argv)
        result["stage"] = "validate"
        if validator is not None:
            validator(args)
    except ArgumentsRejected as exc:
        result["error"] = _did_you_mean(_hint(str(exc)), parser)
    except Exception as exc:  # noqa: BLE001 - vLLM raises ValueError, TypeError, KeyError here
        text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        result["error"] = text.removeprefix("Error: ") or type(exc).__name__
    else:
        result["ok"] = True
        result.pop("stage")
    result["parse_s"] = round(time.monotonic() - started, 3)
    return result


def offline_defaults(world_size: int) -> dict:
    """Return the scheduler sizes vLLM gives its offline entry point (the ``LLM`` class) on this device.

    vLLM keeps one table per device and entry point (``EngineArgs.get_batch_defaults``);
    the batch runner's usage context has no row there and falls back to
    ``SchedulerConfig``'s defaults (128 sequences, 2048 tokens) on every device, so an
    H100 runs the runner at an eighth of what vLLM itself uses offline. The table is read
    from the vLLM installed here, never copied, so it follows vLLM's upgrades.

    :param world_size: tensor parallel size times pipeline parallel size (the CPU rows scale with it).
    """
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    tokens, seqs = EngineArgs.get_batch_defaults(world_size)
    return {
        "max_num_seqs": seqs.get(UsageContext.LLM_CLASS, SchedulerConfig.DEFAULT_MAX_NUM_SEQS),
        "max_num_batched_tokens": tokens.get(
            UsageContext.LLM_CLASS, SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
        ),
        "device": _device_name(),
        "world_size": world_size,
    }


def _device_name() -> str:
    """The name of the device vLLM runs on here, for the log line (``NVIDIA H100 80GB HBM3``, ``cpu``)."""
    from vllm.platforms import current_platform

    try:
        name = current_platform.get_device_name()
    except Exception:  # noqa: BLE001 - vLLM itself falls back the same way when the device cannot be asked
        name = ""
    return str(name or current_platform.device_type or "unknown")


def main() -> int:
    """Read the checks on stdin, print the results as the last stdout line."""
    request = json.load(sys.stdin)
    answer: dict = {RESULT_KEY: 1}
    # vLLM logs to stdout; keep the result line the only JSON object we print there.
    with contextlib.redirect_stdout(sys.stderr):
        answer["results"] = [
            check(c["entrypoint"], [str(a) for a in c["argv"]], c.get("module")) for c in request["checks"]
        ]
        if "offline_defaults" in request:
            try:
                answer["offline_defaults"] = offline_defaults(int(request["offline_defaults"]["world_size"]))
            except Exception as exc:  # noqa: BLE001 - reported, the caller decides what a failure means
                answer["offline_defaults"] = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    code = main()
    # A normal exit tears down torch and vLLM's imports, which costs 2-3 s more than the
    # whole parse; nothing here needs cleaning up, so leave at once.
    os._exit(code)
