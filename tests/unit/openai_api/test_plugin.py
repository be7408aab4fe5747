"""The provider's plugin is found through its entry point and mounts the app at the documented prefix."""

from __future__ import annotations

import tomllib

import importlib

from airflow_vllm_batch.openai_api.settings import URL_PREFIX
from tests.conftest import REPO


def test_the_entry_point_names_a_plugin_that_mounts_the_api_at_its_prefix():
    entry_points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["airflow.plugins"]
    (path,) = entry_points.values()
    module, _, name = path.partition(":")
    plugin = getattr(importlib.import_module(module), name)
    (app,) = plugin.fastapi_apps
    assert app["url_prefix"] == URL_PREFIX and plugin.name in entry_points


def test_loading_the_plugin_does_not_import_the_api_server():
    import subprocess
    import sys

    code = (
        "import sys; import airflow_vllm_batch.openai_api.plugin; "
        "print('airflow_vllm_batch.openai_api.app' in sys.modules, 'airflow.api_fastapi.core_api.security' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert done.stdout.split()[-2:] == ["False", "False"]
