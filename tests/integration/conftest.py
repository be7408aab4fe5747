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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start what selected tests need that takes minutes in the background, from now.

    The compose test's images (run last) and the floor's venv, wheel and unit run
    (``floor_venv.py``): both mostly wait on the network, pip and the disk, so they overlap
    the rest of the suite instead of adding to it.
    """
    if config.option.collectonly:
        return
    if any(item.get_closest_marker("floor") for item in items):
        from tests.integration.floor_venv import FLOOR

        FLOOR.start()
    compose = [item for item in items if item.get_closest_marker("compose")]
    if not compose:
        return
    items[:] = [item for item in items if not item.get_closest_marker("compose")] + compose
    from tests.integration.compose_stack import IMAGES

    IMAGES.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop a dockerd the compose test started and a floor run still going, also when the session ended early."""
    from tests.integration.compose_stack import IMAGES
    from tests.integration.floor_venv import FLOOR

    IMAGES.close()
    FLOOR.close()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The compose test's phases and their durations, when it ran."""
    from tests.integration.compose_stack import IMAGES

    if IMAGES.timings:
        terminalreporter.write_sep("-", "compose stack: seconds per phase")
        for phase, seconds in IMAGES.timings.items():
            terminalreporter.write_line(f"{seconds:8.1f}  {phase}")
