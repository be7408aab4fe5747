"""The chaos campaign's S3 fault proxy (tests/integration/s3_fault_proxy.py), in front of a recording HTTP stand-in."""

from __future__ import annotations

import http.client
import http.server
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest

from tests.integration.s3_fault_proxy import FaultProxy


class _Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    received: ClassVar[list[tuple[str, str, bytes]]] = []

    def _answer(self) -> None:
        if self.headers.get("Transfer-Encoding") == "chunked":
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                body += self.rfile.read(size)
                self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.received.append((self.command, self.path, body))
        answer = b"stored:" + body
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.send_header("ETag", '"abc"')
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(answer)

    do_PUT = do_GET = do_HEAD = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def proxied() -> Iterator[tuple[FaultProxy, list[tuple[str, str, bytes]]]]:
    _Recorder.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    lines: list[str] = []
    with FaultProxy("127.0.0.1", server.server_address[1], seed=1, log=lines.append) as proxy:
        yield proxy, _Recorder.received
    server.shutdown()


def _put(proxy: FaultProxy, body: bytes, chunked: bool = False, expect: bool = False) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    headers = {"Expect": "100-continue"} if expect else {}
    if chunked:
        conn.putrequest("PUT", "/bucket/key?X-Amz-Signature=secret")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        conn.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    else:
        conn.request("PUT", "/bucket/key?X-Amz-Signature=secret", body=body, headers=headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, data


def test_without_faults_every_request_and_answer_passes_whole_also_chunked_and_after_100_continue(proxied):
    proxy, received = proxied
    assert _put(proxy, b"plain") == (200, b"stored:plain")
    assert _put(proxy, b"in chunks", chunked=True) == (200, b"stored:in chunks")
    assert _put(proxy, b"expecting", expect=True) == (200, b"stored:expecting")
    assert [body for _, _, body in received] == [b"plain", b"in chunks", b"expecting"]
    assert sum(proxy.injected.values()) == 0


def test_a_reset_request_never_reaches_s3(proxied):
    proxy, received = proxied
    proxy.set_faults(1.0, ("reset",))
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        _put(proxy, b"x")
    assert received == []
    assert proxy.injected["reset"] == 1


def test_a_lost_answer_is_a_write_that_landed_while_the_client_saw_an_error(proxied):
    proxy, received = proxied
    proxy.set_faults(1.0, ("lost",))
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        _put(proxy, b"landed")
    assert [body for _, _, body in received] == [b"landed"]


@pytest.mark.parametrize(
    ("kind", "status", "code"), [("slowdown", 503, b"SlowDown"), ("error500", 500, b"InternalError")]
)
def test_an_error_answer_is_s3s_own_and_the_request_never_reaches_s3(proxied, kind, status, code):
    proxy, received = proxied
    proxy.set_faults(1.0, (kind,))
    answered, body = _put(proxy, b"x")
    assert answered == status
    assert b"<Code>" + code + b"</Code>" in body
    assert received == []


def test_the_log_names_method_and_path_without_the_query():
    lines: list[str] = []
    proxy = FaultProxy("127.0.0.1", 9, seed=1, log=lines.append).start()
    try:
        proxy.set_faults(1.0, ("reset",))
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            _put(proxy, b"x")
    finally:
        proxy.stop()
    assert len(lines) == 1
    assert lines[0].endswith("proxy reset PUT /bucket/key")
    assert "secret" not in lines[0]


def test_an_unknown_kind_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown kinds \\['drop'\\]"):
        FaultProxy("127.0.0.1", 9, seed=1).set_faults(0.5, ("drop",))
