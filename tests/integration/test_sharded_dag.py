"""Sharded batches end to end: real SeaweedFS, real vLLM (CPU), ``dag.test()``.

Every shard is one engine start (~30 s on this CPU), so the runs here are few and
small: the sharded example DAG with 3 shards, run once with the middle shard's engine
SIGKILLed and once more for the same run id; and one embeddings DAG that runs 2
shards and the same texts unsharded.

Fresh processes: each shard's pooling runner is its task's own child process.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from datetime import datetime, timezone

import numpy as np
import psutil
import pytest

from airflow_vllm_batch.engines import VLLMRunner
from tests.integration.dagrun import DagRunResult, error_lines, load_dag, register_dag, run_dag
from vllm_batch_embedded.demo import BUCKET

pytestmark = [pytest.mark.integration, pytest.mark.engine]

N_REQUESTS = 30
SHARD_SIZE = 10
KILLED_SHARD = 1
RUN_CONF = {"n_requests": N_REQUESTS, "shard_size": SHARD_SIZE, "max_tokens": 4}
LOGICAL_DATE = datetime(2026, 3, 1, tzinfo=timezone.utc)
ENGINE_STARTED = "Starting the vLLM engine"
RESUMED = "Not running the engine again"


class ShardEngineKiller(threading.Thread):
    """SIGKILLs the engine process group of one shard a few seconds after it starts, once."""

    def __init__(self, shard_file: str, after_s: float = 5.0, timeout_s: float = 900.0) -> None:
        super().__init__(daemon=True)
        self.shard_file = shard_file
        self.after_s = after_s
        self.timeout_s = timeout_s
        self.killed_pid: int | None = None
        self._done = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._done.is_set() and time.monotonic() < deadline:
            proc = self._find_engine()
            if proc is not None:
                time.sleep(self.after_s)
                if proc.is_running():
                    # The operator starts the engine as the leader of its own group.
                    os.killpg(proc.pid, signal.SIGKILL)
                    self.killed_pid = proc.pid
                return
            time.sleep(0.2)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)

    def _find_engine(self) -> psutil.Process | None:
        for proc in psutil.Process().children(recursive=True):
            try:
                # The operator passes the engine's arguments (presigned URLs naming the
                # shard) in its environment rather than on its command line.
                seen = " ".join(proc.cmdline()) + " " + " ".join(proc.environ().values())
            except psutil.Error:
                continue
            if "run_batch" in seen and self.shard_file in seen:
                return proc
        return None


class SameRunId:
    """A DAG whose ``test()`` always makes the same run id, so that a second run redoes the first.

    ``dag.test()`` names a manual run after its ``run_after`` (default: now); fixing it
    (with the logical date) makes the second ``dag.test()`` replace the first run under
    the same run id, as clearing the run in the UI would.
    """

    def __init__(self, dag, when: datetime) -> None:
        self._dag = dag
        self._when = when

    def test(self, **kwargs):
        return self._dag.test(run_after=self._when, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._dag, name)


def _mapped_states(run: DagRunResult, task_id: str, dag_id: str = "vllm_batch_sharded") -> dict[int, str]:
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        tis = session.scalars(
            # By DAG too: another test's DAG may have a run of the same (fixed) run id.
            select(TaskInstance).where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run.run_id,
                TaskInstance.task_id == task_id,
            )
        ).all()
        return {ti.map_index: str(ti.state) for ti in tis}


def _mapped_xcoms(dag_id: str, run_id: str, task_id: str) -> dict[int, dict]:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(
            XComModel.get_many(
                run_id=run_id, dag_ids=dag_id, task_ids=task_id, key="return_value", map_indexes=None
            )
        ).all()
        return {row.map_index: _json(row.value) for row in rows}


def _json(value):
    return json.loads(value) if isinstance(value, (str, bytes)) else value


def _s3_bytes(seaweed, uri: str) -> bytes:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return seaweed.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def _s3_lines(seaweed, uri: str) -> list[dict]:
    return [json.loads(line) for line in _s3_bytes(seaweed, uri).splitlines() if line.strip()]


def _exists(seaweed, uri: str) -> bool:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bool(seaweed.client().list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount"))


def _shard_uri(run_id: str, index: int, suffix: str) -> str:
    from vllm_batch_examples import key_safe

    return f"s3://{BUCKET}/vllm-batch/vllm_batch_sharded/{key_safe(run_id)}/shards/shard-{index:05d}{suffix}"


@pytest.fixture(scope="module")
def killed_then_rerun(embedded, airflow_db) -> tuple[DagRunResult, DagRunResult, dict]:
    """Run the sharded DAG with one shard's engine killed, then run it again for the same run id."""
    dag = SameRunId(load_dag("vllm_batch_sharded.py", "sharded_dag"), LOGICAL_DATE)
    killer = ShardEngineKiller(f"shard-{KILLED_SHARD:05d}.jsonl")
    killer.start()
    try:
        first = run_dag(dag, run_conf=RUN_CONF, logical_date=LOGICAL_DATE)
    finally:
        killer.stop()
    after_first = {
        "states": _mapped_states(first, "vllm_batch"),
        "manifests": {
            i: _exists(embedded, _shard_uri(first.run_id, i, ".results.manifest.json")) for i in range(3)
        },
        "killed_pid": killer.killed_pid,
    }
    second = run_dag(dag, run_conf=RUN_CONF, logical_date=LOGICAL_DATE)
    return first, second, after_first


def test_killed_shard_fails_the_run_while_the_other_shards_complete(killed_then_rerun):
    first, _, after_first = killed_then_rerun
    assert after_first["killed_pid"] is not None, "the shard's engine was never seen running"
    assert first.state == "failed"
    assert "killed by signal 9" in first.output
    assert after_first["states"] == {0: "success", KILLED_SHARD: "failed", 2: "success"}
    assert after_first["manifests"] == {0: True, KILLED_SHARD: False, 2: True}
    assert first.task_states["merge"] == "upstream_failed"


def test_rerun_for_the_same_run_id_starts_an_engine_only_for_the_killed_shard(killed_then_rerun):
    first, second, _ = killed_then_rerun
    assert second.run_id == first.run_id
    assert second.state == "success", second.output[-5000:]
    assert first.output.count(ENGINE_STARTED) == 3
    assert second.output.count(ENGINE_STARTED) == 1
    assert second.output.count(RESUMED) == 2
    assert "already in s3://" in second.output  # the split kept the shards (and their ETags)


def test_rerun_returns_the_complete_shards_manifests_unchanged(killed_then_rerun, seaweed):
    _, second, _ = killed_then_rerun
    manifests = _mapped_xcoms("vllm_batch_sharded", second.run_id, "vllm_batch")
    assert sorted(manifests) == [0, 1, 2]
    for index, manifest in manifests.items():
        stored = json.loads(_s3_bytes(seaweed, manifest["manifest_uri"]))
        assert manifest == stored
        assert manifest["input_uri"] == _shard_uri(second.run_id, index, ".jsonl")
        assert manifest["request_counts"] == {"total": SHARD_SIZE, "completed": SHARD_SIZE, "failed": 0}


def test_merged_output_answers_every_input_id_once_in_input_order(killed_then_rerun, seaweed):
    _, second, _ = killed_then_rerun
    merged = second.xcom("merge")
    lines = _s3_lines(seaweed, merged["output_uri"])
    assert [line["custom_id"] for line in lines] == [f"request-{i}" for i in range(N_REQUESTS)]
    assert all(line["response"]["status_code"] == 200 for line in lines)
    assert second.xcom("validate")["request_counts"] == {
        "total": N_REQUESTS,
        "completed": N_REQUESTS,
        "failed": 0,
    }


def test_merged_output_is_the_shard_outputs_byte_for_byte(killed_then_rerun, seaweed):
    _, second, _ = killed_then_rerun
    merged = second.xcom("merge")
    shards = [_s3_bytes(seaweed, _shard_uri(second.run_id, i, ".results.jsonl")) for i in range(3)]
    # Each shard's lines, newline-terminated whether or not its file ended with one.
    assert _s3_bytes(seaweed, merged["output_uri"]) == b"".join(
        s if s.endswith(b"\n") else s + b"\n" for s in shards
    )


def test_merged_manifest_sums_the_shards_and_is_written_beside_the_output(killed_then_rerun, seaweed):
    _, second, _ = killed_then_rerun
    merged = second.xcom("merge")
    shards = _mapped_xcoms("vllm_batch_sharded", second.run_id, "vllm_batch")
    assert merged["request_counts"] == {"total": N_REQUESTS, "completed": N_REQUESTS, "failed": 0}
    assert merged["usage"]["completion_tokens"] == sum(
        m["usage"]["completion_tokens"] for m in shards.values()
    )
    assert merged["shards"] == 3
    assert merged["error_uri"] is None
    assert merged["shard_manifest_uris"] == [shards[i]["manifest_uri"] for i in range(3)]
    assert merged["manifest_uri"] == merged["output_uri"].removesuffix(".jsonl") + ".manifest.json"
    assert json.loads(_s3_bytes(seaweed, merged["manifest_uri"])) == merged


# -- embeddings: sharded equals unsharded ------------------------------------------


N_TEXTS = 6


@pytest.fixture(scope="module")
def embeddings_sharded_and_whole(embedded, airflow_db) -> DagRunResult:
    """One DAG: the same texts embedded in 2 shards (split, map, merge) and in one run."""
    import vllm_batch_examples as examples
    from airflow.sdk import DAG

    from airflow_vllm_batch.operators.shards import (
        VLLMBatchMergeOperator,
        VLLMBatchSplitOperator,
    )
    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
    from vllm_batch_embedded.tiny_model import embedding_model_path

    model = str(embedding_model_path())
    embedded.client().put_object(
        Bucket=BUCKET, Key="embed-shards/input.jsonl", Body=examples.embedding_requests(N_TEXTS, model)
    )
    common = {"model": model, "engine": VLLMRunner(args=["--runner", "pooling", "--enforce-eager"])}
    with DAG(
        "sharded_embeddings", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)
    ) as dag:
        split = VLLMBatchSplitOperator(
            task_id="split",
            input_uri=f"s3://{BUCKET}/embed-shards/input.jsonl",
            shard_prefix=f"s3://{BUCKET}/embed-shards/shards",
            max_requests=N_TEXTS // 2,
        )
        mapped = VLLMBatchOperator.partial(task_id="embed", **common).expand_kwargs(split.output)
        VLLMBatchMergeOperator(
            task_id="merge",
            shard_manifests=mapped.output,
            output_uri=f"s3://{BUCKET}/embed-shards/sharded.jsonl",
        )
        VLLMBatchOperator(
            task_id="whole",
            input_uri=f"s3://{BUCKET}/embed-shards/input.jsonl",
            output_uri=f"s3://{BUCKET}/embed-shards/whole.jsonl",
            **common,
        )
    register_dag(dag)
    return run_dag(dag)


def test_a_successful_sharded_run_logs_no_line_at_error_level(embeddings_sharded_and_whole):
    assert embeddings_sharded_and_whole.state == "success", embeddings_sharded_and_whole.output[-4000:]
    assert error_lines(embeddings_sharded_and_whole.output) == []  # split, shards, merge and the whole run


def _vectors(seaweed, uri: str) -> dict[str, np.ndarray]:
    return {
        line["custom_id"]: np.asarray(line["response"]["body"]["data"][0]["embedding"])
        for line in _s3_lines(seaweed, uri)
    }


def test_every_vector_of_a_sharded_embedding_run_matches_the_unsharded_run(
    embeddings_sharded_and_whole, seaweed
):
    run = embeddings_sharded_and_whole
    assert run.state == "success", run.output[-5000:]
    assert run.xcom("merge")["shards"] == 2
    sharded = _vectors(seaweed, run.xcom("merge")["output_uri"])
    whole = _vectors(seaweed, run.xcom("whole")["output_uri"])
    assert list(sharded) == [f"embed-{i}" for i in range(N_TEXTS)]
    assert sorted(whole) == sorted(sharded)
    for custom_id, vector in sharded.items():
        other = whole[custom_id]
        cosine = float(vector @ other / (np.linalg.norm(vector) * np.linalg.norm(other)))
        assert vector.shape == (384,)
        assert cosine > 0.999, custom_id
