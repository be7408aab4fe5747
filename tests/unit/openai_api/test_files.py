"""An upload is parsed as it arrives and written to S3 part by part: what it holds in memory is bounded by one part."""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import pytest

from airflow_vllm_batch.batchfile.problems import Problem
from airflow_vllm_batch.exceptions import PreflightError
from airflow_vllm_batch.openai_api.batch_dag import failure_record
from airflow_vllm_batch.openai_api.files import PART_BYTES, FormReader, LineCounter, UploadError
from airflow_vllm_batch.storage.s3 import ObjectWriter

BOUNDARY = "b0undary"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def form(file_bytes: bytes, purpose: str = "batch", closing: bool = True) -> bytes:
    body = (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + file_bytes
        + b"\r\n"
    )
    return body + (f"--{BOUNDARY}--\r\n".encode() if closing else b"")


class FakeS3:
    """Records what a writer sends."""

    def __init__(self):
        self.parts: list[bytes] = []
        self.put: bytes | None = None
        self.completed = self.aborted = False
        self.content_types: list[str] = []

    def create_multipart_upload(self, **kw):
        self.content_types.append(kw["ContentType"])
        return {"UploadId": "u1"}

    def upload_part(self, *, Body, PartNumber, **kw):
        self.parts.append(Body)
        return {"ETag": f"e{PartNumber}"}

    def complete_multipart_upload(self, *, MultipartUpload, **kw):
        assert [p["PartNumber"] for p in MultipartUpload["Parts"]] == list(range(1, len(self.parts) + 1))
        self.completed = True
        return {"ETag": '"c-3"'}

    def abort_multipart_upload(self, **kw):
        self.aborted = True

    def put_object(self, *, Body, **kw):
        self.put = Body
        self.content_types.append(kw["ContentType"])
        return {"ETag": '"p"'}


def upload(body: bytes, chunk: int) -> tuple[FormReader, FakeS3, LineCounter, str]:
    """What the API does with a request body: feed it chunk by chunk, write full parts, finish."""
    reader, s3, counter, pending = FormReader(CONTENT_TYPE), FakeS3(), LineCounter(), bytearray()
    writer = ObjectWriter(s3, "b", "k", content_type="application/jsonl")
    for start in range(0, len(body), chunk):
        data = reader.feed(body[start : start + chunk])
        counter.add(data)
        pending += data
        while len(pending) >= PART_BYTES:
            writer.write_part(bytes(pending[:PART_BYTES]))
            del pending[:PART_BYTES]
    reader.finish()
    etag = writer.finish(bytes(pending))
    return reader, s3, counter, etag


@pytest.mark.parametrize("chunk", [1, 7, 65536])
def test_a_small_file_is_one_put_with_its_fields_read(chunk):
    data = b'{"a": 1}\n{"b": 2}\n{"c": 3}'
    reader, s3, counter, etag = upload(form(data), chunk)
    assert s3.put == data
    assert not s3.parts
    assert etag == "p"
    assert s3.content_types == ["application/jsonl"]
    assert reader.fields == {"purpose": "batch"}
    assert reader.filename == "in.jsonl"
    assert (counter.bytes, counter.lines) == (len(data), 3)


def test_a_large_file_goes_up_in_parts_of_at_most_one_part_size():
    line = b'{"custom_id": "x", "body": {}}\n'
    data = line * (2 * PART_BYTES // len(line) + 5)
    _, s3, counter, etag = upload(form(data), 1 << 20)
    assert s3.completed
    assert b"".join(s3.parts) == data
    assert etag == "c-3"
    assert s3.content_types == ["application/jsonl"]
    assert max(len(p) for p in s3.parts) == PART_BYTES
    assert len(s3.parts) == 3
    assert counter.lines == data.count(b"\n")


def test_a_body_cut_before_its_closing_boundary_is_refused():
    with pytest.raises(UploadError, match="closing boundary"):
        upload(form(b"{}\n", closing=False), 100)


def test_a_body_that_is_not_a_form_is_refused():
    with pytest.raises(UploadError, match="multipart/form-data"):
        FormReader("application/json")


def test_an_aborted_upload_drops_its_parts():
    s3 = FakeS3()
    writer = ObjectWriter(s3, "b", "k", content_type="application/jsonl")
    writer.write_part(b"x" * 10)
    writer.abort()
    assert s3.aborted


def test_a_preflight_failure_is_recorded_line_by_line():
    class Report:
        problems: ClassVar[list[Problem]] = [
            Problem(2, None, "not JSON — fix the line"),
            Problem(5, "r-5", "no body"),
        ]
        file_problems: ClassVar[list[Problem]] = []

    record = failure_record(PreflightError("2 problems", Report()))
    assert record["stage"] == "preflight"
    assert [(e["line"], e["code"]) for e in record["errors"]] == [
        (2, "invalid_request"),
        (5, "invalid_request"),
    ]
    assert "r-5" in record["errors"][1]["message"]


def test_the_batch_task_records_a_mistake_it_fails_without_retries(monkeypatch):
    from airflow_vllm_batch.openai_api.batch_dag import OpenAIBatchOperator
    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
    from airflow_vllm_batch.version_compat import AirflowFailException

    def fail(self, context):
        # As VLLMBatchOperator.execute fails a mistake: in the handling of it, ``from None``
        # (the task log tells it once), so the mistake is the exception's context, not its cause.
        try:
            raise PreflightError("bad file")
        except PreflightError as err:
            raise AirflowFailException(str(err)) from None

    monkeypatch.setattr(VLLMBatchOperator, "execute", fail)
    recorded = []
    monkeypatch.setattr(OpenAIBatchOperator, "record_failure", lambda self, record: recorded.append(record))
    monkeypatch.setattr(OpenAIBatchOperator, "_bind_batch", lambda self, context: None)
    monkeypatch.setattr(OpenAIBatchOperator, "ended_manifest", lambda self: None)
    monkeypatch.setattr(OpenAIBatchOperator, "clear_failure_record", lambda self: None)
    monkeypatch.setattr(OpenAIBatchOperator, "_check_pinned_input", lambda self: None)
    monkeypatch.setattr(OpenAIBatchOperator, "_refuse_media_urls", lambda self: None)
    op = OpenAIBatchOperator(task_id="t", model="m")
    with pytest.raises(AirflowFailException):
        op.execute(
            {
                "dag_run": SimpleNamespace(run_id="x", conf={}),
                "ti": SimpleNamespace(try_number=1, max_tries=0),
            }
        )
    assert [r["errors"][0]["code"] for r in recorded] == ["invalid_file"]
