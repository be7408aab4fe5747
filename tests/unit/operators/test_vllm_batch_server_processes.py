"""The server engine's client spread over several processes (``client_processes``), against the stand-in and real S3.

Workers are spawned processes: the test's monkeypatches do not reach them, so the
behaviours below that retry ask for ``Retry-After: 0`` instead of patching the backoff.
"""

from __future__ import annotations

import pytest
from aiohttp import web

from airflow_vllm_batch.exceptions import ConfigurationError, RequestsUnansweredError
from airflow_vllm_batch.serving import stream
from airflow_vllm_batch.storage.staging import RunStaging
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.operators.test_vllm_batch_runs import FakeTI
from tests.unit.operators.test_vllm_batch_server import N, _completion, _error

#: r7 is input line 8 (worker 0 of 2), r12 line 13 (worker 1): one request left unanswered in each worker.
BROKEN = ("r7", "r12")


def _broken(broken: tuple[str, ...] = BROKEN):
    async def behaviour(custom_id: str, body: dict, attempt: int) -> web.Response:
        if custom_id in broken:
            return _error(500, "EngineCore hiccup", headers={"Retry-After": "0"})
        return _completion(custom_id)

    return behaviour


def test_two_client_processes_answer_every_request_exactly_once_and_publish(
    batch, server, monkeypatch, capfd
):
    uploaded: list[str] = []
    real_put = RunStaging.put_part
    monkeypatch.setattr(
        RunStaging,
        "put_part",
        lambda self, path, token="": (uploaded.append(path.name), real_put(self, path, token)),
    )
    manifest = batch.run(client_processes=2)
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    assert sorted(r["custom_id"] for r in batch.lines("out/results.jsonl")) == sorted(
        f"r{i}" for i in range(N)
    )
    assert server.requests == N
    assert set(server.attempts.values()) == {1}
    # The parent uploads every worker's parts as one sequence of part numbers.
    numbers = [int(name[5:11]) for name in uploaded]
    assert numbers == list(range(len(numbers)))
    assert server.max_in_flight <= 4  # the connection's bound holds for the workers together
    assert "Server engine done: 20 requests sent and answered" in capfd.readouterr().out


def test_a_resumed_try_with_two_client_processes_sends_only_what_the_parts_lack_and_set_aside_is_combined(
    batch, server
):
    server.behaviour = _broken()
    with pytest.raises(
        RequestsUnansweredError, match=r"2 request\(s\) got no final answer .*HTTP 500: 2"
    ) as raised:
        batch.run(FakeTI(try_number=1), retries=2, client_processes=2)
    assert raised.value.retryable
    assert "out/results.jsonl" not in batch.keys()
    checkpointed = [r["custom_id"] for k in batch.parts() for r in batch.lines(k)]
    assert sorted(checkpointed) == sorted(f"r{i}" for i in range(N) if f"r{i}" not in BROKEN)
    sent_first = dict(server.attempts)
    assert sent_first["r7"] == sent_first["r12"] == 1 + stream.DEFAULT_RETRIES

    server.behaviour = _broken(broken=())
    manifest = batch.run(FakeTI(try_number=2), retries=2, client_processes=2)
    assert {cid for cid, n in server.attempts.items() if n > sent_first.get(cid, 0)} == set(BROKEN)
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    assert sorted(r["custom_id"] for r in batch.lines("out/results.jsonl")) == sorted(
        f"r{i}" for i in range(N)
    )


def test_on_the_last_try_what_each_client_process_set_aside_is_published_in_the_error_file(batch, server):
    server.behaviour = _broken()
    manifest = batch.run(FakeTI(try_number=1), retries=0, client_processes=2, max_failed_ratio=0.2)
    assert manifest["request_counts"] == {"total": N, "completed": N - 2, "failed": 2}
    failed = {r["custom_id"]: r for r in batch.lines("out/results.errors.jsonl")}
    assert sorted(failed) == sorted(BROKEN)
    assert all(r["response"]["status_code"] == 500 for r in failed.values())


def test_a_client_process_whose_server_refuses_the_key_fails_the_try_without_retry(batch, server):
    async def refuses_r3(custom_id: str, body: dict, attempt: int) -> web.Response:
        # Only one worker meets the refusal: the other must be stopped all the same.
        return (
            web.json_response({"error": {"message": "Unauthorized"}}, status=401)
            if custom_id == "r3"
            else _completion(custom_id)
        )

    server.behaviour = refuses_r3
    with pytest.raises(AirflowFailException, match="refused the API key"):
        batch.run(client_processes=2)
    assert "out/results.jsonl" not in batch.keys()


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_a_bad_client_processes_fails_at_dag_parse_time(batch, value):
    with pytest.raises(ConfigurationError, match="client_processes must be a positive whole number"):
        batch.operator(client_processes=value)


def test_on_kill_stops_the_client_processes_and_fails_the_try(batch, server):
    import asyncio
    import threading

    from airflow_vllm_batch.serving import processes

    async def slow(custom_id: str, body: dict, attempt: int) -> web.Response:
        await asyncio.sleep(0.5)
        return _completion(custom_id)

    server.behaviour = slow
    operator = batch.operator(client_processes=2)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            operator.execute({"ti": FakeTI(), "outlet_events": {}})
        except BaseException as err:  # noqa: BLE001 - the test looks at it
            failure.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    for _ in range(200):
        if any(w.is_alive() for run in list(processes._RUNNING) for w in run.workers):
            break
        threading.Event().wait(0.05)
    workers = [w for run in list(processes._RUNNING) for w in run.workers]
    assert workers
    operator.on_kill()
    thread.join(30)
    assert not thread.is_alive()
    assert failure
    assert not any(w.is_alive() for w in workers)
    assert "out/results.jsonl" not in batch.keys()
