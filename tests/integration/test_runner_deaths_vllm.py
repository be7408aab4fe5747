"""The dead-engine reports the runner engine reads, checked against vLLM itself.

vLLM 0.32 (installed): the line its runner writes for a request the dead engine failed is
made here with vLLM's own ``create_error_response`` and ``BatchRequestOutput``, as its
``run_request`` makes it, and must read as a dead engine's. vLLM 0.33 (CUDA only, never
installed here): its wheel's sources must still have the type, messages and behaviour
:mod:`airflow_vllm_batch.engines.runner_deaths` relies on.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from airflow_vllm_batch.engines.runner_deaths import (
    DEAD_ENGINE_ERROR,
    ENGINE_DEAD_CLIENT_MESSAGE,
    ENGINE_DEAD_MESSAGE,
    is_engine_dead_line,
)

pytestmark = pytest.mark.vllm

#: Where the 0.33.0 wheel was downloaded (``pip download --no-deps vllm==0.33.0``).
VLLM_033_WHEEL = Path("/work/vllm033/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl")


def test_vllm_0_32s_runner_line_for_a_dead_engine_reads_as_one_and_a_plain_500_does_not():
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput, BatchResponseData
    from vllm.entrypoints.serve import create_error_response
    from vllm.v1.engine.exceptions import EngineDeadError

    def line(exc: Exception) -> bytes:
        response = create_error_response(exc)
        out = BatchRequestOutput(
            id="vllm-x",
            custom_id="r0",
            response=BatchResponseData(status_code=response.error.code, request_id="vllm-batch-x"),
            error=response,
        )
        return out.model_dump_json().encode()

    assert type(EngineDeadError()).__name__ == DEAD_ENGINE_ERROR
    assert str(EngineDeadError()) == ENGINE_DEAD_MESSAGE
    assert is_engine_dead_line(line(EngineDeadError()), died=False)
    assert not is_engine_dead_line(line(RuntimeError("EngineCore busy")), died=False)


@pytest.fixture(scope="module")
def wheel_033() -> zipfile.ZipFile:
    if not VLLM_033_WHEEL.exists():
        pytest.skip(f"vLLM 0.33.0's wheel is not at {VLLM_033_WHEEL} (pip download --no-deps vllm==0.33.0)")
    with zipfile.ZipFile(VLLM_033_WHEEL) as wheel:
        yield wheel


def test_vllm_0_33s_dead_engine_error_keeps_its_type_and_messages(wheel_033):
    source = wheel_033.read("vllm/v1/engine/exceptions.py").decode()
    assert f"class {DEAD_ENGINE_ERROR}(" in source
    assert ENGINE_DEAD_MESSAGE.split(". ")[0] in source and ENGINE_DEAD_CLIENT_MESSAGE in source


def test_vllm_0_33s_runner_dies_on_a_dead_engine_writes_in_order_and_takes_max_inflight(wheel_033):
    source = wheel_033.read("vllm/entrypoints/launchers/run_batch.py").decode()
    assert "raise engine_client.dead_error" in source  # exits non-zero rather than writing 500s
    assert "print(finished.pop(next_index), file=output_file)" in source  # input order, as it goes
    assert "max_inflight: int | None = None" in source  # --max-inflight
