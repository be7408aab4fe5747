"""The server engine of VLLMBatchOperator, every branch in seconds.

A stand-in vLLM server (aiohttp, ``tests/unit/serving/conftest.py``) reached through a
``vllm`` connection given as ``AIRFLOW_CONN_...`` JSON, and real S3 (SeaweedFS). The real
server runs the same paths in ``tests/integration/test_vllm_server.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import pytest
from aiohttp import web
from botocore.exceptions import ClientError

from airflow_vllm_batch.batchfile import CustomIdIndex
from airflow_vllm_batch.engines import VLLMRunner, WarmVLLMServer, server as server_engines
from airflow_vllm_batch.exceptions import (
    ConfigurationError,
    OutputBusyError,
    RequestsUnansweredError,
    ResultsCheckError,
    StorageUnavailableError,
)
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from airflow_vllm_batch.serving import ServerUnavailableError, stream
from airflow_vllm_batch.storage.staging import RunStaging
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.operators.test_vllm_batch_runs import FakeTI
from tests.unit.serving.conftest import API_KEY, StandIn

CONN_ID = "vllm_stand_in"
N = 20

# The warm server's fixtures (server, batch, quick_retries) are in conftest.py.
pytestmark = pytest.mark.usefixtures("quick_retries")


class ServedStandIn(StandIn):
    """The stand-in with the read-only endpoints a warm server has: ``/v1/models`` and ``/version``."""

    served = ("m",)
    #: What its ``/v1/models`` cards say besides the id (``root``, ``max_model_len``), and its ``/version``.
    card: ClassVar[dict] = {}
    vllm_version = "0.32.0"

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _models(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        return web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model", **self.card} for m in self.served]}
        )

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.vllm_version})

    def restart(self) -> None:
        """Come back on the same port, as a restarted server behind the same address would."""
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    @property
    def requests(self) -> int:
        return sum(self.attempts.values())


def requests_lines(n: int) -> bytes:
    """Chat lines whose message is their custom_id (what the stand-in keys on)."""
    return b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": f"r{i}"}]},
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


#: The keyword arguments of the helpers that are the warm server's options.
WARM_FIELDS = {f.name for f in dataclasses.fields(WarmVLLMServer)}


class Batch:
    def __init__(self, s3, bucket: str, tmp_path: Path) -> None:
        self.client = s3.client()
        self.bucket = bucket
        self.tmp_path = tmp_path
        self.client.put_object(Bucket=bucket, Key="in/input.jsonl", Body=requests_lines(N))

    def keys(self, prefix: str = "") -> list[str]:
        return [
            o["Key"]
            for o in self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix).get("Contents", [])
        ]

    def lines(self, key: str) -> list[dict]:
        body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        return [json.loads(line) for line in body.splitlines()]

    def parts(self) -> list[str]:
        return sorted(k for k in self.keys("out/") if "/parts/" in k)

    def operator(self, **kwargs) -> VLLMBatchOperator:
        """The operator on the warm server of ``CONN_ID``; the keyword arguments that are ``WarmVLLMServer``'s go to it."""
        options = {"conn_id": CONN_ID, "checkpoint_interval": 0.05}
        options.update({k: kwargs.pop(k) for k in list(kwargs) if k in WARM_FIELDS})
        args = {
            "task_id": "vllm_batch",
            "input_uri": f"s3://{self.bucket}/in/input.jsonl",
            "output_uri": f"s3://{self.bucket}/out/results.jsonl",
            "model": "m",
            "engine": WarmVLLMServer(**options),
            "results_dir": str(self.tmp_path / "results"),
        }
        return VLLMBatchOperator(**{**args, **kwargs})

    def run(self, ti: FakeTI | None = None, **kwargs) -> dict:
        return self.operator(**kwargs).execute({"ti": ti or FakeTI(), "outlet_events": {}})


def _dies_after(server: ServedStandIn, answered: int):
    """A behaviour that answers ``answered`` requests, then takes the server down for good (until restart)."""

    async def behaviour(custom_id: str, body: dict, attempt: int) -> web.Response:
        if int(custom_id[1:]) >= answered:
            server.stop_soon()
            await asyncio.sleep(30)  # cancelled by the shutdown
        await asyncio.sleep(0.01)
        return web.json_response(
            {
                "id": custom_id,
                "object": "chat.completion",
                "created": 1,
                "model": "m",
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            }
        )

    return behaviour


def test_a_warm_server_through_a_connection_answers_every_request_once_and_publishes(batch, server, capfd):
    ti = FakeTI()
    manifest = batch.run(ti)
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    assert manifest["vllm_version"] == "0.32.0"
    assert manifest["identity"]["engine"] == "vllm_connection"
    assert manifest["identity"]["engine_args"] is None
    assert sorted(r["custom_id"] for r in batch.lines("out/results.jsonl")) == sorted(
        f"r{i}" for i in range(N)
    )
    assert server.requests == N
    assert set(server.attempts.values()) == {1}
    assert server.max_in_flight <= 4  # the connection's max_in_flight extra
    assert server.auth_headers == {f"Bearer {API_KEY}"}
    assert sorted(batch.keys("out/")) == [
        "out/results.jsonl",
        "out/results.manifest.json",
    ]  # staging and parts removed
    logged = capfd.readouterr()
    assert "Server engine done: 20 requests sent and answered" in logged.out
    for text in (
        logged.out,
        logged.err,
        json.dumps(manifest),
        json.dumps(ti.xcoms),
        batch.client.get_object(Bucket=batch.bucket, Key="out/results.manifest.json")["Body"].read().decode(),
    ):
        assert API_KEY not in text


def test_a_warm_servers_streaming_knobs_are_not_in_the_run_identity(batch, server):
    first = batch.run()
    again = batch.run(
        FakeTI(run_id="rerun"), max_in_flight=3, client_processes=1, request_timeout=timedelta(minutes=5)
    )
    assert again == first
    assert server.requests == N


def test_a_model_the_server_does_not_serve_fails_fast_without_retry_naming_what_it_serves(batch, server):
    server.served = ("other-model", "third")
    with pytest.raises(
        AirflowFailException, match="does not serve model 'm'; it serves 'other-model', 'third'"
    ):
        batch.run()
    assert server.requests == 0
    assert batch.keys("out/") == []


def test_a_dead_server_fails_the_try_as_retryable_and_keeps_its_checkpoints(batch, server):
    server.behaviour = _dies_after(server, 10)
    with pytest.raises(ServerUnavailableError, match="retrying the task resumes from them"):
        batch.run(max_in_flight=1)
    parts = batch.parts()
    assert parts
    assert all("/parts/part-" in k for k in parts)
    answered = [r["custom_id"] for k in parts for r in batch.lines(k)]
    assert sorted(answered) == sorted(f"r{i}" for i in range(10))
    assert "out/results.jsonl" not in batch.keys()
    assert "out/results.manifest.json" not in batch.keys()


def test_a_retry_resumes_from_the_parts_and_sends_only_the_unanswered(batch, server, capfd):
    server.behaviour = _dies_after(server, 10)
    with pytest.raises(ServerUnavailableError):
        batch.run(max_in_flight=1)
    first_parts = batch.parts()
    sent_first = dict(server.attempts)
    server.restart()
    server.behaviour = _dies_after(server, N)  # answers everything now
    capfd.readouterr()
    manifest = batch.run(FakeTI(try_number=2), max_in_flight=1)
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    sent_second = {
        cid: n - sent_first.get(cid, 0) for cid, n in server.attempts.items() if n - sent_first.get(cid, 0)
    }
    assert sorted(sent_second) == sorted(
        f"r{i}" for i in range(10, N)
    )  # r10 was in flight when it died: sent again
    assert set(sent_second.values()) == {1}
    out = [r["custom_id"] for r in batch.lines("out/results.jsonl")]
    assert sorted(out) == sorted(f"r{i}" for i in range(N))  # each exactly once
    assert f"Resuming from {len(first_parts)} checkpoint part(s)" in capfd.readouterr().out
    assert batch.parts() == []


def test_a_retry_numbers_its_parts_after_the_earlier_tries(batch, server, monkeypatch):
    server.behaviour = _dies_after(server, 10)
    with pytest.raises(ServerUnavailableError):
        batch.run(max_in_flight=1)
    last = max(int(k.rsplit("part-", 1)[1][:6]) for k in batch.parts())
    uploaded: list[str] = []
    real_put = RunStaging.put_part
    monkeypatch.setattr(
        RunStaging,
        "put_part",
        lambda self, path, token="": (uploaded.append(path.name), real_put(self, path, token)),
    )
    server.restart()
    server.behaviour = _dies_after(server, N)
    batch.run(FakeTI(try_number=2), max_in_flight=1)
    assert uploaded
    assert min(int(name[5:11]) for name in uploaded) == last + 1


def test_a_failed_part_upload_fails_the_try_as_retryable_and_the_retry_finishes(batch, server, monkeypatch):
    real_put = RunStaging.put_part

    def s3_fails(self, path, token=""):
        raise ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "down"}}, "PutObject")

    monkeypatch.setattr(RunStaging, "put_part", s3_fails)
    with pytest.raises(
        StorageUnavailableError, match=r"S3 failed while checkpointing .* the task's retry resumes"
    ):
        batch.run()
    assert batch.keys("out/") == []
    monkeypatch.setattr(RunStaging, "put_part", real_put)
    manifest = batch.run(FakeTI(try_number=2))
    assert manifest["request_counts"]["completed"] == N


def test_progress_lines_show_done_rate_tokens_failures_and_eta(batch, server, monkeypatch, capfd):
    monkeypatch.setattr(server_engines, "PROGRESS_EVERY_S", 0.05)

    async def slow(custom_id: str, body: dict, attempt: int) -> web.Response:
        await asyncio.sleep(0.05)
        return web.json_response(
            {
                "id": custom_id,
                "object": "chat.completion",
                "created": 1,
                "model": "m",
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            }
        )

    server.behaviour = slow
    batch.run(max_in_flight=2)
    out = capfd.readouterr().out
    assert "Progress: " in out
    line = next(line for line in out.splitlines() if "Progress: " in line)
    for fragment in ("/20 requests (", "%), ", " requests/s, ", " output tokens/s, ", " failed, ", "ETA "):
        assert fragment in line


@pytest.mark.parametrize(
    "kwargs",
    [
        {"checkpoint_interval": 0},
        {"checkpoint_interval": timedelta(0)},
        {"max_in_flight": 0},
        {"engine": "server"},
    ],
)
def test_settings_that_do_not_fit_the_server_engine_fail_at_dag_parse_time(batch, kwargs):
    with pytest.raises(ConfigurationError):
        batch.operator(**kwargs)


@pytest.mark.parametrize("knob", ["output_mode", "command", "args", "gpus"])
def test_a_warm_server_has_no_knob_of_an_engine_the_task_starts(knob):
    with pytest.raises(TypeError, match=knob):
        WarmVLLMServer(conn_id=CONN_ID, **{knob: None})


def test_the_engine_defaults_to_the_runner(batch):
    assert isinstance(batch.operator(engine=None).engine, VLLMRunner)


def test_supported_urls_the_server_engine_cannot_send_fail_at_dag_parse_time_naming_the_runner(batch):
    with pytest.raises(ConfigurationError, match=r"/v1/audio/transcriptions.*engine=VLLMRunner\(\)"):
        batch.operator(supported_urls=["/v1/chat/completions", "/v1/audio/transcriptions"])


def test_an_audio_line_fails_preflight_for_the_server_engine_and_names_the_runner(batch, server):
    audio = {
        "custom_id": "a0",
        "method": "POST",
        "url": "/v1/audio/transcriptions",
        "body": {"model": "m", "file_url": "https://example.com/a.wav"},
    }
    batch.client.put_object(
        Bucket=batch.bucket, Key="in/input.jsonl", Body=requests_lines(2) + json.dumps(audio).encode() + b"\n"
    )
    with pytest.raises(
        AirflowFailException, match=r"line 3.*audio lines run on the batch runner \(engine=VLLMRunner\(\)\)"
    ):
        batch.run()
    assert server.requests == 0


def test_a_try_that_lost_its_lease_writes_no_further_part_nor_the_manifest(batch, server):
    from airflow_vllm_batch.lease import LeaseHolder

    async def successor_takes_over_after_r5(custom_id: str, body: dict, attempt: int) -> web.Response:
        if custom_id == "r5":
            # The task's next try took over (the scheduler thought this one dead); its heartbeat is not due yet.
            successor = LeaseHolder("d", "run-1", "vllm_batch", -1, 2, "f" * 64, "gpu-2")
            await asyncio.to_thread(
                batch.client.put_object,
                Bucket=batch.bucket,
                Key="out/results.lease.json",
                Body=json.dumps(successor.__dict__).encode(),
            )
        await asyncio.sleep(0.01)
        return web.json_response(
            {
                "id": custom_id,
                "object": "chat.completion",
                "created": 1,
                "model": "m",
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            }
        )

    server.behaviour = successor_takes_over_after_r5
    with pytest.raises(OutputBusyError, match=r"\(try 2, on gpu-2\) took over the lease"):
        batch.run(max_in_flight=1)
    answered = [int(r["custom_id"][1:]) for k in batch.parts() for r in batch.lines(k)]
    assert max(answered, default=-1) <= 5  # nothing answered after the takeover went up
    assert "out/results.manifest.json" not in batch.keys()
    assert "out/results.jsonl" not in batch.keys()


def test_each_try_names_its_parts_with_its_own_token(batch, server):
    # Two tries that start from the same parts (a zombie and its successor) number theirs alike:
    # the token keeps one from overwriting the other's part-N.
    server.behaviour = _dies_after(server, 5)
    with pytest.raises(ServerUnavailableError):
        batch.run(max_in_flight=1)
    first = set(batch.parts())
    server.restart()
    server.behaviour = _dies_after(server, 12)
    with pytest.raises(ServerUnavailableError):
        batch.run(FakeTI(try_number=2), max_in_flight=1)
    second = set(batch.parts()) - first
    tokens = [
        {re.fullmatch(r".*/part-\d{6}-([0-9a-f]{8})\.jsonl", k).group(1) for k in keys}
        for keys in (first, second)
    ]
    assert all(len(t) == 1 for t in tokens)
    assert tokens[0] != tokens[1]


def _completion(custom_id: str) -> web.Response:
    return web.json_response(
        {
            "id": custom_id,
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        }
    )


def _error(status: int, message: str = "engine busy", headers: dict | None = None) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "Busy", "param": None, "code": status}},
        status=status,
        headers=headers,
    )


def _rate_limited_flaky_and_one_broken(broken: str | None = "r7"):
    """r2, r3: a 429 with Retry-After first; r4, r5: a 500 first; r1: a 400 (final); ``broken``: a 500 every time."""

    async def behaviour(custom_id: str, body: dict, attempt: int) -> web.Response:
        if custom_id == broken:
            return _error(500, "EngineCore hiccup")
        if custom_id in ("r2", "r3") and attempt == 1:
            return _error(429, "rate limited", headers={"Retry-After": "0.2"})
        if custom_id in ("r4", "r5") and attempt == 1:
            return _error(500)
        if custom_id == "r1":
            return _error(400, "bad temperature")
        return _completion(custom_id)

    return behaviour


def test_a_request_left_without_a_final_answer_fails_the_try_retryable_and_the_retry_resends_only_it(
    batch, server
):
    server.behaviour = _rate_limited_flaky_and_one_broken()
    with pytest.raises(
        RequestsUnansweredError,
        match=r"1 request\(s\) got no final answer .*HTTP 500: 1; e\.g\. custom_id 'r7'",
    ) as raised:
        batch.run(FakeTI(try_number=1), retries=2, max_in_flight=2)
    assert raised.value.retryable
    assert "out/results.jsonl" not in batch.keys()
    assert "out/results.manifest.json" not in batch.keys()
    checkpointed = {
        r["custom_id"]: r["response"]["status_code"] for k in batch.parts() for r in batch.lines(k)
    }
    assert "r7" not in checkpointed
    assert len(checkpointed) == N - 1
    assert {cid: checkpointed[cid] for cid in ("r1", "r2", "r3", "r4", "r5")} == {
        "r1": 400,
        "r2": 200,
        "r3": 200,
        "r4": 200,
        "r5": 200,
    }
    sent_first = dict(server.attempts)
    assert sent_first["r7"] == 1 + stream.DEFAULT_RETRIES

    server.behaviour = _rate_limited_flaky_and_one_broken(broken=None)  # the server is well again
    manifest = batch.run(FakeTI(try_number=2), retries=2, max_in_flight=2, max_failed_ratio=0.1)
    resent = {cid for cid, n in server.attempts.items() if n > sent_first.get(cid, 0)}
    assert resent == {"r7"}
    assert manifest["request_counts"] == {
        "total": N,
        "completed": N - 1,
        "failed": 1,
    }  # r1's 400 is its answer
    published = {r["custom_id"]: r["response"]["status_code"] for r in batch.lines("out/results.jsonl")}
    assert published["r7"] == 200
    assert published["r2"] == 200
    assert published["r4"] == 200


def test_on_the_last_try_a_request_left_without_a_final_answer_is_published_in_the_error_file(batch, server):
    server.behaviour = _rate_limited_flaky_and_one_broken()
    manifest = batch.run(FakeTI(try_number=1), retries=0, max_in_flight=2, max_failed_ratio=0.2)
    assert manifest["request_counts"] == {"total": N, "completed": N - 2, "failed": 2}
    failed = {r["custom_id"]: r for r in batch.lines("out/results.errors.jsonl")}
    assert sorted(failed) == ["r1", "r7"]
    assert failed["r7"]["response"]["status_code"] == 500
    assert "EngineCore hiccup" in failed["r7"]["error"]["message"]
    assert server.attempts["r7"] == 1 + stream.DEFAULT_RETRIES


def test_the_last_try_of_a_task_with_retries_publishes_what_is_left_in_the_error_file(batch, server):
    server.behaviour = _rate_limited_flaky_and_one_broken()
    with pytest.raises(RequestsUnansweredError):
        batch.run(FakeTI(try_number=1), retries=1, max_in_flight=2)
    manifest = batch.run(FakeTI(try_number=2), retries=1, max_in_flight=2, max_failed_ratio=0.2)
    assert manifest["request_counts"]["failed"] == 2
    assert sorted(r["custom_id"] for r in batch.lines("out/results.errors.jsonl")) == ["r1", "r7"]


def test_a_checkpoint_never_holds_a_429_or_5xx_answer(batch, server):
    async def mostly_unwell(custom_id: str, body: dict, attempt: int) -> web.Response:
        n = int(custom_id[1:])
        if n % 4 == 0:
            return _error(429, "rate limited", headers={"Retry-After": "0"})
        if n % 4 == 1:
            return _error((500, 504, 507)[n % 3])
        if n % 4 == 2:
            return _error(404, "no such model")
        return _completion(custom_id)

    server.behaviour = mostly_unwell
    with pytest.raises(RequestsUnansweredError, match=r"10 request\(s\)"):
        batch.run(retries=3, max_in_flight=4)
    statuses = [r["response"]["status_code"] for k in batch.parts() for r in batch.lines(k)]
    assert sorted(set(statuses)) == [200, 404]
    assert len(statuses) == N // 2


def test_answers_repeated_across_tries_checkpoints_keep_the_first_and_publish(batch, server, capfd):
    server.behaviour = _dies_after(server, 10)
    with pytest.raises(ServerUnavailableError):
        batch.run(max_in_flight=1)
    # A zombie try's part lands after its successor listed the parts: r3 and r4 answered twice.
    zombie = [
        {
            "id": "vllm-zombie",
            "custom_id": cid,
            "response": {
                "status_code": 200,
                "request_id": "z",
                "body": {"object": "chat.completion", "zombie": True},
            },
            "error": None,
        }
        for cid in ("r3", "r4")
    ]
    first_part = batch.parts()[0]
    batch.client.put_object(
        Bucket=batch.bucket,
        Key=first_part.rsplit("/", 1)[0] + "/part-000099-deadbeef.jsonl",
        Body=b"".join(json.dumps(z).encode() + b"\n" for z in zombie),
    )
    server.restart()
    server.behaviour = _dies_after(server, N)
    manifest = batch.run(FakeTI(try_number=2), max_in_flight=1)
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    published = list(batch.lines("out/results.jsonl"))
    assert sorted(r["custom_id"] for r in published) == sorted(f"r{i}" for i in range(N))
    assert not any(r["id"] == "vllm-zombie" for r in published)
    assert "2 repeated answer(s) of requests answered twice" in capfd.readouterr().out


def test_an_answer_to_a_custom_id_not_in_the_input_drops_only_the_part_that_holds_it(batch, server):
    server.behaviour = _dies_after(server, 10)
    with pytest.raises(ServerUnavailableError):
        batch.run(max_in_flight=1)
    valid_parts = batch.parts()
    stray = {
        "id": "vllm-x",
        "custom_id": "not-in-input",
        "response": {"status_code": 200, "request_id": "x", "body": {}},
        "error": None,
    }
    prefix = valid_parts[0].rsplit("/", 1)[0]
    batch.client.put_object(
        Bucket=batch.bucket,
        Key=prefix + "/part-000099-deadbeef.jsonl",
        Body=json.dumps(stray).encode() + b"\n",
    )
    answered = {
        json.loads(line)["custom_id"]
        for key in valid_parts
        for line in batch.client.get_object(Bucket=batch.bucket, Key=key)["Body"].read().splitlines()
    }
    sent_before = dict(server.attempts)
    server.restart()
    server.behaviour = _dies_after(server, N)
    # The resume drops the part the results check could never accept, before anything is sent (as that
    # check would: issue 34, seed 106), and keeps the valid ones (Durability): the retry sends only the rest.
    manifest = batch.run(FakeTI(try_number=2), max_in_flight=1)
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    sent_again = {cid for cid, n in server.attempts.items() if n > sent_before.get(cid, 0)}
    assert answered
    assert not sent_again & answered
    assert len(sent_again) == N - len(answered)
    assert sorted(r["custom_id"] for r in batch.lines("out/results.jsonl")) == sorted(
        f"r{i}" for i in range(N)
    )


def test_a_retry_whose_parts_repeat_more_answers_than_are_left_sends_exactly_the_unanswered(batch, server):
    server.behaviour = _dies_after(server, 10)
    with pytest.raises(ServerUnavailableError):
        batch.run(max_in_flight=1)
    first_parts = batch.parts()
    sent_first = dict(server.attempts)
    # A zombie try's part repeats all ten answers: 20 answers in the parts, 10 requests still unanswered.
    prefix = first_parts[0].rsplit("/", 1)[0]
    repeated = b"".join(
        batch.client.get_object(Bucket=batch.bucket, Key=k)["Body"].read() for k in first_parts
    )
    batch.client.put_object(Bucket=batch.bucket, Key=prefix + "/part-000099-deadbeef.jsonl", Body=repeated)
    server.restart()
    server.behaviour = _dies_after(server, N)
    manifest = batch.run(FakeTI(try_number=2), max_in_flight=1)
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    sent_second = {cid for cid, n in server.attempts.items() if n - sent_first.get(cid, 0)}
    assert sent_second == {f"r{i}" for i in range(10, N)}


def test_a_results_check_that_finds_requests_missing_keeps_every_checkpoint_part(batch, server, monkeypatch):
    server.behaviour = _dies_after(server, 10)
    with pytest.raises(ServerUnavailableError):
        batch.run(max_in_flight=1)
    parts = batch.parts()
    server.restart()
    server.behaviour = _dies_after(server, N)
    # A try that wrongly believes every request answered streams nothing: the check finds ten missing.
    everything = CustomIdIndex()
    for i in range(N):
        everything.add(f"r{i}", i + 1)
    with monkeypatch.context() as patched:
        patched.setattr(
            server_engines, "resumable_parts", lambda staging, wanted, log: (staging.list_parts(), everything)
        )
        with pytest.raises(ResultsCheckError, match="without a result"):
            batch.run(FakeTI(try_number=2), max_in_flight=1)
    assert batch.parts() == parts
    manifest = batch.run(FakeTI(try_number=3), max_in_flight=1)
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}


def test_a_retry_drops_a_part_holding_an_unreadable_line_and_answers_its_requests_again(batch, server):
    # A try that died before its results check leaves a part no check accepts (simulator seed 106 of
    # issue 34): reading it as answers failed every retry on the same line (msgspec.DecodeError).
    server.behaviour = _dies_after(server, 10)
    with pytest.raises(ServerUnavailableError):
        batch.run(max_in_flight=1)
    parts = batch.parts()
    assert len(parts) >= 2
    body = batch.client.get_object(Bucket=batch.bucket, Key=parts[0])["Body"].read()
    batch.client.put_object(Bucket=batch.bucket, Key=parts[0], Body=body + b'{"custom_id": "r0", "resp\n')
    server.restart()
    server.behaviour = _dies_after(server, N)
    manifest = batch.run(FakeTI(try_number=2), max_in_flight=1)
    assert manifest["request_counts"] == {"total": N, "completed": N, "failed": 0}
    answered = [line["custom_id"] for line in batch.lines("out/results.jsonl")]
    assert sorted(answered) == sorted(f"r{i}" for i in range(N))


@pytest.mark.parametrize(
    ("try_number", "max_tries", "retries", "last"),
    [
        (1, 0, 0, True),  # retries=0: the only try is the last
        (1, 2, 2, False),
        (3, 2, 2, True),
        (4, 5, 2, False),  # cleared after three tries: max_tries grew by the retries
        (6, 5, 2, True),
        (1, None, 2, False),  # a task instance that does not say: the task's retries decide
        (1, 0, 2, False),  # max_tries not filled in by the API server yet
    ],
)
def test_the_last_try_is_the_one_airflow_will_not_retry(try_number, max_tries, retries, last):
    from airflow_vllm_batch.operators.task_try import task_try

    ti = FakeTI(try_number=try_number)
    if max_tries is not None:
        ti.max_tries = max_tries
    assert task_try({"ti": ti}, retries).last_try is last
