"""``GET /batches`` on PostgreSQL: the caller's batches, newest first, paged, with no query sent while another's rows stream.

MySQL's driver refuses a query while another query's rows are still being read, and the
list used to read each run's task instances inside a ``yield_per`` loop over the runs. The
query discipline is checked on every statement (no streamed result, one task-instance query
per page of runs); the answers come from a real PostgreSQL (``postgres.py``) with the runs
made by the API's own trigger. No scheduler and no engine: the runs stay queued.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration.postgres import MISSING, Postgres, server_bin_dir

pytestmark = [pytest.mark.integration]

DAG_FILE = """
from datetime import datetime
from airflow.sdk import DAG
from airflow.providers.standard.operators.empty import EmptyOperator

with DAG("vllm_batch_openai", schedule=None, start_date=datetime(2026, 1, 1)):
    EmptyOperator(task_id="vllm_batch")
"""

#: Makes runs through the API's trigger, then lists them as the API does, recording every statement.
SCRIPT = textwrap.dedent(
    """
    import json, time
    from sqlalchemy import event
    from airflow import settings
    from airflow_vllm_batch.openai_api import app, batch_runs
    from airflow_vllm_batch.openai_api.batch_spec import BatchSpec, signing_key
    from airflow_vllm_batch.openai_api.files import new_batch_id

    made = {"alice": [], "bob": []}
    for i in range(7):
        for user in ("alice", "bob"):
            batch_id = new_batch_id()
            spec = BatchSpec(batch_id, "vllm_batch_openai", user, "file-0123456789", "etag", "/v1/chat/completions", "", int(time.time()), 86400)
            app._trigger("vllm_batch_openai", batch_id, spec.sign(signing_key()), user)
            made[user].append(batch_id)
    # A hand-made run by alice: not a batch, never listed.
    app._trigger("vllm_batch_openai", "batch_" + "f" * 32, {"owner": "alice"}, "alice")

    statements = []

    @event.listens_for(settings.engine, "before_cursor_execute")
    def seen(conn, cursor, statement, parameters, context, executemany):
        statements.append({"streamed": bool(context.execution_options.get("stream_results") or context.execution_options.get("yield_per")),
                           "ti": "FROM task_instance" in statement})

    batch_runs.RUNS_PER_QUERY = 3  # several pages of runs, bob's among alice's
    verify = app._verifier()
    def runs(after, limit):
        return batch_runs.user_runs("vllm_batch_openai", "alice", "alice", after, limit, verify)
    first = [batch.run.run_id for batch in runs(None, 5)]
    rest = [batch.run.run_id for batch in runs(first[-1], 100)]
    tis = [len(batch.task_instances) for batch in runs(None, 100)]
    # The per-user limits' count of batches that have not ended (all queued here): the caller's signed runs only.
    active = {user: batch_runs.active_batch_ids("vllm_batch_openai", user, user, verify) for user in made}
    print(json.dumps({"made": made, "first": first, "rest": rest, "tis": tis, "statements": statements, "active": active}))
    """
)


@pytest.fixture(scope="module")
def postgres():
    if server_bin_dir() is None:
        pytest.skip(MISSING)
    with Postgres() as pg:
        yield pg


def test_the_batch_list_pages_the_callers_batches_on_postgresql_without_a_query_inside_a_stream(
    postgres, tmp_path: Path
):
    (tmp_path / "dags").mkdir()
    (tmp_path / "dags" / "batch_dag.py").write_text(DAG_FILE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        AIRFLOW_HOME=str(tmp_path),
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=postgres.url,
        AIRFLOW__CORE__DAGS_FOLDER=str(tmp_path / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY="postgres-test-key-" + "0" * 20,
    )
    airflow = str(Path(sys.executable).with_name("airflow"))
    for argv in ([airflow, "db", "migrate"], [airflow, "dags", "reserialize"]):
        done = subprocess.run(
            argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
        )
        assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    newest_first = list(reversed(seen["made"]["alice"]))
    assert seen["first"] == newest_first[:5]
    assert seen["rest"] == newest_first[5:]
    assert seen["tis"] == [1] * 7  # each run's task instance, read with its page
    assert {user: sorted(ids) for user, ids in seen["active"].items()} == {
        user: sorted(ids) for user, ids in seen["made"].items()
    }
    assert not [s for s in seen["statements"] if s["streamed"]], "a list query streamed its rows"
    # One task-instance query per page of the caller's runs, not one per run.
    assert sum(s["ti"] for s in seen["statements"]) <= 3 + 3 + 3
