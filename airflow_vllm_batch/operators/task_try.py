"""Who a task try is, read once from Airflow's context for the leases and the run layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_vllm_batch.lease import TaskTry

if TYPE_CHECKING:
    from airflow.sdk import Context


def task_try(context: Context, retries: int | None) -> TaskTry:
    """Who this try is (the lease holder's and the GPU lease files' fields), and whether it is the task's last."""
    ti = context["ti"]
    try_number = getattr(ti, "try_number", 0)
    # Airflow retries a failed try while try_number <= max_tries (retries, grown by retries
    # again each time the task is cleared); the task's retries stand in where the task
    # instance does not say (max_tries is 0 until the API server's context fills it in).
    max_tries = max(getattr(ti, "max_tries", 0) or 0, retries or 0)
    return TaskTry(
        dag_id=ti.dag_id,
        run_id=ti.run_id,
        task_id=ti.task_id,
        map_index=getattr(ti, "map_index", -1),
        try_number=try_number,
        last_try=try_number > max_tries,
    )
