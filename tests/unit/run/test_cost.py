"""The cost of a run: engine GPU-seconds, tokens per GPU-second, money at a GPU-hour price."""

from __future__ import annotations

import math

import msgspec
import pytest

from airflow_vllm_batch.engines.options import VLLMRunner, VLLMServer, WarmVLLMServer, check_gpu_hour_cost
from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.manifest import Cost, Manifest, RequestCounts, Usage
from airflow_vllm_batch.run.cost import run_cost, split_cost, sum_costs
from airflow_vllm_batch.summary import render_summary


def test_leased_gpus_times_engine_time_are_the_gpu_seconds_and_the_price_is_per_gpu_hour():
    cost = run_cost(device="gpu", gpus=2, engine_s=30.0, task_s=45.0, total_tokens=600, gpu_hour_cost=2.5)
    assert (cost.device, cost.gpus, cost.engine_s, cost.gpu_s) == ("gpu", 2, 30.0, 60.0)
    assert cost.tokens_per_gpu_s == 10.0
    assert cost.tokens_per_engine_s is None
    assert cost.cost == pytest.approx(60 / 3600 * 2.5, abs=1e-6)
    assert cost.note is None


def test_a_cpu_worker_reports_engine_seconds_and_no_gpu_seconds():
    cost = run_cost(device="gpu", gpus=0, engine_s=30.0, task_s=45.0, total_tokens=600, gpu_hour_cost=2.5)
    assert (cost.device, cost.gpus, cost.engine_s, cost.gpu_s) == ("cpu", 0, 30.0, None)
    assert cost.tokens_per_engine_s == 20.0
    assert cost.tokens_per_gpu_s is None
    assert cost.cost == pytest.approx(30 / 3600 * 2.5, abs=1e-6)
    assert "no GPU" in cost.note


def test_a_vllm_connection_counts_the_tasks_wall_time_and_says_the_server_is_shared():
    cost = run_cost(
        device="vllm_connection", gpus=0, engine_s=12.0, task_s=40.0, total_tokens=800, gpu_hour_cost=3.6
    )
    assert (cost.device, cost.gpus, cost.engine_s, cost.gpu_s) == ("vllm_connection", None, 40.0, None)
    assert cost.tokens_per_engine_s == 20.0
    assert cost.cost == pytest.approx(0.04)
    assert "other tasks" in cost.note


def test_without_a_price_there_is_no_cost_but_the_seconds_are_kept():
    cost = run_cost(device="gpu", gpus=1, engine_s=10.0, task_s=12.0, total_tokens=5)
    assert cost.gpu_s == 10.0
    assert cost.cost is None
    assert cost.gpu_hour_cost is None


def test_no_engine_time_in_this_try_gives_no_rate_and_costs_nothing():
    cost = run_cost(device="gpu", gpus=1, engine_s=0.0, task_s=3.0, total_tokens=500, gpu_hour_cost=2.0)
    assert cost.tokens_per_gpu_s is None
    assert cost.cost == 0.0


def test_the_cost_is_split_between_models_by_their_share_of_tokens():
    per_model = {"base": {"requests": 1, "total_tokens": 300}, "sql": {"requests": 3, "total_tokens": 100}}
    split = split_cost(per_model, 0.4)
    assert split["base"]["cost"] == pytest.approx(0.3)
    assert split["sql"]["cost"] == pytest.approx(0.1)
    assert split["base"]["requests"] == 1  # the counts stay


def test_with_no_tokens_at_all_the_cost_is_split_by_requests():
    split = split_cost(
        {"a": {"requests": 1, "total_tokens": 0}, "b": {"requests": 3, "total_tokens": 0}}, 0.4
    )
    assert (split["a"]["cost"], split["b"]["cost"]) == (pytest.approx(0.1), pytest.approx(0.3))


@pytest.mark.parametrize(("value", "price"), [(2.5, 2.5), ("2.5", 2.5), (0, 0.0), (None, None), ("", None)])
def test_a_gpu_hour_cost_is_a_number_at_least_zero_or_unset(value, price):
    assert check_gpu_hour_cost(value) == price


@pytest.mark.parametrize("value", [-1, "-0.5", "abc", True, math.nan, math.inf, [2.5]])
def test_a_bad_gpu_hour_cost_names_the_parameter_and_the_fix(value):
    with pytest.raises(ConfigurationError, match=r"gpu_hour_cost must be a number >= 0 .*e\.g\. 2\.5"):
        check_gpu_hour_cost(value)


def test_a_bad_gpu_hour_cost_fails_the_dag_at_parse_time_but_a_template_waits_for_rendering():
    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    args = {"task_id": "t", "input_uri": "s3://b/i.jsonl", "output_uri": "s3://b/o.jsonl", "model": "m"}
    with pytest.raises(ConfigurationError, match="gpu_hour_cost"):
        VLLMBatchOperator(**args, engine=VLLMRunner(gpu_hour_cost=-2))
    assert VLLMBatchOperator(
        **args, engine=VLLMServer(gpu_hour_cost="{{ var.value.gpu_hour_cost }}")
    ).engine.gpu_hour_cost.startswith("{{")


def _manifest(**extra) -> Manifest:
    return Manifest(
        output_uri="s3://b/r.jsonl",
        error_uri=None,
        input_uri="s3://b/in.jsonl",
        model="m",
        request_counts=RequestCounts(2, 2, 0),
        usage=Usage(5, 3, 8),
        duration_s=1.5,
        vllm_version="0.32.0",
        fingerprint="f",
        manifest_uri="s3://b/r.manifest.json",
        **extra,
    )


def test_a_manifest_written_before_the_cost_fields_still_reads():
    old = b'{"output_uri": "s3://b/r.jsonl", "error_uri": null, "input_uri": null, "model": "m", "request_counts": {"total": 1, "completed": 1, "failed": 0}, "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "duration_s": 1.0, "vllm_version": null, "fingerprint": null, "manifest_uri": "s3://b/r.manifest.json", "per_model": {"m": {"requests": 1, "total_tokens": 2}}}'
    manifest = Manifest.from_json(old)
    assert manifest.cost is None
    assert manifest.per_model == {"m": {"requests": 1, "total_tokens": 2}}


def test_a_priced_manifest_reads_back_equal_with_its_float_cost_per_model():
    cost = run_cost(device="gpu", gpus=1, engine_s=7.0, task_s=9.0, total_tokens=8, gpu_hour_cost=2.5)
    original = _manifest(
        cost=cost, per_model=split_cost({"m": {"requests": 2, "total_tokens": 8}}, cost.cost)
    )
    assert Manifest.from_json(original.to_json()) == original
    assert original.to_dict()["per_model"]["m"]["cost"] == cost.cost


@pytest.mark.parametrize(
    ("cost", "row"),
    [
        (
            Cost("gpu", 30.0, gpus=2, gpu_s=60.0, tokens_per_gpu_s=10.0, gpu_hour_cost=2.5, cost=0.041667),
            "2 GPU(s) x 30.0 s = 60.0 GPU-s; 10.0 tokens/GPU-s; cost 0.04167 at 2.5/GPU-hour",
        ),
        (
            Cost("cpu", 30.0, gpus=0, tokens_per_engine_s=20.0),
            "cpu: 30.0 engine-s (no GPU leased); 20.0 tokens/engine-s",
        ),
        (
            Cost("vllm_connection", 40.0, tokens_per_engine_s=20.0, gpu_hour_cost=3.6, cost=0.04),
            "vllm connection: 40.0 s of the task (the server may be shared with other tasks); 20.0 tokens/s; cost 0.04 at 3.6/server-hour",
        ),
    ],
    ids=["gpu", "cpu", "connection"],
)
def test_the_summary_table_shows_the_engine_time_its_rate_and_the_cost(cost, row):
    assert row in render_summary(_manifest(cost=cost))


def test_the_summary_shows_each_models_cost_when_there_are_several():
    per_model = {"base": {"requests": 1, "cost": 0.3}, "sql": {"requests": 1, "cost": 0.1}}
    table = render_summary(
        _manifest(cost=Cost("gpu", 1.0, gpus=1, gpu_s=1.0, cost=0.4, gpu_hour_cost=1.0), per_model=per_model)
    )
    assert "base 0.3, sql 0.1" in table


def test_a_rendered_gpu_hour_cost_is_checked_when_the_task_starts():
    from airflow_vllm_batch.run.settings import BatchSettings

    values = {"input_uri": "s3://b/in.jsonl", "output_uri": "s3://b/out/results.jsonl", "model": "m"}
    assert (
        BatchSettings.from_rendered(**values, engine=VLLMRunner(gpu_hour_cost="2.5")).engine.gpu_hour_cost
        == 2.5
    )
    with pytest.raises(ConfigurationError, match="gpu_hour_cost must be a number >= 0"):
        BatchSettings.from_rendered(**values, engine=WarmVLLMServer(gpu_hour_cost="two dollars"))


def _as_dict(cost: Cost | None) -> dict | None:
    return None if cost is None else {k: v for k, v in msgspec.structs.asdict(cost).items() if v is not None}


def test_a_sharded_batch_costs_what_its_shards_cost_added_up():
    shards = [
        msgspec.structs.asdict(
            run_cost(device="gpu", gpus=2, engine_s=s, task_s=s + 5, total_tokens=1000, gpu_hour_cost=4.0)
        )
        for s in (900.0, 1800.0)
    ]
    merged = sum_costs(shards, total_tokens=2000)
    assert _as_dict(merged) == {
        "device": "gpu",
        "engine_s": 2700.0,
        "gpus": 2,
        "gpu_s": 5400.0,
        "tokens_per_gpu_s": round(2000 / 5400, 3),
        "gpu_hour_cost": 4.0,
        "cost": 6.0,
    }  # 1,800 + 3,600 GPU-seconds at 4 per GPU-hour: 2 + 4


def test_a_shard_without_cost_leaves_the_batch_uncounted_rather_than_undercounted():
    priced = msgspec.structs.asdict(
        run_cost(device="gpu", gpus=1, engine_s=10.0, task_s=12.0, total_tokens=10)
    )
    assert sum_costs([priced, None], total_tokens=20) is None
    assert sum_costs([], total_tokens=0) is None


def test_shards_on_different_kinds_of_engine_add_up_only_their_money():
    gpu = msgspec.structs.asdict(
        run_cost(device="gpu", gpus=1, engine_s=3600.0, task_s=3700.0, total_tokens=10, gpu_hour_cost=2.0)
    )
    warm = msgspec.structs.asdict(
        run_cost(
            device="vllm_connection", gpus=0, engine_s=0.0, task_s=1800.0, total_tokens=10, gpu_hour_cost=2.0
        )
    )
    merged = sum_costs([gpu, warm], total_tokens=20)
    assert merged is not None
    assert (merged.device, merged.cost, merged.gpu_s) == ("mixed", 3.0, None)
    assert "gpu, vllm_connection" in (merged.note or "")


def test_unpriced_shards_add_up_their_seconds_without_a_cost():
    shards = [
        msgspec.structs.asdict(run_cost(device="cpu", gpus=0, engine_s=s, task_s=s, total_tokens=100))
        for s in (1.5, 2.5)
    ]
    merged = sum_costs(shards, total_tokens=200)
    assert merged is not None
    assert (
        merged.device,
        merged.engine_s,
        merged.tokens_per_engine_s,
        merged.cost,
    ) == ("cpu", 4.0, 50.0, None)
