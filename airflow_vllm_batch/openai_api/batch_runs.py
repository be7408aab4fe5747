"""The batch DAG's runs in Airflow's metadata database: trigger one, read one, list a user's, count their active ones.

The one module of the API that reaches into Airflow's internals (``trigger_dag``, ``DagRun``,
``TaskInstance``, ``create_session``): a plugin served by the API server runs beside the
database, and Airflow gives providers no public in-process interface for these (its REST API
would need a token of the API's own, with rights on the batch DAG no API user holds). They
exist in this shape from Airflow 3.1 (``triggering_user_name``): the plugin mounts the API on
3.1 and later only, and :func:`require_runs_interface` says so to a caller on 3.0.

No authorisation here: the routes decide who may call, these functions what a run is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_vllm_batch.docs_links import doc_ref
from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.openai_api.access import owns
from airflow_vllm_batch.version_compat import AIRFLOW_V_3_1_PLUS

if TYPE_CHECKING:
    from airflow_vllm_batch.openai_api.batch_spec import BatchSpec

#: How many DAG runs :func:`user_runs` reads per query while it looks for the caller's.
RUNS_PER_QUERY = 200

#: The DAG run states of a batch that has not ended.
ACTIVE_STATES = ("queued", "running")

#: What tells a batch run from any other run of the batch DAG: its verified spec, or None.
Verifier = Callable[[Any], "BatchSpec | None"]


class BatchDagNotDeployed(ConfigurationError):
    """The batch DAG is not in Airflow's database (not deployed, or not parsed yet)."""


@dataclass
class BatchRun:
    """A run of the batch DAG that the API made, read once per request.

    :param run: the DAG run (detached from its session).
    :param spec: its conf's spec, verified once (:class:`.batch_spec.BatchSpec`).
    :param task_instances: its task instances (detached).
    """

    run: Any
    spec: BatchSpec
    task_instances: list[Any] = field(default_factory=list)


def require_runs_interface() -> None:
    """Fail, saying why, on an Airflow without what this module uses (3.0: no ``triggering_user_name``).

    :raises ConfigurationError: Airflow is older than 3.1.
    """
    if not AIRFLOW_V_3_1_PLUS:
        raise ConfigurationError(
            "The OpenAI API needs Airflow 3.1 or later (it triggers runs with triggering_user_name): "
            "upgrade Airflow, or use the provider's operators only"
        )


def trigger_run(dag_id: str, batch_id: str, conf: dict[str, Any], user_name: str) -> None:
    """Queue a run of the batch DAG with the batch's signed conf, as ``user_name``.

    Its ``triggered_by`` is ``rest_api``: the closest of Airflow's kinds (a REST request, the
    OpenAI API's, made it); Airflow has none for plugins.

    :raises BatchDagNotDeployed: the DAG is not in the database.
    """
    require_runs_interface()
    from airflow.api.common.trigger_dag import trigger_dag
    from airflow.exceptions import DagNotFound
    from airflow.utils.types import DagRunTriggeredByType

    try:
        trigger_dag(
            dag_id,
            triggered_by=DagRunTriggeredByType.REST_API,
            run_id=batch_id,
            conf=conf,
            triggering_user_name=user_name,
        )
    except DagNotFound:
        raise BatchDagNotDeployed(
            f"the batch DAG {dag_id!r} ([vllm_batch] openai_batch_dag_id) is not deployed: put the provider's "
            f"batch DAG in the DAGs folder ({doc_ref('The OpenAI Files and Batches API', 'Deploying it')})"
        ) from None


def find_run(dag_id: str, batch_id: str, user_id: str, verify: Verifier) -> BatchRun | None:
    """The run of ``user_id``'s batch ``batch_id``; None for anyone else's, and for a run the API did not make.

    :param verify: the request's verifier (the signature is checked once per request).
    """
    require_runs_interface()
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == batch_id))
        if run is None or not owns(run.conf, user_id):
            return None
        spec = verify(run)
        if spec is None:
            return None
        tis = list(
            session.scalars(
                select(TaskInstance).where(
                    TaskInstance.dag_id == run.dag_id, TaskInstance.run_id == run.run_id
                )
            )
        )
        session.expunge_all()
    return BatchRun(run, spec, tis)


def user_runs(
    dag_id: str, user_id: str, user_name: str, after: str | None, limit: int, verify: Verifier
) -> list[BatchRun]:
    """The caller's batch runs, newest first, after the run ``after``: ``limit`` of them at most.

    Each query's rows are all read before the next query is sent (pages by primary key, the
    task instances of a page in one query): MySQL's driver refuses a query while another's
    rows are still streaming, and PostgreSQL's named cursors would hold a transaction open.

    :param verify: the request's verifier (each run's signature is checked once).
    """
    require_runs_interface()
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        query = (
            select(DagRun)
            .where(DagRun.dag_id == dag_id, DagRun.triggering_user_name == user_name)
            .order_by(DagRun.id.desc())
        )
        if after is not None:
            after_pk = session.scalar(
                select(DagRun.id).where(DagRun.dag_id == dag_id, DagRun.run_id == after)
            )
            if after_pk is None:
                return []
            query = query.where(DagRun.id < after_pk)
        found: list[BatchRun] = []
        while len(found) < limit:
            runs = list(session.scalars(query.limit(RUNS_PER_QUERY)))
            mine: list[BatchRun] = []
            for run in runs:
                if len(found) + len(mine) >= limit:
                    break
                spec = verify(run) if owns(run.conf, user_id) else None
                if spec is not None:
                    mine.append(BatchRun(run, spec))
            if mine:
                by_run = {batch.run.run_id: batch for batch in mine}
                for ti in session.scalars(
                    select(TaskInstance).where(
                        TaskInstance.dag_id == dag_id, TaskInstance.run_id.in_(list(by_run))
                    )
                ):
                    by_run[ti.run_id].task_instances.append(ti)
                found.extend(mine)
            if len(runs) < RUNS_PER_QUERY:
                break
            query = query.where(DagRun.id < runs[-1].id)
        session.expunge_all()
    return found


def dag_max_active_runs(dag_id: str) -> int | None:
    """How many runs of the batch DAG Airflow runs at once (its ``max_active_runs``); None when it is not deployed.

    A DAG that sets none has ``[core] max_active_runs_per_dag``, as the scheduler applies it.
    """
    require_runs_interface()
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from airflow_vllm_batch.version_compat import conf

    with create_session() as session:
        row = session.execute(select(DagModel.max_active_runs).where(DagModel.dag_id == dag_id)).first()
    if row is None:
        return None
    if row.max_active_runs is None:
        return conf.getint("core", "max_active_runs_per_dag", fallback=16)
    return int(row.max_active_runs)


def active_batches(
    dag_id: str, user_id: str, user_name: str, verify: Verifier
) -> list[tuple[str, BatchSpec]]:
    """The caller's batches whose runs have not ended (queued or running), with their verified specs.

    Only runs the API signed for this user count: a run triggered by hand is no batch of theirs.

    :param verify: the request's verifier.
    """
    require_runs_interface()
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(DagRun.run_id, DagRun.dag_id, DagRun.conf).where(
                DagRun.dag_id == dag_id,
                DagRun.triggering_user_name == user_name,
                DagRun.state.in_(ACTIVE_STATES),
            )
        ).all()
    found = []
    for row in rows:
        spec = verify(row) if owns(row.conf, user_id) else None
        if spec is not None:
            found.append((row.run_id, spec))
    return found


def active_batch_ids(dag_id: str, user_id: str, user_name: str, verify: Verifier) -> list[str]:
    """The ids of :func:`active_batches`."""
    return [batch_id for batch_id, _ in active_batches(dag_id, user_id, user_name, verify)]
