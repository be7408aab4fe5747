"""Five runs of the pipeline DAG with different logical dates, at the same time, on one worker.

Overlapping backfill runs must write distinct outputs and all succeed: staging keys,
local results directories and output keys are per run, so nothing is shared. Each
run is a real ``airflow dags test`` process with its own SQLite metadata database
(SQLite allows one writer; a production deployment shares one Postgres), all against
the same SeaweedFS and the session's warm vLLM server (``warm_vllm``; a ``vllm`` connection, as a fleet of
workers would share a deployment; five runner engines starting at once on two cores
took ~3 minutes and tested nothing more about the outputs).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.vllm_metrics import requests_answered
from tests.processes import processes_with
from vllm_batch_embedded.demo import (
    BUCKET,
    embedded_env,
)

pytestmark = [pytest.mark.integration, pytest.mark.engine]

DATES = [f"2026-10-0{day}" for day in range(1, 6)]


def test_five_runs_with_different_logical_dates_at_once_write_distinct_complete_outputs(
    embedded, tiny_model, tmp_path, warm_vllm
):
    airflow = str(Path(sys.executable).with_name("airflow"))
    template = tmp_path / "home-template"
    env = embedded_env(embedded, tiny_model, template)
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True)

    server = warm_vllm()  # the session's warm server of the plain CPU flags (conftest)
    assert server.hook is not None
    answered_before = requests_answered(server.hook.base_url)
    host, port = server.hook.base_url.removeprefix("http://").split(":")
    warm = {
        "AIRFLOW_CONN_VLLM_WARM": json.dumps(
            {"conn_type": "vllm", "host": host, "port": int(port), "password": server.hook.api_key}
        ),
        "AIRFLOW_VLLM_BATCH_VLLM_CONN_ID": "vllm_warm",
    }
    procs = []
    for date in DATES:
        home = tmp_path / f"home-{date}"
        shutil.copytree(template, home)
        # Spelled out: the airflow.cfg copied from the template names the template's database.
        run_env = {
            **env,
            **warm,
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        }
        log = open(tmp_path / f"{date}.log", "wb")  # noqa: SIM115 - closed once its process ends, below
        conf = json.dumps({"n_requests": 3, "max_tokens": 2})
        argv = [airflow, "dags", "test", "vllm_batch_pipeline", date, "--conf", conf]
        procs.append((date, subprocess.Popen(argv, env=run_env, stdout=log, stderr=subprocess.STDOUT), log))
    for date, proc, log in procs:
        proc.wait(timeout=900)
        log.close()
        assert proc.returncode == 0, (tmp_path / f"{date}.log").read_text(errors="replace")[-3000:]
    answered = requests_answered(server.hook.base_url) - answered_before
    assert answered == 3 * len(DATES)  # every run went through the one server, each request once

    client = embedded.client()
    manifests = {}
    for date in DATES:
        log = (tmp_path / f"{date}.log").read_text(errors="replace")
        assert "X-Amz-Signature" not in log
        assert embedded.secret_key not in log
        (output_uri,) = set(re.findall(r"Published (s3://\S+) \(", log))
        key = output_uri.removeprefix(f"s3://{BUCKET}/").removesuffix(".jsonl") + ".manifest.json"
        manifests[date] = json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    assert len({m["output_uri"] for m in manifests.values()}) == len(DATES)  # keys are per run id
    for date, manifest in manifests.items():
        assert manifest["request_counts"] == {"total": 3, "completed": 3, "failed": 0}, date


ONE_OUTPUT_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from datetime import datetime, timezone
from airflow.sdk import DAG
from airflow_vllm_batch.engines import VLLMRunner
from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator
from tests.integration.dagrun import register_dag

with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    VLLMBatchOperator(
        task_id="vllm_batch",
        input_uri={input_uri!r},
        output_uri={output_uri!r},
        model={model!r},
        engine=VLLMRunner(args=["--enforce-eager"], env={{"BATCH_TEST_MARKER": {marker!r}}}, output_mode={mode!r}),
    )
register_dag(dag)
print("DAGRUN STATE", dag.test().state, flush=True)
"""


@pytest.mark.parametrize("first_mode", ["local", "presigned"])
def test_a_second_run_on_an_output_in_use_fails_fast_naming_the_first_which_completes(
    embedded, tiny_model, tmp_path, first_mode
):
    import time
    import uuid

    from tests.integration.dagrun import REPO

    second_mode = "presigned" if first_mode == "local" else "local"
    client = embedded.client()
    prefix = f"one-output-{first_mode}"
    lines = "".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": str(tiny_model),
                    "messages": [{"role": "user", "content": f"hi {i}"}],
                    "max_completion_tokens": 4,
                },
            }
        )
        + "\n"
        for i in range(4)
    )
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/input.jsonl", Body=lines.encode())
    template = tmp_path / "home-template"
    env = embedded_env(embedded, tiny_model, template)
    subprocess.run(
        [str(Path(sys.executable).with_name("airflow")), "db", "migrate"],
        env=env,
        check=True,
        capture_output=True,
    )
    marker = uuid.uuid4().hex

    def start(name: str, mode: str) -> tuple[subprocess.Popen, Path]:
        home = tmp_path / f"home-{name}"
        shutil.copytree(template, home)
        script = tmp_path / f"{name}.py"
        script.write_text(
            ONE_OUTPUT_SCRIPT.format(
                repo=str(REPO),
                dag_id=f"one_output_{name}",
                input_uri=f"s3://{BUCKET}/{prefix}/input.jsonl",
                output_uri=f"s3://{BUCKET}/{prefix}/results.jsonl",
                model=str(tiny_model),
                marker=f"{marker}-{name}",
                mode=mode,
            )
        )
        log_path = tmp_path / f"{name}.log"
        run_env = {
            **env,
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        }
        with open(log_path, "wb") as log:
            return subprocess.Popen(
                [sys.executable, str(script)], env=run_env, stdout=log, stderr=subprocess.STDOUT
            ), log_path

    first, first_log = start("first", first_mode)
    deadline = time.monotonic() + 300
    while not processes_with(f"{marker}-first"):
        assert first.poll() is None, first_log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, first_log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)
    second, second_log = start("second", second_mode)
    second.wait(timeout=300)
    second_out = second_log.read_text(errors="replace")
    assert "DAGRUN STATE failed" in second_out
    assert "Another run is writing this output: one_output_first.vllm_batch of run 'manual__" in second_out
    assert not processes_with(f"{marker}-second")
    assert "Starting the vLLM engine" not in second_out
    first.wait(timeout=600)
    first_out = first_log.read_text(errors="replace")
    assert "DAGRUN STATE success" in first_out, first_out[-3000:]
    body = client.get_object(Bucket=BUCKET, Key=f"{prefix}/results.jsonl")["Body"].read().decode()
    assert sorted(json.loads(line)["custom_id"] for line in body.splitlines()) == ["r0", "r1", "r2", "r3"]
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]
    assert sorted(keys) == [
        f"{prefix}/input.jsonl",
        f"{prefix}/results.jsonl",
        f"{prefix}/results.manifest.json",
    ]
