"""Five runs of the pipeline DAG with different logical dates, at the same time, on one worker.

Overlapping backfill runs must write distinct outputs and all succeed: staging keys,
local results directories and output keys are per run, so nothing is shared. Each
run is a real ``airflow dags test`` process with its own SQLite metadata database
(SQLite allows one writer; a production deployment shares one Postgres), all against
the same SeaweedFS and the same machine's engines.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_vllm_batch.embedded.demo import BUCKET, embedded_env

pytestmark = [pytest.mark.integration, pytest.mark.engine]

DATES = [f"2026-10-0{day}" for day in range(1, 6)]


def test_five_runs_with_different_logical_dates_at_once_write_distinct_complete_outputs(
    embedded, tiny_model, tmp_path
):
    airflow = str(Path(sys.executable).with_name("airflow"))
    template = tmp_path / "home-template"
    env = embedded_env(embedded, tiny_model, template)
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True)

    procs = []
    for date in DATES:
        home = tmp_path / f"home-{date}"
        shutil.copytree(template, home)
        # Spelled out: the airflow.cfg copied from the template names the template's database.
        run_env = {**env, "AIRFLOW_HOME": str(home), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db"}
        log = open(tmp_path / f"{date}.log", "wb")
        conf = json.dumps({"n_requests": 3, "max_tokens": 2})
        argv = [airflow, "dags", "test", "vllm_batch_pipeline", date, "--conf", conf]
        procs.append((date, subprocess.Popen(argv, env=run_env, stdout=log, stderr=subprocess.STDOUT), log))
    for date, proc, log in procs:
        proc.wait(timeout=900)
        log.close()
        assert proc.returncode == 0, (tmp_path / f"{date}.log").read_text(errors="replace")[-3000:]

    client = embedded.client()
    manifests = {}
    for date in DATES:
        log = (tmp_path / f"{date}.log").read_text(errors="replace")
        assert "X-Amz-Signature" not in log and embedded.secret_key not in log
        (output_uri,) = set(re.findall(r"Published (s3://\S+) \(", log))
        key = output_uri.removeprefix(f"s3://{BUCKET}/").removesuffix(".jsonl") + ".manifest.json"
        manifests[date] = json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    assert len({m["output_uri"] for m in manifests.values()}) == len(DATES)  # keys are per run id
    for date, manifest in manifests.items():
        assert manifest["request_counts"] == {"total": 3, "completed": 3, "failed": 0}, date
