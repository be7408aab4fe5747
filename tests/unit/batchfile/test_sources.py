from __future__ import annotations

import base64
import gzip
import http.server
import io
import threading

import pytest

from airflow_vllm_batch.batchfile import (
    describe_source,
    is_compressed,
    iter_lines,
    open_lines,
    redact_url,
    url_secrets,
)
from airflow_vllm_batch.exceptions import ConfigurationError, PreflightError, VLLMBatchError

JSONL = b'{"a": 1}\n{"b": 2}\n'


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
    with pytest.raises(VLLMBatchError, match="cannot open"), open_lines(str(tmp_path / "nope.jsonl")):
        pass


def test_open_lines_refuses_s3_uri():
    with pytest.raises(VLLMBatchError, match="S3Hook"), open_lines("s3://bucket/key.jsonl"):
        pass


@pytest.fixture
def http_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/missing"):
                self.send_error(403)
                return
            if (
                self.path.startswith("/private")
                and self.headers.get("Authorization")
                != "Basic " + base64.b64encode(b"reader:p@ss w0rd").decode()
            ):
                self.send_error(401)
                return
            body = b'{"a": 1}\n{"b": 2}'
            if self.path.startswith("/gz"):
                body = gzip.compress(JSONL)
            if self.headers.get("Range") == "bytes=0-3":
                body = body[:4]
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
    with (
        pytest.raises(VLLMBatchError) as excinfo,
        open_lines(f"{http_server}/missing.jsonl?X-Amz-Signature=secret"),
    ):
        pass
    assert "403" in str(excinfo.value)
    assert "secret" not in str(excinfo.value)


def test_credentials_in_an_http_url_are_sent_as_basic_authentication(http_server):
    url = http_server.replace("http://", "http://reader:p%40ss%20w0rd@") + "/private/in.jsonl"
    with open_lines(url) as lines:
        assert list(lines) == [b'{"a": 1}', b'{"b": 2}']
    assert is_compressed(url) is False


@pytest.mark.parametrize(
    "url",
    [
        "https://reader:S3cretPw1@files.example:notaport/in.jsonl",
        "https://reader:S3cretPw1@[files.example/in.jsonl",
        "http://reader:S3cretPw1@files.example:99999999/in.jsonl",
    ],
)
def test_a_malformed_url_is_a_mistake_naming_input_uri_without_its_password(url):
    with (
        pytest.raises(
            ConfigurationError,
            match=r"^input_uri: https?://(files\.example/in\.jsonl|<a URL that cannot be parsed>) is not a URL that can be read",
        ) as excinfo,
        open_lines(url),
    ):
        pass
    assert not excinfo.value.retryable
    assert "S3cretPw1" not in str(excinfo.value)


def test_the_secrets_of_an_input_url_are_its_whole_self_its_user_info_and_its_query():
    url = "https://reader:p%40ss@host/in.jsonl?X-Amz-Signature=abc"
    assert url_secrets(url) == [url, "X-Amz-Signature=abc", "reader:p%40ss", "p%40ss", "p@ss"]
    assert url_secrets("https://host/in.jsonl") == []
    assert url_secrets("s3://b/k?x") == []


def test_redact_url_drops_query_and_credentials():
    assert redact_url("https://user:pw@host:9000/b/k.jsonl?sig=1") == "https://host:9000/b/k.jsonl?<redacted>"


def test_describe_source_of_a_file_like_is_its_type():
    assert describe_source(io.BytesIO()) == "<BytesIO>"


class NoSeek:
    """A forward-only stream, like a botocore StreamingBody."""

    def __init__(self, data: bytes):
        self._data = io.BytesIO(data)

    def read(self, n=-1):
        return self._data.read(n)


def test_gzip_path_is_decompressed_whatever_its_name(tmp_path):
    path = tmp_path / "input.jsonl"  # no .gz: detection is by content
    path.write_bytes(gzip.compress(JSONL))
    with open_lines(path) as lines:
        assert (list(lines), lines.compression) == ([b'{"a": 1}', b'{"b": 2}'], "gzip")


def test_gzip_stream_is_decompressed_in_small_reads():
    with open_lines(Trickle(gzip.compress(JSONL)), chunk_size=5) as lines:
        assert list(lines) == [b'{"a": 1}', b'{"b": 2}']


def test_gzip_forward_only_stream_is_decompressed():
    with open_lines(NoSeek(gzip.compress(JSONL))) as lines:
        assert list(lines) == [b'{"a": 1}', b'{"b": 2}']


def test_concatenated_gzip_members_read_as_one_file():
    with open_lines(io.BytesIO(gzip.compress(b"1\n") + gzip.compress(b"2\n"))) as lines:
        assert list(lines) == [b"1", b"2"]


def test_gzip_http_url_is_decompressed(http_server):
    with open_lines(f"{http_server}/gz/in.jsonl.gz?X-Amz-Signature=secret") as lines:
        assert (list(lines), lines.compression) == ([b'{"a": 1}', b'{"b": 2}'], "gzip")


def test_uncompressed_source_reports_no_compression():
    with open_lines(io.BytesIO(JSONL)) as lines:
        list(lines)
        assert lines.compression is None


@pytest.mark.parametrize(
    ("name", "data", "fragment"),
    [
        ("truncated", gzip.compress(JSONL * 500)[:-40], "the gzip file is truncated"),
        (
            "corrupt",
            gzip.compress(JSONL * 500)[:20] + b"\0" * 40 + gzip.compress(JSONL * 500)[60:],
            "the gzip data is corrupt",
        ),
        ("trailing_garbage", gzip.compress(JSONL) + b"not gzip", "the gzip data is corrupt"),
    ],
    # The data's gzip header holds the time it was made: named by the case alone, the ids are
    # the same in every process that collects them (pytest-xdist's workers must agree).
    ids=["truncated", "corrupt", "trailing_garbage"],
)
def test_bad_gzip_raises_an_error_naming_the_file(tmp_path, name, data, fragment):
    path = tmp_path / f"{name}.jsonl.gz"
    path.write_bytes(data)
    with pytest.raises(PreflightError) as excinfo, open_lines(path) as lines:
        list(lines)
    assert str(path) in str(excinfo.value)
    assert fragment in str(excinfo.value)


def test_zstd_is_refused_with_what_to_do():
    with (
        pytest.raises(PreflightError, match=r"compressed with zstd.*gzip"),
        open_lines(io.BytesIO(b"\x28\xb5\x2f\xfd" + b"\0" * 20)),
    ):
        pass


def test_progress_counts_compressed_bytes_for_gzip():
    data = gzip.compress(JSONL * 100)
    seen = []
    with open_lines(io.BytesIO(data), on_bytes=seen.append) as lines:
        list(lines)
    assert sum(seen) == len(data)


@pytest.mark.parametrize(
    ("data", "expected"),
    [(gzip.compress(JSONL), True), (JSONL, False), (b"", False)],
    ids=["gzip", "jsonl", "empty"],  # the gzip header holds the time it was made (xdist's workers must agree)
)
def test_is_compressed_reads_the_magic_bytes_of_a_path(tmp_path, data, expected):
    path = tmp_path / "f"
    path.write_bytes(data)
    assert is_compressed(path) is expected


def test_is_compressed_rewinds_a_seekable_stream():
    stream = io.BytesIO(gzip.compress(JSONL))
    assert is_compressed(stream)
    assert stream.tell() == 0


def test_is_compressed_asks_a_url_for_its_first_bytes(http_server):
    assert is_compressed(f"{http_server}/gz/in.jsonl?sig=1")
    assert not is_compressed(f"{http_server}/plain.jsonl?sig=1")


@pytest.mark.parametrize(("data", "expected"), [(b"a\nb\n", True), (b"a\nb", False), (b"", False)])
def test_lines_record_whether_the_file_ended_with_a_newline(data, expected):
    with open_lines(io.BytesIO(data), chunk_size=1) as lines:
        list(lines)
        assert lines.ended_with_newline is expected


def test_redact_url_leaves_out_a_port_that_is_no_number():
    assert redact_url("https://user:pw@host:pw@x/in.jsonl") == "https://x/in.jsonl"
    assert redact_url("https://user:pw@host:abc/in.jsonl") == "https://host/in.jsonl"
