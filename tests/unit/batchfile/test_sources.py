from __future__ import annotations

import http.server
import io
import threading

import pytest

from airflow_vllm_batch.batchfile import describe_source, iter_lines, open_lines, redact_url
from airflow_vllm_batch.exceptions import VLLMBatchError


class Trickle(io.RawIOBase):
    """A file-like that returns at most 3 bytes per read, like a slow network body."""

    def __init__(self, data: bytes):
        self._data = io.BytesIO(data)

    def read(self, n=-1):
        return self._data.read(min(n, 3) if n and n > 0 else 3)


def test_lines_are_yielded_without_newline():
    assert list(iter_lines(io.BytesIO(b"a\nbb\n"))) == [b"a", b"bb"]


def test_missing_final_newline_still_yields_last_line():
    assert list(iter_lines(io.BytesIO(b"a\nbb"))) == [b"a", b"bb"]


def test_blank_lines_are_yielded_empty():
    assert list(iter_lines(io.BytesIO(b"a\n\nb\n"))) == [b"a", b"", b"b"]


def test_crlf_keeps_carriage_return():
    assert list(iter_lines(io.BytesIO(b"a\r\nb\r\n"))) == [b"a\r", b"b\r"]


def test_lines_spanning_chunks_are_joined():
    data = b"first line\nsecond, longer line\nthird"
    assert list(iter_lines(Trickle(data), chunk_size=4)) == data.split(b"\n")


def test_overlong_line_is_cut_past_the_limit():
    lines = list(iter_lines(io.BytesIO(b"x" * 100 + b"\nok\n"), chunk_size=7, max_line_bytes=10))
    assert lines == [b"x" * 11, b"ok"]


def test_progress_callback_sees_every_byte():
    seen = []
    list(iter_lines(io.BytesIO(b"abc\n" * 10), chunk_size=8, on_bytes=seen.append))
    assert sum(seen) == 40


def test_open_lines_reads_a_path(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"1\n2")
    with open_lines(str(path)) as lines:
        assert list(lines) == [b"1", b"2"]


def test_open_lines_missing_file_raises_batch_error(tmp_path):
    with pytest.raises(VLLMBatchError, match="cannot open"):
        with open_lines(str(tmp_path / "nope.jsonl")):
            pass


def test_open_lines_refuses_s3_uri():
    with pytest.raises(VLLMBatchError, match="S3Hook"):
        with open_lines("s3://bucket/key.jsonl"):
            pass


@pytest.fixture
def http_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/missing"):
                self.send_error(403)
                return
            body = b'{"a": 1}\n{"b": 2}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_open_lines_streams_an_http_url(http_server):
    with open_lines(f"{http_server}/in.jsonl?X-Amz-Signature=secret") as lines:
        assert list(lines) == [b'{"a": 1}', b'{"b": 2}']


def test_http_error_message_hides_the_signature(http_server):
    with pytest.raises(VLLMBatchError) as excinfo:
        with open_lines(f"{http_server}/missing.jsonl?X-Amz-Signature=secret"):
            pass
    assert "403" in str(excinfo.value) and "secret" not in str(excinfo.value)


def test_redact_url_drops_query_and_credentials():
    assert redact_url("https://user:pw@host:9000/b/k.jsonl?sig=1") == "https://host:9000/b/k.jsonl?<redacted>"


def test_describe_source_of_a_file_like_is_its_type():
    assert describe_source(io.BytesIO()) == "<BytesIO>"
