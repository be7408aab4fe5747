"""Which batch URLs the server engines accept: the server's own routes that the stream can send."""

from __future__ import annotations

import logging

from airflow_vllm_batch.engines.base import EngineInfo
from airflow_vllm_batch.engines.options import VLLMServer, WarmVLLMServer
from airflow_vllm_batch.engines.server import ConnectionEngine, ServerEngine
from airflow_vllm_batch.run.settings import BatchSettings

RUNNER_URLS = frozenset({"/v1/chat/completions", "/v1/embeddings", "/v1/audio/transcriptions"})


def _engine(cls, engine=None):
    settings = BatchSettings.from_rendered(
        input_uri="s3://b/in.jsonl",
        output_uri="s3://b/out/results.jsonl",
        model="m",
        engine=engine or VLLMServer(),
    )
    return cls(settings, logging.getLogger(__name__))


def test_a_started_server_takes_its_routes_from_the_probe_not_from_the_runner():
    info = EngineInfo(
        "0.32.0",
        RUNNER_URLS,
        server_urls=frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models/x", "/tokenize"}),
    )
    assert _engine(ServerEngine).restrict(info).supported_urls == {"/v1/chat/completions", "/v1/completions"}


def test_a_server_whose_routes_could_not_be_read_still_serves_completions_but_not_audio():
    urls = _engine(ServerEngine).restrict(EngineInfo("0.32.0", RUNNER_URLS)).supported_urls
    assert "/v1/completions" in urls
    assert "/v1/audio/transcriptions" not in urls


def test_a_warm_server_behind_a_connection_accepts_completions():
    urls = (
        _engine(ConnectionEngine, WarmVLLMServer(conn_id="c"))
        .restrict(EngineInfo("0.32.0", RUNNER_URLS))
        .supported_urls
    )
    assert {"/v1/chat/completions", "/v1/completions"} <= urls
