"""Run an example DAG with ``dag.test()`` and collect what a test asserts on."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def load_dag(filename: str, attribute: str, retries: int = 0):
    """Import a DAG file from ``dags/`` and return its DAG object.

    Retries are set to ``retries`` (default none): ``dag.test()`` would otherwise sit out
    each retry delay before failing.
    """
    path = REPO / "dags" / filename
    spec = importlib.util.spec_from_file_location(f"example_dag_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    dag = getattr(module, attribute)
    for task in dag.tasks:
        task.retries = retries
    return dag


def register_dag(dag) -> None:
    """Write a DAG defined in a test to the metadata DB, as the DAG processor would.

    ``dag.test()`` runs only DAGs that a bundle's sync has serialized; this one lives in
    no bundle file, so it is synced on its own under the default bundle's name.
    """
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    DagBundlesManager().sync_bundles_to_db()
    bag = DagBag(dag_folder=os.devnull)
    bag.bag_dag(dag)
    sync_bag_to_db(bag, "dags-folder", None)


@dataclass
class DagRunResult:
    """The outcome of one ``dag.test()``: states, XComs, and everything printed meanwhile."""

    run_id: str
    state: str
    task_states: dict[str, str]
    xcoms: dict[tuple[str, str], Any] = field(default_factory=dict)
    output: str = ""
    rendered: dict[str, dict[str, Any]] = field(default_factory=dict)

    def xcom(self, task_id: str, key: str = "return_value") -> Any:
        return self.xcoms[(task_id, key)]


@contextlib.contextmanager
def captured_fds(path: Path) -> Iterator[None]:
    """Send file descriptors 1 and 2 (where ``dag.test()`` writes task logs) to ``path``.

    Works below pytest's own capturing, so module-scoped fixtures can capture too.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    saved_streams = sys.stdout, sys.stderr
    with open(path, "wb") as sink, open(path, "a", buffering=1, errors="replace") as text:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        # pytest swaps sys.stdout for its own capture object; logging that writes there
        # would bypass the file descriptors.
        sys.stdout = sys.stderr = text
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved_streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_dag(dag, run_conf: dict | None = None, logical_date=None, run_after=None) -> DagRunResult:
    """Run ``dag`` in-process; capture its console output (the task logs) and XComs.

    A manual run's id is made from ``run_after``: the same ``run_after`` is the same run again.
    """
    from airflow.models.renderedtifields import RenderedTaskInstanceFields
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    kwargs: dict[str, Any] = {"run_conf": run_conf}
    if logical_date is not None:
        kwargs["logical_date"] = logical_date
    if run_after is not None:
        kwargs["run_after"] = run_after
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "dagrun.log"
        with captured_fds(log_path):
            dr = dag.test(**kwargs)
        output = log_path.read_text(errors="replace")
    with create_session() as session:
        tis = {ti.task_id: str(ti.state) for ti in dr.get_task_instances(session=session)}
        rows = session.scalars(XComModel.get_many(run_id=dr.run_id, dag_ids=dag.dag_id)).all()
        xcoms = {(row.task_id, row.key): _xcom_value(row.value) for row in rows}
        rendered = {
            row.task_id: row.rendered_fields
            for row in session.scalars(
                select(RenderedTaskInstanceFields).where(
                    RenderedTaskInstanceFields.dag_id == dag.dag_id,
                    RenderedTaskInstanceFields.run_id == dr.run_id,
                )
            )
        }
    return DagRunResult(dr.run_id, str(dr.state), tis, xcoms, output, rendered)


def error_lines(output: str) -> list[str]:
    """The log lines at error level or above (structlog's ``[error    ]``, Airflow's ``ERROR -``)."""
    return [
        line
        for line in output.splitlines()
        if re.search(r"\[(error|critical)\s*\]|\b(ERROR|CRITICAL) - ", line)
    ]


def _xcom_value(value: Any) -> Any:
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value
