"""What a batch run cost: engine GPU-seconds, tokens per GPU-second, and money at a GPU-hour price.

The figures go into the manifest (``cost``, :class:`~airflow_vllm_batch.manifest.Cost`) and
the summary table of the task log. What is counted depends on where the engine ran:

* ``"gpu"``: an engine this task started, holding ``gpus`` leased GPUs for ``engine_s``
  seconds (the runner's process; the task-started server from its start to the last
  answer): ``gpu_s = gpus × engine_s``, ``tokens_per_gpu_s = total tokens / gpu_s``, and
  with a price, ``cost = gpu_s / 3600 × gpu_hour_cost``;
* ``"cpu"``: the same engine on a worker with no GPU (no lease): no GPU-seconds; the
  engine-seconds stand in (``tokens_per_engine_s``), and a price is read as the price of
  one engine-hour;
* ``"vllm_connection"``: a warm server this task only streamed to. Its GPUs are not the
  task's to count, and other tasks may share it at the same time: ``engine_s`` is the
  task's wall time, the price is read per server-hour, and the ``note`` says the cost is
  what the server's time during the task is worth, not this batch's share of it.

Only this try's engine time is counted: a try that publishes what an earlier try left
in staging ran no engine and costs 0 here (the earlier try's time is not known to it).
"""

from __future__ import annotations

from typing import Any

import msgspec

from airflow_vllm_batch.manifest import Cost

#: Digits kept of seconds and rates; of money, more (a small run costs fractions of a cent).
_SECONDS_DIGITS = 3
_COST_DIGITS = 6

_SHARED_NOTE = (
    "the vllm connection's server may serve other tasks at the same time: engine_s is this task's wall time, "
    "and the cost is what the server's time during the task is worth at gpu_hour_cost per server-hour"
)
_CPU_NOTE = "no GPU: engine_s is the engine's time on the CPU, and gpu_hour_cost is read per engine-hour"


def run_cost(
    *,
    device: str,
    gpus: int,
    engine_s: float,
    task_s: float,
    total_tokens: int,
    gpu_hour_cost: float | None = None,
) -> Cost:
    """
    Return the cost figures of one run (see the module docstring).

    :param device: ``"gpu"`` or ``"cpu"`` for an engine this task started, ``"vllm_connection"``
        for a warm server; ``"gpu"`` with ``gpus=0`` is read as ``"cpu"``.
    :param gpus: GPUs the task leased for its engine.
    :param engine_s: the engine's time in this try.
    :param task_s: the task's wall time (what a connection's run is counted by).
    :param total_tokens: prompt and completion tokens of the completed requests.
    :param gpu_hour_cost: the price of one GPU-hour (per engine- or server-hour without GPUs), or ``None``.
    """
    if device == "vllm_connection":
        seconds = task_s
        cost = Cost(device=device, engine_s=round(seconds, _SECONDS_DIGITS), note=_SHARED_NOTE)
    elif gpus > 0:
        seconds = gpus * engine_s
        cost = Cost(
            device="gpu",
            gpus=gpus,
            engine_s=round(engine_s, _SECONDS_DIGITS),
            gpu_s=round(seconds, _SECONDS_DIGITS),
        )
    else:
        seconds = engine_s
        cost = Cost(device="cpu", gpus=0, engine_s=round(engine_s, _SECONDS_DIGITS), note=_CPU_NOTE)
    rate = round(total_tokens / seconds, _SECONDS_DIGITS) if seconds > 0 else None
    if cost.device == "gpu":
        cost.tokens_per_gpu_s = rate
    else:
        cost.tokens_per_engine_s = rate
    if gpu_hour_cost is not None:
        cost.gpu_hour_cost = gpu_hour_cost
        cost.cost = round(seconds / 3600 * gpu_hour_cost, _COST_DIGITS)
    return cost


def split_cost(per_model: dict[str, dict[str, Any]], cost: float) -> dict[str, dict[str, Any]]:
    """
    Return ``per_model`` with each model's ``cost``: the run's cost split by its share of the tokens.

    With no token counted at all (every request failed), the split is by requests instead.

    :param per_model: the manifest's per-model counts (``total_tokens``, ``requests``).
    :param cost: the run's cost.
    """
    key = (
        "total_tokens"
        if sum(entry.get("total_tokens", 0) for entry in per_model.values()) > 0
        else "requests"
    )
    whole = sum(entry.get(key, 0) for entry in per_model.values())
    return {
        name: {**entry, "cost": round(cost * entry.get(key, 0) / whole, _COST_DIGITS) if whole else 0.0}
        for name, entry in per_model.items()
    }


def sum_costs(costs: list[dict[str, Any] | None], total_tokens: int) -> Cost | None:
    """
    Return the cost of a sharded batch: its shards' costs added up, or ``None`` when a shard has none.

    Seconds, GPU-seconds and money add up; the token rate is the batch's tokens over the
    summed seconds. A shard without ``cost`` (published by a version that did not count it)
    leaves the batch uncounted rather than undercounted. Shards that ran on different kinds
    of engine (a GPU worker and a warm server, say) are ``"mixed"``: their seconds are not the
    same unit, so only the money is added up, with a note saying so.

    :param costs: each shard manifest's ``cost``, in shard order.
    :param total_tokens: the batch's prompt and completion tokens (the merged ``usage``).
    """
    if not costs or any(not isinstance(cost, dict) for cost in costs):
        return None
    shards = [msgspec.convert(cost, Cost) for cost in costs]
    devices = {shard.device for shard in shards}
    prices = {shard.gpu_hour_cost for shard in shards}
    priced = all(shard.cost is not None for shard in shards)
    money = round(sum(shard.cost or 0.0 for shard in shards), _COST_DIGITS) if priced else None
    price = prices.pop() if len(prices) == 1 else None
    if len(devices) > 1:
        note = (
            "the shards ran on different kinds of engine ("
            + ", ".join(sorted(devices))
            + "): only the cost adds up"
        )
        return Cost(device="mixed", engine_s=0.0, cost=money, gpu_hour_cost=price, note=note)
    device = devices.pop()
    engine_s = round(sum(shard.engine_s for shard in shards), _SECONDS_DIGITS)
    gpus = {shard.gpus for shard in shards}
    cost = Cost(
        device=device,
        engine_s=engine_s,
        gpus=gpus.pop() if len(gpus) == 1 else None,
        cost=money,
        gpu_hour_cost=price,
    )
    if device == "gpu":
        cost.gpu_s = round(sum(shard.gpu_s or 0.0 for shard in shards), _SECONDS_DIGITS)
        cost.tokens_per_gpu_s = round(total_tokens / cost.gpu_s, _SECONDS_DIGITS) if cost.gpu_s else None
    else:
        cost.tokens_per_engine_s = round(total_tokens / engine_s, _SECONDS_DIGITS) if engine_s else None
        cost.note = shards[0].note
    return cost
