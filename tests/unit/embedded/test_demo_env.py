"""The embedded default's environment: which metadata database Airflow gets, and how it waits for SQLite's lock."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_batch_embedded.demo import embedded_env
from vllm_batch_embedded.sqlite_db import SQLITE_CONNECT_ARGS_ENV

# What Airflow itself makes of the environment: its engine's dialect and, on SQLite, the lock wait.
PROBE = """
from sqlalchemy import text
from airflow import settings
print(settings.engine.dialect.name)
if settings.engine.dialect.name == "sqlite":
    with settings.engine.connect() as connection:
        print(connection.execute(text("PRAGMA busy_timeout")).scalar())
"""


def _airflow_sees(env: dict[str, str], cwd: str | None = None) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_sqlite_by_default_waits_60_s_for_the_lock(s3, tmp_path):
    env = embedded_env(s3, tmp_path / "model", tmp_path / "home")
    assert _airflow_sees(env) == ["sqlite", "60000"]  # Python's sqlite3 alone waits 5000 ms


def test_airflow_finds_the_connect_arguments_from_any_directory_without_an_inherited_pythonpath(s3, tmp_path):
    # A user's shell sets no PYTHONPATH, and Airflow's processes do not start in the clone.
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env = embedded_env(s3, tmp_path / "model", tmp_path / "home", base=base)
    assert _airflow_sees(env, cwd=str(tmp_path)) == ["sqlite", "60000"]


@pytest.mark.parametrize("inherited", [False, True], ids=["fresh", "from-an-embedded-environment"])
def test_another_database_gets_its_url_and_none_of_sqlites_connect_arguments(s3, tmp_path, inherited):
    # The integration tests' session puts the embedded environment in os.environ; a deployment
    # on PostgreSQL made from it must not keep SQLite's arguments (psycopg2 has no `timeout`).
    base = embedded_env(s3, tmp_path / "model", tmp_path / "home") if inherited else None
    url = "postgresql+psycopg2://airflow@127.0.0.1:5/airflow"  # never connected to
    env = embedded_env(s3, tmp_path / "model", tmp_path / "home", base=base, database_url=url)
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == url
    assert not set(SQLITE_CONNECT_ARGS_ENV) & set(env)
    assert _airflow_sees(env) == ["postgresql"]
