"""The lineage module is optional: a worker without the OpenLineage provider still imports it."""

from __future__ import annotations

import subprocess
import sys


def test_module_imports_without_the_openlineage_provider():
    # None in sys.modules makes any import of these packages fail, as if not installed.
    code = (
        "import sys\n"
        "for name in ('openlineage', 'airflow.providers.openlineage', 'airflow.providers.common.compat.openlineage'):\n"
        "    sys.modules[name] = None\n"
        "import airflow_vllm_batch.lineage\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok", done.stderr
