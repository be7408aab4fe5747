"""Unit tests of the stream against a stand-in server: bounds, retries, error lines, skip, a dead server."""

from __future__ import annotations

import asyncio
import email.utils
import json
import re
import threading
import time
import types
from pathlib import Path

import pytest
from aiohttp import web

from airflow_vllm_batch.serving import (
    BadRequestLineError,
    Journal,
    ServerAuthError,
    ServerUnavailableError,
    StreamStats,
    run_stream,
    stream,
)
from airflow_vllm_batch.serving.stream import result_line
from tests.unit.serving.conftest import API_KEY, StandIn, chat_completion, request_lines

ERROR_RESPONSE = {
    "error": {"message": "bad temperature", "type": "BadRequestError", "param": "temperature", "code": 400}
}


def _stream(stand_in: StandIn, tmp_path: Path, lines, **kwargs) -> tuple[StreamStats, list[dict], Journal]:
    journal = Journal(tmp_path / "journal")
    kwargs.setdefault("backoff_s", 0.01)
    stats = run_stream(lines, base_url=stand_in.base_url, api_key=API_KEY, journal=journal, **kwargs)
    return stats, _journal_lines(journal), journal


def _journal_lines(journal: Journal) -> list[dict]:
    return [json.loads(line) for part in journal.parts for line in part.path.read_bytes().splitlines()]


def test_requests_in_flight_never_exceed_the_bound(stand_in, tmp_path):
    async def slow(custom_id, body, attempt):
        await asyncio.sleep(0.01)
        return web.json_response(chat_completion(custom_id))

    stand_in.behaviour = slow
    stats, results, _ = _stream(stand_in, tmp_path, request_lines(60), max_in_flight=4)
    assert stand_in.max_in_flight == 4
    assert stats.done == 60
    assert len(results) == 60


def test_the_input_is_read_only_a_bounded_way_ahead_of_the_answers(stand_in, tmp_path):
    read = 0
    release = threading.Event()

    def lines():
        nonlocal read
        for item in request_lines(5000):
            read += 1
            yield item

    async def held(custom_id, body, attempt):
        await asyncio.to_thread(release.wait, 10)
        return web.json_response(chat_completion(custom_id))

    stand_in.behaviour = held
    timer = threading.Timer(0.5, release.set)
    timer.start()
    journal = Journal(tmp_path)
    seen_when_released = []

    def on_progress(stats: StreamStats) -> None:
        if not seen_when_released:
            seen_when_released.append(read)

    run_stream(
        lines(),
        base_url=stand_in.base_url,
        api_key=API_KEY,
        journal=journal,
        max_in_flight=2,
        on_progress=on_progress,
        progress_every_s=0.3,
    )
    timer.join()
    # In flight (2) + what is buffered (under one chunk of 64) + the chunk read ahead (64).
    assert seen_when_released
    assert seen_when_released[0] <= 2 + 2 * 64


def test_every_request_is_sent_with_the_api_key_and_answered_once(stand_in, tmp_path):
    stats, results, _ = _stream(stand_in, tmp_path, request_lines(20))
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{i}" for i in range(20))
    assert stand_in.auth_headers == {f"Bearer {API_KEY}"}
    assert (stats.prompt_tokens, stats.completion_tokens, stats.failed) == (100, 60, 0)


def test_a_success_line_has_vllms_shape_and_the_servers_body(stand_in, tmp_path):
    _, (line,), _ = _stream(stand_in, tmp_path, request_lines(1))
    assert list(line) == ["id", "custom_id", "response", "error"]
    assert list(line["response"]) == ["status_code", "request_id", "body"]
    assert re.fullmatch(r"vllm-[0-9a-f]{16}", line["id"])
    assert re.fullmatch(r"vllm-batch-[0-9a-f]{16}", line["response"]["request_id"])
    assert line["response"]["status_code"] == 200
    assert line["response"]["body"] == chat_completion("r0")
    assert line["error"] is None


def test_503_is_retried_until_it_succeeds(stand_in, tmp_path):
    async def flaky(custom_id, body, attempt):
        if attempt <= 2:
            return web.json_response({"error": "overloaded"}, status=503)
        return web.json_response(chat_completion(custom_id))

    stand_in.behaviour = flaky
    stats, results, _ = _stream(stand_in, tmp_path, request_lines(5), retries=3)
    assert [r["response"]["status_code"] for r in results] == [200] * 5
    assert stats.retried == 10
    assert stats.failed == 0
    assert set(stand_in.attempts.values()) == {3}


def test_a_400_becomes_that_lines_error_in_vllms_shape(stand_in, tmp_path):
    async def refuse_r1(custom_id, body, attempt):
        if custom_id == "r1":
            return web.json_response(ERROR_RESPONSE, status=400)
        return web.json_response(chat_completion(custom_id))

    stand_in.behaviour = refuse_r1
    stats, results, _ = _stream(stand_in, tmp_path, request_lines(3))
    (error,) = [r for r in results if r["custom_id"] == "r1"]
    assert list(error) == ["id", "custom_id", "response", "error"]
    assert error["response"]["status_code"] == 400
    assert error["response"]["body"] is None
    assert error["error"] == ERROR_RESPONSE
    assert stats.failed == 1
    assert stats.done == 3
    assert stand_in.attempts["r1"] == 1


def test_an_answer_that_is_not_an_error_response_becomes_a_string_error(stand_in, tmp_path):
    async def not_found(custom_id, body, attempt):
        return web.json_response({"detail": "Not Found"}, status=404)

    stand_in.behaviour = not_found
    _, (line,), _ = _stream(stand_in, tmp_path, request_lines(1))
    assert line["response"]["status_code"] == 404
    assert line["error"] == 'HTTP 404 from /v1/chat/completions: {"detail": "Not Found"}'


def test_a_request_that_keeps_timing_out_is_set_aside_with_a_504_line_not_journaled(stand_in, tmp_path):
    async def stuck_r0(custom_id, body, attempt):
        if custom_id == "r0":
            await asyncio.sleep(2)
        return web.json_response(chat_completion(custom_id))

    stand_in.behaviour = stuck_r0
    stats, results, journal = _stream(stand_in, tmp_path, request_lines(2), retries=1, request_timeout_s=0.2)
    assert [r["custom_id"] for r in results] == ["r1"]
    (line,) = _set_aside_lines(journal)
    assert line["custom_id"] == "r0"
    assert line["response"]["status_code"] == 504
    assert "no answer within 0.2s, 1 attempt" in line["error"]
    assert (stats.done, stats.failed, stats.unanswered, stats.unanswered_reasons) == (1, 0, 1, {"timeout": 1})
    assert stand_in.attempts["r0"] == 1  # request_timeout_s is the request's whole time, its retries included


def _set_aside_lines(journal: Journal) -> list[dict]:
    path = journal.set_aside_path
    return [json.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def _answer_after(failures: int, status: int, headers: dict | None = None):
    """A behaviour answering ``status`` to the first ``failures`` attempts of every request, then a completion."""

    async def behaviour(custom_id, body, attempt):
        if attempt <= failures:
            return web.json_response(
                {"error": {"message": "try later", "type": "Busy", "param": None, "code": status}},
                status=status,
                headers=headers,
            )
        return web.json_response(chat_completion(custom_id))

    return behaviour


@pytest.mark.parametrize("status", [408, 429, 500, 504])
def test_a_transient_status_is_retried_inside_the_try_until_the_answer_is_200(stand_in, tmp_path, status):
    stand_in.behaviour = _answer_after(2, status)
    stats, results, _ = _stream(stand_in, tmp_path, request_lines(3), retries=3)
    assert [r["response"]["status_code"] for r in results] == [200] * 3
    assert set(stand_in.attempts.values()) == {3}
    assert (stats.retried, stats.failed) == (6, 0)


def test_a_429_waits_as_long_as_its_retry_after_says(stand_in, tmp_path, monkeypatch):
    waits: list[float] = []

    async def clocked_sleep(delay: float, result=None):
        # The stream's waits are recorded, not timed: a loaded machine stretches a real
        # sleep but cannot change what the stream asks for.
        waits.append(delay)
        return await asyncio.sleep(0, result)

    # Only the stream module's name is replaced: the stand-in server and the journal sleep as usual.
    monkeypatch.setattr(stream, "asyncio", types.SimpleNamespace(**{**vars(asyncio), "sleep": clocked_sleep}))

    async def rate_limited(custom_id, body, attempt):
        if attempt == 1:
            return web.json_response({"error": "slow down"}, status=429, headers={"Retry-After": "1"})
        return web.json_response(chat_completion(custom_id))

    stand_in.behaviour = rate_limited
    # backoff_s=0.01: without Retry-After the retry would come within about 10 ms.
    _, results, _ = _stream(stand_in, tmp_path, request_lines(1), retries=2, backoff_s=0.01)
    assert [r["response"]["status_code"] for r in results] == [200]
    # Never sooner than asked, spread by at most a fifth to keep refused requests apart.
    assert len(waits) == 1, waits
    assert 1.0 <= waits[0] <= 1.2, waits


@pytest.mark.parametrize("status", [408, 429, 500, 504, 507])
def test_a_request_whose_retries_run_out_on_a_non_final_answer_is_set_aside_and_the_others_go_on(
    stand_in, tmp_path, status
):
    async def r1_never_answers(custom_id, body, attempt):
        if custom_id == "r1":
            return web.json_response(
                {"error": {"message": "engine busy", "type": "Busy", "param": None, "code": status}},
                status=status,
            )
        return web.json_response(chat_completion(custom_id))

    stand_in.behaviour = r1_never_answers
    stats, results, journal = _stream(stand_in, tmp_path, request_lines(4), retries=2)
    assert sorted(r["custom_id"] for r in results) == [
        "r0",
        "r2",
        "r3",
    ]  # nothing but final answers in the parts
    assert stand_in.attempts["r1"] == 3
    (line,) = _set_aside_lines(journal)
    assert line["custom_id"] == "r1"
    assert line["response"]["status_code"] == status
    assert line["error"]["error"]["message"] == "engine busy"
    assert (stats.unanswered, stats.unanswered_reasons, stats.unanswered_example) == (
        1,
        {f"HTTP {status}": 1},
        "r1",
    )


def test_a_200_whose_body_is_not_json_is_retried_not_journaled(stand_in, tmp_path):
    async def cut_short_once(custom_id, body, attempt):
        if attempt == 1:
            return web.Response(body=b"<html>gateway</html>", status=200, content_type="text/html")
        return web.json_response(chat_completion(custom_id))

    stand_in.behaviour = cut_short_once
    stats, results, _ = _stream(stand_in, tmp_path, request_lines(2), retries=1)
    assert [r["response"]["status_code"] for r in results] == [200, 200]
    assert stats.retried == 2


def _http_date(seconds_from_now: float, now: float) -> str:
    return email.utils.formatdate(now + seconds_from_now, usegmt=True)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("3", 3.0),
        (" 0.25 ", 0.25),
        ("date+5", 5.0),
        ("date-30", 0.0),
        ("3600", stream.MAX_RETRY_AFTER_S),
        ("date+3600", stream.MAX_RETRY_AFTER_S),
        ("soon", None),
        ("nan", None),
        ("", None),
        (None, None),
    ],
)
def test_retry_after_is_read_as_seconds_or_an_http_date_and_capped(header, expected):
    now = 1_800_000_000.0
    if header and header.startswith("date"):
        header = _http_date(float(header[4:]), now)
    assert stream.retry_after_s(header, now=now) == expected


def test_skipped_requests_are_not_sent(stand_in, tmp_path):
    answered = {f"r{i}" for i in range(0, 200, 2)}
    stats, results, _ = _stream(stand_in, tmp_path, request_lines(200), skip=answered.__contains__)
    assert not answered & set(stand_in.attempts)
    assert {r["custom_id"] for r in results} == {f"r{i}" for i in range(1, 200, 2)}
    assert (stats.read, stats.skipped, stats.done) == (200, 100, 100)


def test_a_server_gone_for_good_raises_after_the_journal_is_flushed(stand_in, tmp_path):
    async def die_after_five(custom_id, body, attempt):
        if sum(stand_in.attempts.values()) > 5:
            stand_in.stop_soon()  # closes this connection too: the client sees it dropped
            await asyncio.sleep(10)
        return web.json_response(chat_completion(custom_id))

    stand_in.behaviour = die_after_five
    journal = Journal(tmp_path)
    with pytest.raises(ServerUnavailableError, match="did not answer after 2 retries") as raised:
        run_stream(
            request_lines(50),
            base_url=stand_in.base_url,
            api_key=API_KEY,
            journal=journal,
            max_in_flight=1,
            retries=2,
            backoff_s=0.01,
        )
    assert journal.lines_durable == 5
    assert len(_journal_lines(journal)) == 5
    assert API_KEY not in str(raised.value)


def test_a_refused_server_raises_server_unavailable(tmp_path):
    journal = Journal(tmp_path)
    with pytest.raises(ServerUnavailableError, match=r"127.0.0.1:9"):
        run_stream(
            request_lines(3),
            base_url="http://127.0.0.1:9",
            api_key=None,
            journal=journal,
            retries=1,
            backoff_s=0.01,
        )


def test_a_refused_api_key_raises_at_once_without_showing_it(stand_in, tmp_path):
    async def unauthorized(custom_id, body, attempt):
        return web.json_response({"error": "Unauthorized"}, status=401)

    stand_in.behaviour = unauthorized
    with pytest.raises(ServerAuthError, match="refused the API key") as raised:
        _stream(stand_in, tmp_path, request_lines(10), max_in_flight=2)
    assert API_KEY not in str(raised.value)
    assert sum(stand_in.attempts.values()) <= 2


def test_a_line_that_is_not_a_request_names_its_line_number(stand_in, tmp_path):
    lines = [*request_lines(2), (3, b'{"custom_id": "x"}')]
    with pytest.raises(BadRequestLineError, match="Input line 3"):
        _stream(stand_in, tmp_path, lines)


def test_blank_lines_are_ignored(stand_in, tmp_path):
    stats, results, _ = _stream(stand_in, tmp_path, [*request_lines(2), (3, b"  \n")])
    assert stats.read == 2
    assert len(results) == 2


def test_progress_reports_counts_and_rates(stand_in, tmp_path):
    async def slow(custom_id, body, attempt):
        await asyncio.sleep(0.02)
        return web.json_response(chat_completion(custom_id))

    stand_in.behaviour = slow
    reports: list[StreamStats] = []
    _stream(
        stand_in,
        tmp_path,
        request_lines(40),
        max_in_flight=2,
        on_progress=reports.append,
        progress_every_s=0.1,
    )
    assert reports
    last = reports[-1]
    assert 0 < last.done <= last.read <= 40
    assert last.requests_per_s > 0
    assert last.output_tokens_per_s == pytest.approx(3 * last.requests_per_s)


def test_a_failed_checkpoint_upload_stops_the_stream(stand_in, tmp_path):
    def upload(path, index):
        raise OSError("S3 is down")

    journal = Journal(tmp_path, on_part=upload, max_part_bytes=1)
    with pytest.raises(OSError, match="S3 is down"):
        run_stream(
            request_lines(100), base_url=stand_in.base_url, api_key=API_KEY, journal=journal, max_in_flight=2
        )
    assert sum(stand_in.attempts.values()) < 100


def test_result_line_escapes_the_custom_id():
    line = json.loads(result_line('a"b\n', 200, b'{"x":1}', None))
    assert line["custom_id"] == 'a"b\n'
    assert line["response"]["body"] == {"x": 1}


def test_a_wedged_server_ends_the_stream_within_the_request_timeout_not_retries_times_it(stand_in, tmp_path):
    # Bounded: a server that takes requests and never answers once held each one 7 x 30 min.
    async def wedged(custom_id, body, attempt):
        await asyncio.sleep(30)  # cancelled when the stand-in closes
        return web.json_response(chat_completion(custom_id))

    stand_in.behaviour = wedged
    started = time.monotonic()
    with pytest.raises(
        ServerUnavailableError, match=r"answered no request for 0\.5s \(request_timeout\).*wedged"
    ):
        _stream(stand_in, tmp_path, request_lines(8), max_in_flight=4, retries=6, request_timeout_s=0.5)
    assert time.monotonic() - started < 0.5 + 2.0  # one request_timeout, plus room for a loaded machine
    assert max(stand_in.attempts.values()) == 1


def test_a_request_retried_after_errors_still_ends_by_its_request_timeout(stand_in, tmp_path):
    async def fails_then_hangs(custom_id, body, attempt):
        if custom_id == "r0":
            if attempt == 1:
                return web.json_response({"error": {"message": "busy", "code": 500}}, status=500)
            await asyncio.sleep(30)
        return web.json_response(chat_completion(custom_id))

    stand_in.behaviour = fails_then_hangs
    started = time.monotonic()
    stats, results, _journal = _stream(stand_in, tmp_path, request_lines(2), retries=6, request_timeout_s=0.6)
    assert time.monotonic() - started < 0.6 + 2.0
    assert [r["custom_id"] for r in results] == ["r1"]
    assert stats.unanswered_reasons == {"timeout": 1}
    assert stand_in.attempts["r0"] == 2


def test_a_stopped_stream_sends_nothing_more_and_journals_what_was_answered(stand_in, tmp_path):
    sent: list[str] = []

    def stop() -> bool:
        sent.append("asked")
        return len(stand_in.attempts) >= 10

    # 200 lines fit in one chunk of the feed: the stop is asked before each send, not only when reading.
    stats, results, _ = _stream(stand_in, tmp_path, request_lines(200), max_in_flight=2, stop=stop)
    assert 10 <= len(stand_in.attempts) <= 12
    assert len(sent) >= 10
    assert {r["custom_id"] for r in results} == set(stand_in.attempts)
    assert stats.done == len(results)
    assert stats.unanswered == 0
