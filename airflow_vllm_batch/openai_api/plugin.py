"""The Airflow plugin that mounts the OpenAI Files and Batches API on Airflow's API server.

Shipped through the provider's ``airflow.plugins`` entry point. Every Airflow process loads
plugins, so the app (FastAPI, the API server's security module) is imported on the first
request, not here: a scheduler or a task runner never imports it.

The API needs Airflow 3.1 or later: it triggers runs with ``triggering_user_name`` and lists
a user's runs by ``DagRun.triggering_user_name``, both new in 3.1 (:mod:`.batch_runs`). On
Airflow 3.0 the plugin loads but mounts nothing: the provider's operators work there, the
OpenAI API does not exist.
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

from airflow_vllm_batch.openai_api.settings import URL_PREFIX
from airflow_vllm_batch.version_compat import AIRFLOW_V_3_1_PLUS

#: The oldest Airflow the API works on.
MIN_AIRFLOW = "3.1.0"


class LazyApp:
    """An ASGI app that imports :data:`airflow_vllm_batch.openai_api.app.app` on its first request."""

    def __repr__(self) -> str:
        return "airflow_vllm_batch.openai_api.app:app"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from airflow_vllm_batch.openai_api.app import app

        await app(scope, receive, send)


class VLLMBatchOpenAIPlugin(AirflowPlugin):
    """The OpenAI Files and Batches API at ``<airflow>/vllm-batch/openai/v1``, on Airflow 3.1 and later."""

    name = "vllm_batch_openai_api"
    fastapi_apps = (
        [{"app": LazyApp(), "url_prefix": URL_PREFIX, "name": "OpenAI Files and Batches API (vLLM batch)"}]
        if AIRFLOW_V_3_1_PLUS
        else []
    )
