"""Airflow's connect arguments for the embedded default's SQLite metadata database.

Airflow takes ``sql_alchemy_connect_args`` as the *import path* of a dict, and imports it
in every process that opens the database. So the dicts live in a module of their own that
is only ever imported, never run: a module run with ``python -m`` is ``__main__``, and an
import path built from its ``__name__`` names nothing in the processes Airflow starts (the
failure ``make demo`` once met on a fresh clone).
"""

from __future__ import annotations

#: A writer waits up to 60 s for the database lock instead of Python's default 5 s: the
#: scheduler, dag-processor, api-server, tasks and CLI commands all write to the one file,
#: and on two busy cores 5 s runs out ("database is locked"), sometimes half-way through a
#: command that commits in steps. No wait helps a transaction that reads before it writes
#: once another process committed in between: SQLite fails it at once. Airflow's backfill
#: creation is one such, which is why Airflow supports it only on PostgreSQL or MySQL under
#: a running scheduler.
SQLITE_CONNECT_ARGS: dict[str, object] = {"timeout": 60}
#: The same for Airflow's async engine (aiosqlite passes it to :func:`sqlite3.connect`).
#: A dict of its own: Airflow adds keys to the sync one.
SQLITE_CONNECT_ARGS_ASYNC: dict[str, object] = {"timeout": 60}
#: How Airflow is told to use them: the import paths of the two dicts.
SQLITE_CONNECT_ARGS_ENV = {
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": f"{__name__}.SQLITE_CONNECT_ARGS",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC": f"{__name__}.SQLITE_CONNECT_ARGS_ASYNC",
}
