"""Media URLs of an API batch's chat lines: workers fetch none but data: URLs and http(s) URLs of allowed hosts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from airflow_vllm_batch.openai_api.batch_dag import OpenAIBatchOperator
from airflow_vllm_batch.openai_api.batch_spec import BatchSpec
from airflow_vllm_batch.openai_api.media import media_domains, media_problems, media_urls, refused_url
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.openai_api import step_engine
from tests.unit.openai_api.conftest import KEY
from tests.unit.openai_api.step_engine import StepEngine
from tests.unit.operators.test_vllm_batch_runs import FakeTI

ALLOWED = frozenset({"images.example.com"})
BATCH = "batch_0123456789abcdef"


def chat(custom_id: str, *parts: dict) -> dict:
    content = [{"type": "text", "text": "describe http://169.254.169.254/ please"}, *parts]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": content}]},
    }


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "https://internal.example.com/a.png",
        "https://images.example.com.evil.org/a.png",
        "file:///etc/passwd",
        "ftp://images.example.com/a.png",
        "//images.example.com/a.png",
    ],
)
def test_a_url_of_a_host_not_allowed_or_of_another_scheme_is_refused(url):
    assert refused_url(url, ALLOWED) is not None
    assert "passwd" not in (refused_url(url, ALLOWED) or "")  # the reason names the host, never the path


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,iVBORw0KGgo=",
        "https://images.example.com/a.png",
        "HTTP://Images.Example.COM./b",
    ],
)
def test_data_urls_and_allowed_hosts_are_accepted(url):
    assert refused_url(url, ALLOWED) is None


def test_every_media_part_form_is_found_and_text_is_not():
    body = chat(
        "x",
        image("https://a/1"),
        {"type": "audio_url", "audio_url": {"url": "https://a/2"}},
        {"type": "video_url", "video_url": {"url": "https://a/3"}},
        {"image_url": "https://a/4"},  # vLLM's short form
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    )["body"]
    assert list(media_urls(body)) == ["https://a/1", "https://a/2", "https://a/3", "https://a/4"]


def test_the_refused_lines_are_named_by_number_and_the_others_pass():
    lines = [
        json.dumps(chat("ok", image("data:image/png;base64,AAAA"))).encode(),
        b"",
        json.dumps(chat("bad", image("http://10.0.0.1/x?token=secret"))).encode(),
        json.dumps(chat("allowed", image("https://images.example.com/a.png"))).encode(),
        b'not json url"',
    ]
    count, errors = media_problems(lines, ALLOWED)
    assert count == 1
    (error,) = errors
    assert error["line"] == 3
    assert error["param"] == "body.messages"
    assert "'10.0.0.1'" in error["message"]
    assert "openai_media_domains" in error["message"]
    assert "secret" not in error["message"]


def test_lines_of_plain_chat_are_not_parsed_and_every_media_form_is(monkeypatch):
    """Every line names its endpoint url once: only a line with a media key besides is parsed."""
    import airflow_vllm_batch.openai_api.media as media

    parsed: list[bytes] = []
    real_loads = json.loads
    monkeypatch.setattr(media.json, "loads", lambda raw: parsed.append(raw) or real_loads(raw))
    plain = chat("plain")
    plain["body"]["messages"][0]["content"][0]["text"] = 'a prompt that says "the url" and url" in quotes'
    short = chat("short", {"type": "image_url", "image_url": "http://10.0.0.1/a.png"})
    lines = [json.dumps(plain).encode(), json.dumps(chat("image", image("http://10.0.0.1/x"))).encode()]
    lines.append(json.dumps(short).encode())
    count, _ = media_problems(lines, ALLOWED)
    assert count == 2
    assert parsed == lines[1:]


def test_the_allowed_hosts_are_read_from_the_option(monkeypatch):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MEDIA_DOMAINS", " Images.Example.com, cdn.example.com ,")
    assert media_domains() == {"images.example.com", "cdn.example.com"}
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__OPENAI_MEDIA_DOMAINS")
    assert media_domains() == frozenset()


def run(s3, bucket, tmp_path, lines: list[dict]):
    client = s3.client()
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    version = client.put_object(Bucket=bucket, Key=f"batches/{BATCH}.input.jsonl", Body=body)["ETag"].strip(
        '"'
    )
    spec = BatchSpec(
        batch_id=BATCH,
        dag_id="vllm_batch_openai",
        owner="u",
        input_file_id="file-0123456789in",
        input_version=version,
        endpoint="/v1/chat/completions",
        route="",
        created_at=2_000_000_000,
        window_s=86400,
    )
    operator = OpenAIBatchOperator(
        task_id="vllm_batch", model="m", engine=StepEngine(), results_dir=str(tmp_path / "results")
    )
    context = {
        "ti": FakeTI(try_number=1, run_id=BATCH),
        "outlet_events": {},
        "dag_run": SimpleNamespace(run_id=BATCH, dag_id="vllm_batch_openai", conf=spec.sign(KEY)),
    }
    return operator.execute(context)


@pytest.fixture
def api_files(bucket, monkeypatch):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_FILES_URI", f"s3://{bucket}/")
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MEDIA_DOMAINS", "images.example.com")
    monkeypatch.setattr(step_engine, "AFTER_ANSWER", None)
    step_engine.PRODUCED.clear()


def test_a_batch_naming_a_media_url_not_allowed_fails_before_any_engine_naming_its_line(
    s3, bucket, tmp_path, api_files
):
    lines = [
        chat("a", image("https://images.example.com/a.png")),
        chat("b", image("http://169.254.169.254/x")),
    ]
    with pytest.raises(
        AirflowFailException, match=r"1 line\(s\) of the batch name a media URL .* \(lines 2\)"
    ) as err:
        run(s3, bucket, tmp_path, lines)
    assert "169.254" not in str(err.value)  # the task log, which every API user may read, names no host
    assert step_engine.PRODUCED == []
    record = json.loads(
        s3.client().get_object(Bucket=bucket, Key=f"batches/{BATCH}.failure.json")["Body"].read()
    )
    assert record["stage"] == "preflight"
    assert [(e["line"], e["param"]) for e in record["errors"]] == [(2, "body.messages")]
    assert "'169.254.169.254'" in record["errors"][0]["message"]


def test_a_batch_whose_media_urls_are_allowed_runs(s3, bucket, tmp_path, api_files):
    lines = [
        chat("a", image("https://images.example.com/a.png")),
        chat("b", image("data:image/png;base64,AAAA")),
    ]
    manifest = run(s3, bucket, tmp_path, lines)
    assert manifest["request_counts"]["completed"] == 2
    assert step_engine.PRODUCED == [1]
