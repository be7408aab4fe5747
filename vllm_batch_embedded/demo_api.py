"""``make demo-api``: the OpenAI Files and Batches API on the embedded default, driven by the OpenAI SDK.

Builds the tiny local chat model (once), starts SeaweedFS on 127.0.0.1 with generated keys,
and an Airflow deployment beside it (:func:`~vllm_batch_embedded.airflow_deployment.local_executor_deployment`:
``airflow api-server`` with the provider's plugin, ``airflow scheduler`` with the
LocalExecutor, ``airflow dag-processor``; SQLite in a fresh ``.cache/demo-api/airflow``)
whose DAGs folder holds only the batch DAG, ``dags/vllm_batch_openai.py``. Every process
gets the same settings (``openai_files_uri``, a signing key generated for this run) and the
simple auth manager's users ``admin`` and ``demo`` (role ``user``: may create batches).

Then it does what a user of the API does, with the unmodified ``openai`` SDK: gets
``demo``'s token from ``POST /auth/token``, uploads a batch file, creates a batch, polls it
until it ends, downloads its output file and prints the output's lines, last. It stops
every process it started (the deployment with its task and engine processes, SeaweedFS)
when it ends, fails, or is stopped with Ctrl-C or SIGTERM. No token, key or password is
printed.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING

from vllm_batch_embedded.airflow_deployment import (
    Deployment,
    DeploymentError,
    local_executor_deployment,
    wait_until,
)
from vllm_batch_embedded.demo import REPO
from vllm_batch_embedded.seaweedfs import SeaweedFS
from vllm_batch_embedded.tiny_model import build_tiny_chat_model

if TYPE_CHECKING:
    from openai.types import Batch

#: The bucket and prefix the API keeps files in (``openai_files_uri``).
BUCKET = "openai"
FILES_URI = f"s3://{BUCKET}/api/"
#: The user the SDK acts as (the simple auth manager's role ``user`` may trigger the batch DAG).
USER = "demo"
N_REQUESTS = 4
#: One engine start on a busy laptop, after the scheduler's own pace: generous.
BATCH_TIMEOUT_S = 600
ENDED = ("completed", "failed", "expired", "cancelled")


def batch_lines(model: str, n: int = N_REQUESTS) -> bytes:
    """The batch input file: ``n`` chat requests to ``model``, one JSON object per line.

    :param model: what every line's ``body.model`` names: the batch DAG's model.
    :param n: how many requests.
    """
    return b"".join(
        json.dumps(
            {
                "custom_id": f"request-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"Count to {i + 1}."}],
                    "max_completion_tokens": 8,
                    "temperature": 0,
                },
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


def _stop(signum: int, frame: FrameType | None) -> None:
    """Unwind to the context managers that stop every process, and let no second signal cut that short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"Stopping ({signal.Signals(signum).name}): every process this demo started.", file=sys.stderr)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def run_a_batch(dep: Deployment, model: str) -> tuple[Batch, str]:
    """Do what an OpenAI SDK client does: upload, create a batch, poll it until it ends, download its output.

    :param dep: the running deployment, logged in as :data:`USER`.
    :param model: the batch DAG's model, which every line names.
    :return: the ended batch, and its output file's text (empty unless it completed).
    """
    from openai import OpenAI

    from airflow_vllm_batch.openai_api.settings import DEFAULT_BATCH_DAG_ID, URL_PREFIX

    base_url = dep.api_url + URL_PREFIX
    print(f"The OpenAI API is at {base_url}; the SDK's api_key is {USER!r}'s Airflow API token", flush=True)
    client = OpenAI(base_url=base_url, api_key=dep.token, max_retries=2, timeout=60)
    uploaded = client.files.create(file=("requests.jsonl", batch_lines(model)), purpose="batch")
    print(f"client.files.create: {uploaded.id} ({uploaded.bytes} bytes)", flush=True)
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    print(f"client.batches.create: {batch.id} {batch.status}", flush=True)
    seen = [batch.status]

    def ended() -> Batch | None:
        current = client.batches.retrieve(batch.id)
        if current.status != seen[-1]:
            seen.append(current.status)
            print(f"client.batches.retrieve: {batch.id} {current.status}", flush=True)
        return current if current.status in ENDED else None

    try:
        final: Batch = wait_until(f"batch {batch.id} to end", ended, BATCH_TIMEOUT_S, dep, interval=2)
    except DeploymentError:
        print(dep.diagnose(DEFAULT_BATCH_DAG_ID, batch.id, "vllm_batch"), file=sys.stderr)
        raise
    if final.status != "completed" or not final.output_file_id:
        print(dep.diagnose(DEFAULT_BATCH_DAG_ID, batch.id, "vllm_batch"), file=sys.stderr)
        return final, ""
    counts = final.request_counts
    if counts is not None:
        print(f"request_counts: {counts.completed} completed, {counts.failed} failed, of {counts.total}")
    return final, client.files.content(final.output_file_id).text


def main() -> int:
    """Run the demo; return the process exit code."""
    from airflow_vllm_batch.openai_api.settings import DEFAULT_BATCH_DAG_ID

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)
    started = time.monotonic()
    cache = REPO / ".cache"
    chat_model = build_tiny_chat_model(cache / "models" / "tiny-llama-chat")
    demo_dir = cache / "demo-api"
    # A fresh deployment each time: no batches, users or runs of an earlier demo.
    shutil.rmtree(demo_dir, ignore_errors=True)
    home = demo_dir / "airflow"
    home.mkdir(parents=True)
    settings = {
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"admin:admin,{USER}:user",
        "AIRFLOW__VLLM_BATCH__OPENAI_FILES_URI": FILES_URI,
        # One environment for every process: the API server signs with the key the task checks.
        "AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY": secrets.token_hex(32),
    }
    dag_files = {"vllm_batch_openai.py": (REPO / "dags" / "vllm_batch_openai.py").read_text()}
    with SeaweedFS(demo_dir / "s3") as s3:
        s3.create_bucket(BUCKET)
        print(f"Starting Airflow (api-server, scheduler, dag-processor); logs in {home}", flush=True)
        with local_executor_deployment(s3, chat_model, home, dag_files, extra_env=settings) as dep:
            dep.wait_for_dag(DEFAULT_BATCH_DAG_ID)
            dep.log_in(USER)
            batch, output = run_a_batch(dep, str(chat_model))
    if not output:
        print(f"The batch ended {batch.status}: {batch.errors}", file=sys.stderr)
        return 1
    print(f"=== output file {batch.output_file_id} ===")
    for line in output.splitlines():
        print(line)
    print(f"=== demo-api finished in {time.monotonic() - started:.0f}s ===")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        # Every process is stopped by now (the context managers ran): no traceback, the shell's code.
        sys.exit(130)
