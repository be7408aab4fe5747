"""How much the engines this task starts schedule at once, and how many requests the server stream keeps in flight.

vLLM sizes its scheduler by entry point: its offline ``LLM`` class gets the large rows of
``EngineArgs.get_batch_defaults`` (1024 sequences and 16384 tokens on an H100), its
OpenAI server smaller ones, and its batch runner none at all (it falls back to 128 and
2048 on every device). A batch is offline work, so the engines this task starts get the
offline row of the installed vLLM, read on the engine's own device by the engine's own
process before it loads the model (:mod:`~airflow_vllm_batch.engines.vllm.launcher`: the
task sends :func:`sizing_plan`, the launcher adds the defaults), passed as flags for
what the engine's ``args`` leave unset: the user's flags always win.

Not in the run identity: the sizes change how requests are grouped into steps, not what
an answer means, and the vLLM version that decides them is in it already. A retry on
another kind of GPU resumes the same run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from airflow_vllm_batch.engines.vllm.checks import OfflineDefaults, read_options, switch_setting
from airflow_vllm_batch.engines.vllm.launcher import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, fill_sizes
from airflow_vllm_batch.gpus import parallel_sizes
from airflow_vllm_batch.serving import DEFAULT_MAX_IN_FLIGHT

#: Requests in flight per sequence the server schedules at once: the second half waits in its
#: queue, so a finished sequence is replaced in the same step rather than after a round trip.
IN_FLIGHT_PER_SEQUENCE = 2


@dataclass(frozen=True)
class SchedulerSizes:
    """The scheduler sizes an engine starts with.

    :param flags: the flags added to ``engine_args`` (empty when the user set both, or
        nothing could be read).
    :param max_num_seqs: the sequences it schedules at once, when known (the user's or ours).
    :param max_num_batched_tokens: the tokens per step, when known (None: vLLM derives it).
    :param note: one line for the task log saying what was chosen and why.
    """

    flags: list[str]
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    note: str

    @classmethod
    def from_report(cls, sizes: dict) -> SchedulerSizes:
        """The sizes the engine's launcher chose (its report's ``sizes``)."""
        return cls(
            flags=list(sizes["flags"]),
            max_num_seqs=sizes.get("max_num_seqs"),
            max_num_batched_tokens=sizes.get("max_num_batched_tokens"),
            note=str(sizes["note"]),
        )


def world_size(engine_args: Sequence[str]) -> int:
    """Tensor times pipeline parallel size in ``engine_args`` (what vLLM's CPU rows scale with)."""
    sizes = parallel_sizes(engine_args)
    return sizes.get("tensor_parallel_size", 1) * sizes.get("pipeline_parallel_size", 1)


def api_server_count(engine_args: Sequence[str]) -> int | None:
    """The ``--api-server-count`` (``-asc``) in ``engine_args``, when set."""
    options = read_options(engine_args)
    if "--api-server-count" in options:
        return _int_option(options, "--api-server-count")
    args = list(engine_args)
    for i, arg in enumerate(args[:-1]):
        if arg == "-asc" and args[i + 1].isdigit():
            return int(args[i + 1])
    return None


def _int_option(options: dict[str, list[str]], name: str) -> int | None:
    values = options.get(name)
    try:
        return int(values[-1]) if values else None
    except ValueError:
        return None  # "auto", "4k": the parser check decides; vLLM resolves it


def sizing_plan(engine_args: Sequence[str], *, model_kind: str | None) -> dict:
    """What ``engine_args`` say about the scheduler's sizes, for the engine's launcher to complete with vLLM's defaults.

    Everything that reads the user's flags is decided here, in the task; the engine's own
    process (:func:`~airflow_vllm_batch.engines.vllm.launcher.fill_sizes`) adds only what
    needs its vLLM: the offline defaults on its device.

    :param engine_args: the user's engine arguments.
    :param model_kind: ``"generate"`` or ``"pooling"``, when known.
    """
    options = read_options(engine_args)
    return {
        "world_size": world_size(engine_args),
        "max_num_seqs": _int_option(options, MAX_NUM_SEQS),
        "max_num_seqs_set": MAX_NUM_SEQS in options,
        "max_num_batched_tokens": _int_option(options, MAX_NUM_BATCHED_TOKENS),
        "max_num_batched_tokens_set": MAX_NUM_BATCHED_TOKENS in options,
        "factor": 2 if (options.get("--performance-mode") or [""])[-1] == "throughput" else 1,
        "whole_prompts": model_kind == "pooling"
        or switch_setting(engine_args, "--enable-chunked-prefill") is False,
        "max_model_len": _int_option(options, "--max-model-len"),
    }


def scheduler_sizes(
    engine_args: Sequence[str], defaults: OfflineDefaults | None, *, model_kind: str | None
) -> SchedulerSizes:
    """The offline scheduler sizes to add to ``engine_args``, for the flags the user did not set.

    Three of vLLM's own rules are kept, because an explicit flag skips them: throughput
    mode (``--performance-mode throughput``) doubles the defaults; no fewer tokens than
    sequences per step; and without chunked prefill (pooling models, or
    ``--no-enable-chunked-prefill``, 0.33's ``--disable-chunked-prefill``) a step must hold a whole prompt, so the token budget
    is left to vLLM (which knows the model's length) unless ``--max-model-len`` says it.
    The engine's launcher decides the same way in the engine's process
    (:func:`sizing_plan`, then :func:`~airflow_vllm_batch.engines.vllm.launcher.fill_sizes`).

    :param engine_args: the user's engine arguments.
    :param defaults: the offline sizes of the engine's vLLM on its device; None when unknown.
    :param model_kind: ``"generate"`` or ``"pooling"``, when known.
    """
    chosen = fill_sizes(
        sizing_plan(engine_args, model_kind=model_kind),
        None if defaults is None else dataclasses.asdict(defaults),
    )
    return SchedulerSizes.from_report(chosen)


def started_server_in_flight(
    user: int | None, sizes: SchedulerSizes, engine_args: Sequence[str]
) -> tuple[int, str]:
    """Requests in flight to a server this task starts, and why.

    :param user: the options' ``max_in_flight``; always wins.
    :param sizes: the server's scheduler sizes.
    :param engine_args: the server's arguments (``--data-parallel-size``: one scheduler per rank).
    """
    if user:
        return user, "VLLMServer(max_in_flight=...)"
    data_parallel = parallel_sizes(engine_args).get("data_parallel_size", 1)
    if sizes.max_num_seqs:
        return (
            IN_FLIGHT_PER_SEQUENCE * sizes.max_num_seqs * data_parallel,
            f"twice the server's max_num_seqs {sizes.max_num_seqs} times its data-parallel size {data_parallel}",
        )
    return DEFAULT_MAX_IN_FLIGHT, "the stream's default (the server's max_num_seqs is unknown)"


def connection_in_flight(user: int | None, extra: int | None) -> tuple[int, str]:
    """Requests in flight to a warm server behind a ``vllm`` connection, and why.

    A vLLM 0.32 server does not tell a client how many sequences it schedules: neither
    ``/metrics`` (only ``vllm:cache_config_info``) nor ``/version`` say it, and
    ``/server_info`` exists only with ``VLLM_SERVER_DEV_MODE=1``, which vLLM says never
    to run in production. The connection's ``max_in_flight`` extra is where to say it.

    :param user: the options' ``max_in_flight``; always wins.
    :param extra: the connection's ``max_in_flight`` extra.
    """
    if user:
        return user, "WarmVLLMServer(max_in_flight=...)"
    if extra:
        return extra, "the connection's max_in_flight extra"
    return DEFAULT_MAX_IN_FLIGHT, (
        "the stream's default: the server does not say its max_num_seqs; set the connection's max_in_flight "
        "extra to twice its --max-num-seqs times its replicas"
    )
