"""The Airflow plugin that mounts the OpenAI Files and Batches API on Airflow's API server.

Shipped through the provider's ``airflow.plugins`` entry point. Every Airflow process loads
plugins, so the app (FastAPI, the API server's security module) is imported on the first
request, not here: a scheduler or a task runner never imports it.
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

from airflow_vllm_batch.openai_api.settings import URL_PREFIX


class LazyApp:
    """An ASGI app that imports :data:`airflow_vllm_batch.openai_api.app.app` on its first request."""

    def __repr__(self) -> str:
        return "airflow_vllm_batch.openai_api.app:app"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from airflow_vllm_batch.openai_api.app import app

        await app(scope, receive, send)


class VLLMBatchOpenAIPlugin(AirflowPlugin):
    """The OpenAI Files and Batches API at ``<airflow>/vllm-batch/openai/v1``."""

    name = "vllm_batch_openai_api"
    fastapi_apps = [{"app": LazyApp(), "url_prefix": URL_PREFIX, "name": "OpenAI Files and Batches API (vLLM batch)"}]
