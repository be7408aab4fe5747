"""``make demo``: the pipeline DAG end to end on the embedded default.

Builds the tiny local chat model (once), starts SeaweedFS on 127.0.0.1 with
generated keys, runs ``airflow dags test vllm_batch_pipeline`` against a throw-away
SQLite Airflow home, prints the manifest as one JSON line and the first result
lines, and stops SeaweedFS by PID — also when something fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from vllm_batch_embedded.seaweedfs import SeaweedFS
from vllm_batch_embedded.sqlite_db import SQLITE_CONNECT_ARGS_ENV
from vllm_batch_embedded.tiny_model import build_tiny_chat_model

REPO = Path(__file__).resolve().parents[1]
BUCKET = "vllm-batch"

#: What vLLM needs to start quickly on a CPU with the tiny model, and offline.
CPU_ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# No --max-model-len: it must fit each model (all-MiniLM allows 256), and both defaults fit in 1 GiB of KV cache.
CPU_ENGINE_ARGS = "--enforce-eager"


def embedded_env(
    s3: SeaweedFS,
    chat_model: Path,
    airflow_home: Path,
    base: Mapping[str, str] | None = None,
    database_url: str | None = None,
) -> dict[str, str]:
    """Return the environment that points Airflow, the example DAGs and vLLM at the embedded default.

    :param s3: a running SeaweedFS.
    :param chat_model: directory of the tiny chat model.
    :param airflow_home: a directory for Airflow's logs and, by default, its SQLite database;
        made if missing.
    :param base: the environment to extend. Default: this process's.
    :param database_url: Airflow's metadata database instead of SQLite in ``airflow_home``
        (a PostgreSQL URL, say). SQLite's connect arguments are set only for SQLite.
    """
    # Airflow 3.0 opens SQLite in AIRFLOW_HOME without making the directory (3.1 makes it).
    airflow_home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if base is None else base)
    env.update(CPU_ENGINE_ENV)
    env.update(
        {
            "AIRFLOW_HOME": str(airflow_home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW_CONN_AWS_DEFAULT": s3.airflow_connection_json(),
            "AIRFLOW_VLLM_BATCH_BUCKET": BUCKET,
            "AIRFLOW_VLLM_BATCH_CHAT_MODEL": str(chat_model),
            "AIRFLOW_VLLM_BATCH_ENGINE_ARGS": CPU_ENGINE_ARGS,
            # The embedded default is no part of the provider's wheel: the processes Airflow
            # starts import it (SQLite's connect arguments) from the clone, whatever their cwd.
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
        }
    )
    if database_url is None:
        env.update(SQLITE_CONNECT_ARGS_ENV)
    else:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = database_url
        # Also when inherited from ``base`` (an environment made by this function before).
        for name in SQLITE_CONNECT_ARGS_ENV:
            env.pop(name, None)
    return env


def latest_manifest(s3: SeaweedFS, dag_id: str) -> dict:
    """Return the newest manifest the DAG's runs wrote to the demo bucket."""
    client = s3.client()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"vllm-batch/{dag_id}/").get("Contents", [])
    manifests = sorted(
        (o for o in listed if o["Key"].endswith(".manifest.json")), key=lambda o: o["LastModified"]
    )
    if not manifests:
        raise SystemExit(
            f"No manifest under s3://{BUCKET}/vllm-batch/{dag_id}/: the DAG run did not publish."
        )
    return json.loads(client.get_object(Bucket=BUCKET, Key=manifests[-1]["Key"])["Body"].read())


def main() -> int:
    """Run the demo; return the process exit code."""
    cache = REPO / ".cache"
    started = time.monotonic()
    chat_model = build_tiny_chat_model(cache / "models" / "tiny-llama-chat")
    airflow_home = cache / "demo" / "airflow"
    airflow_home.mkdir(parents=True, exist_ok=True)
    airflow = str(Path(sys.executable).with_name("airflow"))
    with SeaweedFS(cache / "demo" / "s3") as s3:
        s3.create_bucket(BUCKET)
        env = embedded_env(s3, chat_model, airflow_home)
        subprocess.run([airflow, "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL)
        subprocess.run([airflow, "dags", "test", "vllm_batch_pipeline"], env=env, check=True)
        manifest = latest_manifest(s3, "vllm_batch_pipeline")
        bucket, _, key = manifest["output_uri"].removeprefix("s3://").partition("/")
        body = s3.client().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    print("\n=== manifest ===")
    print(json.dumps(manifest))
    print("=== first results ===")
    for line in body.splitlines()[:3]:
        print(line)
    print(f"=== demo finished in {time.monotonic() - started:.0f}s ===")
    return 0


if __name__ == "__main__":
    sys.exit(main())
