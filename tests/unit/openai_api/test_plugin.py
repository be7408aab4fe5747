"""The provider's plugin is found through its entry point and mounts the app at the documented prefix."""

from __future__ import annotations

import importlib

import tomllib

from airflow_vllm_batch.openai_api.settings import URL_PREFIX
from airflow_vllm_batch.version_compat import AIRFLOW_V_3_1_PLUS
from tests.conftest import REPO


def test_the_entry_point_names_a_plugin_that_mounts_the_api_at_its_prefix():
    entry_points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][
        "airflow.plugins"
    ]
    (path,) = entry_points.values()
    module, _, name = path.partition(":")
    plugin = getattr(importlib.import_module(module), name)
    assert plugin.name in entry_points
    if not AIRFLOW_V_3_1_PLUS:
        # The API needs 3.1: on 3.0 (the floor) the plugin loads and mounts nothing.
        assert plugin.fastapi_apps == []
        return
    (app,) = plugin.fastapi_apps
    assert app["url_prefix"] == URL_PREFIX


def test_the_api_is_mounted_only_on_the_airflow_it_needs(monkeypatch):
    import airflow_vllm_batch.openai_api.plugin as plugin_module
    import airflow_vllm_batch.version_compat as compat

    for flag, mounted in ((False, 0), (True, 1)):
        monkeypatch.setattr(compat, "AIRFLOW_V_3_1_PLUS", flag)
        assert len(importlib.reload(plugin_module).VLLMBatchOpenAIPlugin.fastapi_apps) == mounted
    monkeypatch.undo()
    importlib.reload(plugin_module)


def test_loading_the_plugin_does_not_import_the_api_server():
    import subprocess
    import sys

    code = (
        "import sys; import airflow_vllm_batch.openai_api.plugin; "
        "print('airflow_vllm_batch.openai_api.app' in sys.modules, 'airflow.api_fastapi.core_api.security' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": ""},
    )
    assert done.stdout.split()[-2:] == ["False", "False"]


def test_the_batch_dags_runs_are_read_and_triggered_only_on_an_airflow_that_has_their_interface(monkeypatch):
    """The one module that uses Airflow's internals refuses, saying why, where they are not (3.0: the floor)."""
    import pytest

    from airflow_vllm_batch.exceptions import ConfigurationError
    from airflow_vllm_batch.openai_api import batch_runs

    if AIRFLOW_V_3_1_PLUS:
        batch_runs.require_runs_interface()
    monkeypatch.setattr(batch_runs, "AIRFLOW_V_3_1_PLUS", False)
    for call in (
        lambda: batch_runs.trigger_run("d", "batch_0123456789abcdef", {}, "alice"),
        lambda: batch_runs.find_run("d", "batch_0123456789abcdef", "alice", lambda run: None),
        lambda: batch_runs.user_runs("d", "alice", "alice", None, 10, lambda run: None),
        lambda: batch_runs.active_batch_ids("d", "alice", "alice", lambda run: None),
    ):
        with pytest.raises(ConfigurationError, match=r"needs Airflow 3\.1 or later"):
            call()
