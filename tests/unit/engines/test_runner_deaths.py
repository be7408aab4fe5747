"""Reading a dying runner's output, and the rule that decides what runs next (see runner_deaths)."""

from __future__ import annotations

import io
import json

from airflow_vllm_batch.batchfile import CustomIdIndex
from airflow_vllm_batch.engines.runner_deaths import (
    ENGINE_CRASH,
    ENGINE_DEAD_CLIENT_MESSAGE,
    ENGINE_DEAD_MESSAGE,
    Death,
    crash_line,
    engine_died_in_log,
    split_output,
    to_isolate,
    unanswered,
)


def answer(custom_id: str) -> bytes:
    return json.dumps(
        {
            "id": "x",
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": "q", "body": {}},
            "error": None,
        }
    ).encode()


def failed(custom_id: str, message: str) -> bytes:
    error = {"error": {"message": message, "type": "InternalServerError", "code": 500}}
    return json.dumps(
        {
            "id": "x",
            "custom_id": custom_id,
            "response": {"status_code": 500, "request_id": "q"},
            "error": error,
        }
    ).encode()


def index(*ids: str) -> CustomIdIndex:
    out = CustomIdIndex()
    for number, custom_id in enumerate(ids, start=1):
        out.add(custom_id, number)
    return out


def test_vllm_0_32s_engine_dead_lines_are_not_answers_and_the_others_are_kept_byte_for_byte():
    out = io.BytesIO()
    split = split_output(
        [answer("a"), failed("b", "bad request"), failed("c", ENGINE_DEAD_MESSAGE)], out, died=False
    )
    assert out.getvalue() == answer("a") + b"\n" + failed("b", "bad request") + b"\n"
    assert split.dead_lines == 1
    assert len(split.answered) == 2


def test_a_line_cut_by_vllm_0_33s_death_ends_its_output():
    out = io.BytesIO()
    split = split_output([answer("a"), answer("b")[:20], answer("c")], out, died=True)
    assert out.getvalue() == answer("a") + b"\n"
    assert split.cut == 2


def test_vllm_0_33s_client_message_counts_as_the_dead_engines_only_in_a_run_that_died():
    assert split_output([failed("a", ENGINE_DEAD_CLIENT_MESSAGE)], io.BytesIO(), died=True).dead_lines == 1
    assert split_output([failed("a", ENGINE_DEAD_CLIENT_MESSAGE)], io.BytesIO(), died=False).dead_lines == 0


def test_vllm_0_33s_traceback_names_its_dead_engine_error_type():
    assert engine_died_in_log(
        ["Traceback", "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."]
    )
    assert not engine_died_in_log(["ValueError: --output-file /x is not writable."])


def test_a_full_runs_death_isolates_its_unanswered_suspects_and_an_isolated_run_isolates_nothing():
    full = Death(["r4", "r5", "r6"])
    assert to_isolate([full], index("r4")) == ["r5", "r6"]
    assert to_isolate([full, Death(["r5"], isolated=True)], index()) == []
    assert to_isolate([full, Death([], isolated=True, died=False)], index()) == []
    assert to_isolate([], index()) == []


def test_a_death_record_reads_back_as_written():
    death = Death(["a", "b"], isolated=True, exit="exited with code 1")
    assert Death.from_json(death.to_json()) == death


def test_unanswered_keeps_the_input_order_and_skips_what_any_index_answers():
    assert list(unanswered(["a", "b", "c", "d"], index("b"), index("d"))) == ["a", "c"]


def test_a_crash_line_is_a_failed_answer_with_code_engine_crash():
    line = json.loads(crash_line("r5", 2))
    assert line["custom_id"] == "r5"
    assert line["error"]["code"] == ENGINE_CRASH
    assert line["response"]["status_code"] == 500
