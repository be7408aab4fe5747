"""Servers shared by the integration tests: SeaweedFS (real S3), the tiny model, Airflow's DB.

Each is started once per session and stopped by PID at the end. The environment that
points the example DAGs and the engine at them is set before the DAG files are
imported, because the DAGs read their defaults at parse time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from airflow_vllm_batch.engines.vllm.server_process import VLLMServerProcess
from tests.conftest import xdist_worker
from vllm_batch_embedded.demo import BUCKET, CPU_ENGINE_ARGS, CPU_ENGINE_ENV, embedded_env
from vllm_batch_embedded.seaweedfs import SeaweedFS
from vllm_batch_embedded.tiny_model import build_tiny_chat_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny chat model, built once into the repo's cache (shared with ``make demo``)."""
    return build_tiny_chat_model(REPO / ".cache" / "models" / "tiny-llama-chat")


@pytest.fixture(scope="session")
def warm_vllm(tiny_model: Path) -> Iterator[Callable[..., VLLMServerProcess]]:
    """One warm vLLM server (the tiny model, CPU) per distinct set of engine arguments, shared by the session.

    ``warm_vllm(*args)`` returns the server started with ``CPU_ENGINE_ARGS`` plus ``args``,
    starting it on first use (20-60 s); every module that asks for the same arguments gets the
    same server, so its start is paid once per session (per xdist worker). A module that counts
    what the server answered reads ``/metrics`` before and after (``vllm_metrics.py``); one that
    tests the server's start-up, its death or flags of its own starts its own and says why.
    """
    servers: dict[tuple[str, ...], VLLMServerProcess] = {}
    with contextlib.ExitStack() as stack:

        def server(*args: str) -> VLLMServerProcess:
            if args not in servers:
                servers[args] = stack.enter_context(
                    VLLMServerProcess(
                        str(tiny_model),
                        engine_args=[*CPU_ENGINE_ARGS.split(), *args],
                        env={**os.environ, **CPU_ENGINE_ENV},
                        startup_timeout_s=300,
                    )
                )
            return servers[args]

        yield server
    for args, process in servers.items():
        assert process.process is not None, f"the warm vLLM server {args} outlived the session"
        assert process.process.poll() is not None, f"the warm vLLM server {args} outlived the session"


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
    if xdist_worker() is not None:
        # A worker gets whole modules (--dist loadfile) but does not know which: the floor
        # and compose modules prepare on the worker that runs them (their fixtures' wait()
        # starts it), handed out first (tests/conftest.py FIRST) to overlap the other worker.
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
