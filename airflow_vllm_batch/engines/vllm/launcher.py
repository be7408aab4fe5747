"""Start a vLLM entry point after checking its arguments and sizing its scheduler, in the engine's own process.

vLLM is imported once per engine start, by the engine itself: this file runs first in the
engine's Python, checks the engine's ``args`` with the entry point's own parser and reads vLLM's
offline scheduler defaults (the work :mod:`~airflow_vllm_batch.engines.vllm.argcheck` does, which it loads and
calls), then hands over to the entry point in the same interpreter, as ``python -m`` would
(:func:`runpy.run_module`). The modules the check imports are the ones the entry point
imports anyway, so a fresh worker (a new Kubernetes pod, an empty ``results_dir``) no
longer pays a second import of vLLM and torch in a separate process (seconds) before the
engine starts. A refused flag still stops the engine before it loads a model or takes
any GPU memory, with the check's own message.

The engine's environment may not have ``airflow_vllm_batch`` installed, so this file
imports only the standard library and :mod:`~airflow_vllm_batch.engines.vllm.argcheck` beside it, by path; the task
starts it as ``python -c <bootstrap> <module>`` (:func:`bootstrap`). Two environment
variables carry its instructions and are dropped once read (a process's command line is
world-readable, its environment is not):

* :data:`ARGV_ENV`: the entry point's arguments, a JSON list (presigned URLs among them);
* :data:`LAUNCH_ENV`: what to do before the hand-over, a JSON object, all keys optional::

    {"entrypoint": "run_batch",            # whose parser and quick checks (argcheck.py)
     "check": ["-i", "input.jsonl", ...],  # the arguments to check, as the task checked them before
     "sizing": {...},                      # sizing_plan(): what the user set, the rest from the defaults
     "insert_at": 8,                       # where the chosen size flags go in the arguments (default: the end)
     "report": "/scratch/engine-launch.json"}

The report (written before the hand-over, replaced atomically) tells the task what
happened: ``{"check": <argcheck.py result>, "offline_defaults": {...} or {"error": ...},
"sizes": {"flags": [...], "max_num_seqs": N, "max_num_batched_tokens": N, "note": "..."}}``.
A refused check is written there and the process exits with :data:`ARGUMENTS_REFUSED_EXIT`
without starting the entry point.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import runpy
import sys
import warnings
from pathlib import Path

#: The entry point's arguments (a JSON list).
ARGV_ENV = "AIRFLOW_VLLM_BATCH_ENGINE_ARGV"
#: What to do before the hand-over (a JSON object, see the module docstring).
LAUNCH_ENV = "AIRFLOW_VLLM_BATCH_ENGINE_LAUNCH"
#: The exit status when the entry point's parser refused the arguments (``EX_CONFIG`` of sysexits.h).
ARGUMENTS_REFUSED_EXIT = 78

MAX_NUM_SEQS = "--max-num-seqs"
MAX_NUM_BATCHED_TOKENS = "--max-num-batched-tokens"


def bootstrap() -> str:
    """The ``python -c`` code that loads this file by its path and runs :func:`main` (``sys.argv[1]`` is the module)."""
    return (
        "import importlib.util as u\n"
        f"s = u.spec_from_file_location('_airflow_vllm_batch_launcher', {str(Path(__file__).resolve())!r})\n"
        "m = u.module_from_spec(s)\n"
        "s.loader.exec_module(m)\n"
        "m.main()\n"
    )


@functools.lru_cache(maxsize=1)
def _argcheck():
    """Load :mod:`~airflow_vllm_batch.engines.vllm.argcheck` (next to this file) by its path: the engine's Python may not have this package."""
    spec = importlib.util.spec_from_file_location("_engine_argcheck", Path(__file__).with_name("argcheck.py"))
    # A .py file next to this one: it has a spec and a loader.
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def needs_defaults(plan: dict) -> bool:
    """Whether the sizes of ``plan`` need vLLM's offline defaults (not when the user set both)."""
    return not (plan["max_num_seqs_set"] and plan["max_num_batched_tokens_set"])


def fill_sizes(plan: dict, defaults: dict | None) -> dict:
    """The scheduler sizes for the flags the user did not set: ``flags``, ``max_num_seqs``, ``max_num_batched_tokens``, ``note``.

    The arithmetic of :func:`airflow_vllm_batch.engines.sizing.scheduler_sizes`, which
    reads the plan from the engine's ``args``; it lives here because the engine's own process
    decides the sizes once it has read the defaults.

    :param plan: what the engine's ``args`` set (``sizing_plan`` in :mod:`~airflow_vllm_batch.engines.sizing`).
    :param defaults: vLLM's offline sizes on the engine's device (``max_num_seqs``,
        ``max_num_batched_tokens``, ``device``, ``world_size``); None when unknown.
    """
    user_seqs, user_tokens = plan["max_num_seqs"], plan["max_num_batched_tokens"]
    seqs_set, tokens_set = plan["max_num_seqs_set"], plan["max_num_batched_tokens_set"]

    def sizes(flags: list[str], seqs: int | None, tokens: int | None, note: str) -> dict:
        return {"flags": flags, "max_num_seqs": seqs, "max_num_batched_tokens": tokens, "note": note}

    if seqs_set and tokens_set:
        return sizes(
            [],
            user_seqs,
            user_tokens,
            f"Scheduler: {MAX_NUM_SEQS} and {MAX_NUM_BATCHED_TOKENS} as the engine's args set them",
        )
    if defaults is None:
        return sizes(
            [],
            user_seqs,
            user_tokens,
            "Scheduler: vLLM's own defaults for this entry point (its offline defaults could not be read)",
        )
    factor = plan["factor"]
    world_size = int(defaults.get("world_size") or 1)
    flags: list[str] = []
    why = [
        f"vLLM's offline defaults on {defaults['device']}"
        + (f", world size {world_size}" if world_size > 1 else "")
    ]
    if factor > 1:
        why.append("doubled for --performance-mode throughput")
    if seqs_set:
        seqs = user_seqs
        why.append(f"{MAX_NUM_SEQS} from the engine's args")
    else:
        seqs = int(defaults["max_num_seqs"]) * factor
        if user_tokens is not None and user_tokens < seqs:
            seqs = user_tokens
            why.append(f"{MAX_NUM_SEQS} at most the {MAX_NUM_BATCHED_TOKENS} in the engine's args")
        flags += [MAX_NUM_SEQS, str(seqs)]
    tokens: int | None
    if tokens_set:
        tokens = user_tokens
        why.append(f"{MAX_NUM_BATCHED_TOKENS} from the engine's args")
    else:
        whole_prompts, max_model_len = plan["whole_prompts"], plan["max_model_len"]
        if whole_prompts and max_model_len is None:
            tokens = None
            why.append(
                f"{MAX_NUM_BATCHED_TOKENS} left to vLLM (no chunked prefill: a step holds whole prompts of the model's length)"
            )
        else:
            tokens = max(
                int(defaults["max_num_batched_tokens"]) * factor,
                seqs or 0,
                max_model_len if whole_prompts else 0,
            )
            flags += [MAX_NUM_BATCHED_TOKENS, str(tokens)]
    return sizes(
        flags,
        seqs,
        tokens,
        f"Scheduler: {' '.join(flags)} ({'; '.join(why)}); set them in the engine's args to override",
    )


def prepare(module: str, argv: list[str], launch: dict) -> tuple[list[str], dict]:
    """Check the arguments and size the scheduler as ``launch`` says; return the arguments to start with and the report.

    :param module: the entry point's module (``python -m``), whose parser checks the arguments.
    :param argv: the entry point's arguments.
    :param launch: the instructions (see the module docstring).
    """
    report: dict = {}
    check, plan = launch.get("check"), launch.get("sizing")
    if check is None and plan is None:
        return argv, report
    argcheck = _argcheck()
    if check is not None:
        report["check"] = argcheck.check(launch["entrypoint"], [str(a) for a in check], module)
        if not report["check"]["ok"]:
            return argv, report
    if plan is not None:
        defaults = None
        if needs_defaults(plan):
            try:
                defaults = argcheck.offline_defaults(int(plan["world_size"]))
            except Exception as exc:  # noqa: BLE001 - reported; the engine then starts with its entry point's own sizes
                report["offline_defaults"] = {"error": f"{type(exc).__name__}: {exc}"}
            else:
                report["offline_defaults"] = defaults
        report["sizes"] = fill_sizes(plan, defaults)
        at = launch.get("insert_at")
        at = len(argv) if at is None else int(at)
        argv = [*argv[:at], *report["sizes"]["flags"], *argv[at:]]
    return argv, report


def _write_report(path: str | None, report: dict) -> None:
    if not path:
        return
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(report, f)
    os.replace(temporary, path)


def main() -> None:
    """Check, size, report, then run ``sys.argv[1]`` as ``__main__`` with the arguments from :data:`ARGV_ENV`."""
    module = sys.argv[1]
    argv = json.loads(os.environ.pop(ARGV_ENV)) if ARGV_ENV in os.environ else sys.argv[2:]
    launch = json.loads(os.environ.pop(LAUNCH_ENV, "") or "{}")
    argv, report = prepare(module, argv, launch)
    _write_report(launch.get("report"), report)
    if not report.get("check", {"ok": True})["ok"]:
        # The task reads why from the report (the message may quote a secret flag's value: not logged here).
        print(
            f"The engine's args were refused by {module}'s argument parser: stopping before the model loads.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        # A normal exit tears down torch and vLLM's imports, seconds for nothing here.
        os._exit(ARGUMENTS_REFUSED_EXIT)
    if "sizes" in report:
        print(report["sizes"]["note"], file=sys.stderr, flush=True)
    sys.argv = [module, *argv]
    if module.startswith("vllm."):
        # A module run as __main__ logs through the logger "__main__", outside the "vllm" logger vLLM
        # configures: its INFO lines (the version, "Reading batch from ...") would be lost.
        logging.getLogger("__main__").parent = logging.getLogger("vllm")
    # The check imported the entry module under its own name when its parser lives there (the
    # runner's); runpy then warns that it runs a module already imported, which is expected here.
    warnings.filterwarnings(
        "ignore", message=r".*found in sys\.modules after import of package", category=RuntimeWarning
    )
    runpy.run_module(module, run_name="__main__", alter_sys=True)
