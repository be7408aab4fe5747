"""The dead-engine reports the runner engine reads, checked against vLLM itself.

vLLM 0.32 (installed): the line its runner writes for a request the dead engine failed is
made here with vLLM's own ``create_error_response`` and ``BatchRequestOutput``, as its
``run_request`` makes it, and must read as a dead engine's. vLLM 0.33 (CUDA only: its venv, ``make vllm033``,
is read, never run): its sources must still have the type, messages and behaviour
:mod:`airflow_vllm_batch.engines.runner_deaths` relies on.

Fresh processes: a runner's ``EngineCore`` is killed mid-run.
"""

from __future__ import annotations

import uuid

import pytest

from airflow_vllm_batch.engines import VLLMRunner
from airflow_vllm_batch.engines.runner_deaths import (
    DEAD_ENGINE_ERROR,
    ENGINE_DEAD_CLIENT_MESSAGE,
    ENGINE_DEAD_MESSAGE,
    is_engine_dead_line,
)
from tests.vllm033 import VLLM033

pytestmark = pytest.mark.vllm


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
def vllm_033():
    """vLLM 0.33's installed sources (tests/vllm033.py: its venv, built in the background under `make test`)."""
    return VLLM033


@pytest.mark.vllm033
def test_vllm_0_33s_dead_engine_error_keeps_its_type_and_messages(vllm_033):
    source = vllm_033.source("v1/engine/exceptions.py")
    assert f"class {DEAD_ENGINE_ERROR}(" in source
    assert ENGINE_DEAD_MESSAGE.split(". ")[0] in source
    assert ENGINE_DEAD_CLIENT_MESSAGE in source


@pytest.mark.vllm033
def test_vllm_0_33s_runner_dies_on_a_dead_engine_writes_in_order_and_takes_max_inflight(vllm_033):
    source = vllm_033.source("entrypoints/launchers/run_batch.py")
    assert "raise engine_client.dead_error" in source  # exits non-zero rather than writing 500s
    assert "print(finished.pop(next_index), file=output_file)" in source  # input order, as it goes
    assert "max_inflight: int | None = None" in source  # --max-inflight


#: Starts vLLM 0.32's real runner and, on its first start only, SIGKILLs its EngineCore child
#: once the batch is running (as the kernel's OOM killer would): the runner itself lives on.
KILL_ENGINE_CORE_ONCE = """
import os, signal, subprocess, sys
import psutil
flag = os.environ["KILL_ENGINE_CORE_FLAG"]
proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.launchers.run_batch", *sys.argv[1:]],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
for raw in proc.stdout:
    sys.stdout.buffer.write(raw)
    sys.stdout.flush()
    if b"Running batch" in raw and not os.path.exists(flag):
        open(flag, "w").close()
        children = psutil.Process(proc.pid).children(recursive=True)
        cores = [c for c in children if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline())]
        for child in cores or children:
            child.send_signal(signal.SIGKILL)
sys.exit(proc.wait())
"""


@pytest.mark.integration
@pytest.mark.engine
def test_a_real_engine_core_killed_mid_run_is_read_as_a_death_and_the_batch_completes(
    embedded, airflow_db, tiny_model, tmp_path
):
    import sys

    from tests.integration.test_faults import _chat_lines, _run
    from vllm_batch_embedded.demo import BUCKET as DEMO_BUCKET

    model = str(tiny_model)
    prefix = f"core-killed-{uuid.uuid4().hex[:8]}"
    embedded.client().put_object(
        Bucket=DEMO_BUCKET, Key=f"{prefix}/input.jsonl", Body=_chat_lines(model, 12).encode()
    )
    wrapper = tmp_path / "kill_engine_core_once.py"
    wrapper.write_text(KILL_ENGINE_CORE_ONCE)
    flag = tmp_path / "killed"
    result = _run(
        "core_killed",
        input_uri=f"s3://{DEMO_BUCKET}/{prefix}/input.jsonl",
        output_uri=f"s3://{DEMO_BUCKET}/{prefix}/results.jsonl",
        model=model,
        engine=VLLMRunner(
            command=[sys.executable, str(wrapper)],
            args=["--enforce-eager"],
            env={"KILL_ENGINE_CORE_FLAG": str(flag)},
        ),
    )
    assert flag.exists(), "the wrapper never saw the batch running"
    # vLLM 0.32 exits 0, the requests it had left answered with EngineDeadError's message.
    assert "The vLLM engine died (exited 0)" in result.output, result.output[-3000:]
    assert "alone, one at a time (--max-num-seqs 1)" in result.output
    assert result.state == "success", result.output[-3000:]
    assert result.xcom("vllm_batch")["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
