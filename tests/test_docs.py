"""The documentation builds as ``make docs`` builds it: warnings are errors, so the docs cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def test_the_docs_build_without_a_warning(tmp_path):
    # make docs' command, into a directory of this test's own.
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path / "airflow")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-d",
            str(tmp_path / "doctrees"),
            str(REPO / "docs"),
            str(tmp_path / "html"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    # The reference is generated: the operator's page holds its docstring's parameters.
    operators = (tmp_path / "html" / "reference" / "operators.html").read_text()
    assert "VLLMBatchOperator" in operators
    assert "input_uri" in operators
