"""Sphinx configuration: the how-to pages (Markdown, MyST) and the API reference (autodoc).

Built by ``make docs`` with warnings as errors; ``tests/test_docs.py`` runs the same build.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The clone's provider, documented as it is, whatever is installed.
sys.path.insert(0, str(REPO))
# autodoc imports the operators, hence Airflow, which writes its config to AIRFLOW_HOME:
# keep that in the build directory rather than the user's ~/airflow.
os.environ.setdefault("AIRFLOW_HOME", str(REPO / "build" / "docs" / "airflow-home"))

project = "airflow-vllm-batch"
author = "airflow-vllm-batch contributors"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Airflow's docstring style is reST field lists (``:param name:``), which autodoc reads as is.
autodoc_member_order = "bysource"
autodoc_default_options = {"show-inheritance": True}
autodoc_typehints = "signature"
# Links to headings (``[Resume](#resume)``) in the Markdown pages.
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = "airflow-vllm-batch"


def _connection_form_rst(hook_path: str) -> list[str]:
    """The connection form of ``hook_path`` as the Airflow UI shows it: a field table in reST."""
    from importlib import import_module

    module, _, name = hook_path.rpartition(".")
    hook = getattr(import_module(module), name)
    behaviour = hook.get_ui_field_behaviour()
    hidden = set(behaviour.get("hidden_fields", ()))
    labels = behaviour.get("relabeling", {})
    placeholders = behaviour.get("placeholders", {})
    lines = [".. list-table::", "   :header-rows: 1", "", "   * - field", "     - shown as", "     - example"]
    for field in ("host", "schema", "login", "password", "port", "extra"):
        if field in hidden:
            continue
        example = placeholders.get(field, "")
        lines += [
            f"   * - ``{field}``",
            f"     - {labels.get(field, field.capitalize())}",
            f"     - ``{example}``" if example else "     -",
        ]
    return [*lines, "", f"Not shown: {', '.join(f'``{f}``' for f in sorted(hidden)) or 'none'}.", ""]


def setup(app):
    """Register ``.. connection-form:: <hook class>``, so the connection page cannot drift from the form."""
    from docutils.parsers.rst import Directive

    class ConnectionForm(Directive):
        required_arguments = 1

        def run(self):
            source = self.state_machine.get_source(self.lineno)
            self.state_machine.insert_input(_connection_form_rst(self.arguments[0]), source)
            return []

    app.add_directive("connection-form", ConnectionForm)
    return {"parallel_read_safe": True}
