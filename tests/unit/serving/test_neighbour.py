"""The yielding batch's controller, one branch per test: what the server reports in, the bound and its reason out."""

from __future__ import annotations

import json

import pytest

from airflow_vllm_batch.serving.neighbour import (
    GROWTH_PARTS,
    QUIET_CHECKS,
    InFlightController,
    Reading,
    ServerLoad,
    combine,
    parse_metrics,
    with_priority,
)

#: What a vLLM 0.32 server's /metrics holds (trimmed; two engines, as with data parallelism).
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 7.0
vllm:num_requests_running{engine="1",model_name="tiny"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 10.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny"} 4.5
vllm:request_queue_time_seconds_count{engine="0",model_name="tiny"} 30.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="tiny"} 12.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="tiny"} 600.0
vllm:cache_config_info{block_size="16",engine="0"} 1.0
"""


def load(waiting=0.0, running=0.0, kv=None, queue=None, tokens=None) -> ServerLoad:
    return ServerLoad(
        waiting=waiting, running=running, kv_cache_usage=kv, queue_time_s=queue, token_time_s=tokens
    )


def controller(ceiling=64, floor=4, bound=None, metrics=True) -> InFlightController:
    c = InFlightController(ceiling, floor, metrics=metrics)
    if bound is not None:
        c.bound = bound
    c._previous = load()
    return c


# -- reading what the server says ---------------------------------------------------------


def test_the_metrics_of_every_engine_are_added_up_and_the_fullest_kv_cache_kept():
    got = parse_metrics(METRICS)
    assert (got.waiting, got.running, got.kv_cache_usage) == (3.0, 12.0, 0.5)
    assert got.queue_time_s == (4.5, 30.0)
    assert got.token_time_s == (12.0, 600.0)


def test_text_that_is_not_a_vllm_servers_metrics_is_refused():
    with pytest.raises(ValueError, match="num_requests_waiting"):
        parse_metrics("<html>Not Found</html>")


def test_several_servers_add_up_and_say_how_many_answered():
    a, b = load(waiting=1, running=3, kv=0.2, queue=(1.0, 2.0)), load(waiting=2, running=4, kv=0.7)
    got = combine([a, None, b])
    assert (got.waiting, got.running, got.kv_cache_usage, got.queue_time_s) == (3, 7, 0.7, (1.0, 2.0))
    assert (got.servers_read, got.servers) == (2, 3)
    assert combine([None, None]) is None


# -- the priority in the body ---------------------------------------------------------------


def test_the_priority_goes_first_and_the_rest_of_the_body_is_sent_as_it_was():
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    sent = with_priority(body, 10)
    assert sent == b'{"priority":10,"model":"m","messages":[{"role":"user","content":"hi"}]}'
    assert json.loads(sent) == {"priority": 10, **json.loads(body)}


def test_a_line_that_sets_its_own_priority_keeps_it():
    body = b'{"model":"m","priority":-5}'
    assert with_priority(body, 10) == body


def test_the_word_priority_in_a_message_is_not_a_priority():
    body = b'{"model":"m","messages":[{"role":"user","content":"\\"priority\\""}]}'
    assert json.loads(with_priority(body, 3))["priority"] == 3


def test_an_empty_body_gets_only_the_priority():
    assert json.loads(with_priority(b"{ }", 7)) == {"priority": 7}


# -- the first bound --------------------------------------------------------------------


def test_an_idle_server_starts_the_batch_at_the_floor_and_doubles_it_from_the_first_check():
    c = InFlightController(64, 4)
    move = c.start(load())
    assert (move.bound, move.why) == (4, "the server is idle: doubling from the floor")
    assert [c.update(Reading(load(running=c.bound), in_flight=c.bound)).bound for _ in range(5)] == [
        8,
        16,
        32,
        64,
        64,
    ]


def test_a_server_busy_with_others_starts_the_batch_at_the_floor():
    move = InFlightController(64, 4).start(load(waiting=1, running=2))
    assert (move.bound, move.why) == (4, "3 requests of others on the server")


def test_unreadable_metrics_at_the_start_leave_the_bound_to_429_and_503():
    move = InFlightController(64, 4, metrics=False).start(None)
    assert move.bound == 4
    assert "429/503 answers only" in move.why


def test_a_floor_above_the_maximum_is_the_maximum():
    assert InFlightController(3, 8).floor == 3


# -- backing off --------------------------------------------------------------------------


def test_interactive_requests_waiting_halve_the_bound():
    c = controller(bound=40)
    move = c.update(Reading(load(waiting=2, running=38), in_flight=38))
    assert (move.bound, move.before) == (20, 40)
    assert move.describe() == "lowered 40 -> 20: 2 requests waiting with 2 requests of others on the server"


def test_the_batchs_own_requests_waiting_alone_do_not_lower_it():
    c = controller(bound=40)
    # 40 in the server, all the batch's: nobody else is there to wait.
    move = c.update(Reading(load(waiting=10, running=30), in_flight=40))
    assert move.bound > 40


def test_a_nearly_full_kv_cache_with_others_halves_the_bound():
    move = controller(bound=32).update(Reading(load(running=34, kv=0.95), in_flight=32))
    assert move.bound == 16
    assert move.why.startswith("KV cache 95% full with 2 requests of others")


def test_a_long_mean_queue_time_with_others_halves_the_bound():
    c = controller(bound=32)
    c._previous = load(queue=(1.0, 10.0))
    move = c.update(Reading(load(running=33, queue=(4.0, 20.0)), in_flight=32))
    assert move.bound == 16
    assert "queued 0.30s on average" in move.why


def test_steps_slower_than_the_fastest_seen_with_others_halve_the_bound():
    c = controller(bound=32)
    c._previous = load(tokens=(0.0, 0.0))
    c.update(Reading(load(tokens=(1.0, 100.0)), in_flight=0))  # 10 ms per token, nobody else there
    c.bound = 32
    move = c.update(Reading(load(running=34, tokens=(3.0, 200.0)), in_flight=32))  # 20 ms per token
    assert move.bound == 16
    assert move.why.startswith("20 ms per token, the fastest seen 10 ms")


def test_too_few_tokens_say_nothing_about_the_steps():
    c = controller(bound=32)
    c._previous = load(tokens=(0.0, 0.0))
    c.fastest_token_s = 0.001
    move = c.update(Reading(load(running=33, tokens=(1.0, 5.0)), in_flight=32))
    assert move.bound > 32


def test_a_429_or_503_halves_the_bound_even_when_the_metrics_look_calm():
    move = controller(bound=64).update(Reading(load(), in_flight=10, rejections=3))
    assert move.bound == 32
    assert move.why == "3 answers 429/503 (the server or its balancer is full)"


def test_the_bound_never_goes_below_the_floor():
    c = controller(bound=5, floor=4)
    for _ in range(5):
        move = c.update(Reading(load(waiting=3, running=9), in_flight=5))
    assert move.bound == 4
    assert c.bound == 4


# -- growing back -------------------------------------------------------------------------


def test_with_others_on_the_server_and_none_waiting_the_bound_grows_by_a_step():
    c = controller(ceiling=64, bound=8)
    move = c.update(Reading(load(running=10), in_flight=8))
    assert move.bound == 8 + 64 // GROWTH_PARTS
    assert move.why == "none waiting with 2 requests of others on the server"


def test_without_others_the_bound_steps_then_doubles_once_they_have_been_gone_a_while():
    c = controller(ceiling=64, bound=8)
    bounds = [
        c.update(Reading(load(running=c.bound), in_flight=c.bound)).bound for _ in range(QUIET_CHECKS + 1)
    ]
    step = 64 // GROWTH_PARTS
    assert bounds[: QUIET_CHECKS - 1] == [8 + step * (i + 1) for i in range(QUIET_CHECKS - 1)]
    assert bounds[QUIET_CHECKS - 1] == 2 * bounds[QUIET_CHECKS - 2]


def test_the_bound_never_grows_above_the_maximum():
    c = controller(ceiling=64, bound=60)
    c.quiet_checks = QUIET_CHECKS
    move = c.update(Reading(load(), in_flight=0))
    assert move.bound == 64
    assert c.update(Reading(load(), in_flight=0)).describe().startswith("held at 64: no requests of others")


def test_unreadable_metrics_hold_the_bound():
    c = controller(bound=16)
    move = c.update(Reading(None, in_flight=16))
    assert move.describe() == "held at 16: the server's /metrics could not be read"


def test_without_metrics_the_bound_grows_a_step_per_check_without_429_or_503():
    c = controller(ceiling=64, bound=8, metrics=False)
    assert c.update(Reading(None, in_flight=8)).bound == 8 + 64 // GROWTH_PARTS
    assert c.update(Reading(None, in_flight=8, rejections=1)).bound == (8 + 64 // GROWTH_PARTS) // 2


def test_servers_that_did_not_answer_are_named_in_the_reason():
    c = controller(bound=8)
    partial = ServerLoad(running=10, servers_read=1, servers=2)
    assert "(read 1 of 2 servers)" in c.update(Reading(partial, in_flight=8)).why


def test_the_controller_counts_its_moves_and_keeps_the_last_change():
    c = controller(bound=16)
    c.update(Reading(load(waiting=1, running=20), in_flight=16))
    c.update(Reading(None, in_flight=8))
    assert (c.lowered, c.raised) == (1, 0)
    assert c.last_change is not None
    assert c.last_change.describe().startswith("lowered 16 -> 8")


def test_the_same_readings_give_the_same_bounds():
    readings = [
        Reading(
            load(waiting=w % 3, running=20 + w, kv=0.5, tokens=(w * 0.1, w * 20.0)),
            in_flight=18,
            rejections=w % 5 == 4,
        )
        for w in range(40)
    ]

    def run() -> list[int]:
        c = controller(ceiling=128, floor=2, bound=64)
        return [c.update(r).bound for r in readings]

    first = run()
    assert first == run()
    assert min(first) >= 2
    assert max(first) <= 128
