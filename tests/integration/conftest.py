"""Servers shared by the integration tests: SeaweedFS (real S3), the tiny model, Airflow's DB.

Each is started once per session and stopped by PID at the end. The environment that
points the example DAGs and the engine at them is set before the DAG files are
imported, because the DAGs read their defaults at parse time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_batch_embedded.demo import BUCKET, embedded_env
from vllm_batch_embedded.seaweedfs import SeaweedFS
from vllm_batch_embedded.tiny_model import build_tiny_chat_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny chat model, built once into the repo's cache (shared with ``make demo``)."""
    return build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat")


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A real S3 (SeaweedFS) on a free loopback port, with the example bucket."""
    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs")) as s3:
        s3.create_bucket(BUCKET)
        yield s3


@pytest.fixture(scope="session")
def embedded(seaweed: SeaweedFS, tiny_model: Path) -> Iterator[SeaweedFS]:
    """Point Airflow (connection ``aws_default``), the example DAGs and vLLM at the embedded default."""
    saved = dict(os.environ)
    env = embedded_env(seaweed, tiny_model, Path(os.environ["AIRFLOW_HOME"]))
    os.environ.update(env)
    yield seaweed
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def airflow_db(embedded: SeaweedFS) -> None:
    """A fresh metadata database, once per session."""
    from airflow.utils.db import resetdb

    resetdb()
