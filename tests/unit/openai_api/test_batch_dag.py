"""The batch DAG's operations: retries on, so a retry resumes from durable answers; every offered window fits the task's timeout."""

from __future__ import annotations

from datetime import timedelta

import pytest

from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.openai_api.batch_dag import EXPIRY_GRACE, TASK_ID, openai_batch_dag


def test_the_batch_task_is_retried_by_default_so_that_a_retry_resumes_from_the_answers_made_durable():
    task = openai_batch_dag(model="m").get_task(TASK_ID)
    assert task.retries == 2
    assert task.retry_delay == timedelta(minutes=5)
    assert openai_batch_dag(model="m", retries=0).get_task(TASK_ID).retries == 0


def test_the_timeout_covers_the_longest_window_offered(monkeypatch):
    assert (
        openai_batch_dag(model="m").get_task(TASK_ID).execution_timeout == timedelta(hours=24) + EXPIRY_GRACE
    )
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_COMPLETION_WINDOWS", "24h,3d")
    assert (
        openai_batch_dag(model="m").get_task(TASK_ID).execution_timeout == timedelta(hours=72) + EXPIRY_GRACE
    )


@pytest.mark.parametrize(
    "given",
    [{"completion_window": timedelta(hours=24)}, {"execution_timeout": timedelta(hours=25)}],
    ids=["completion_window", "execution_timeout"],
)
def test_a_dag_whose_timeout_is_shorter_than_an_offered_window_is_refused_when_parsed(monkeypatch, given):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_COMPLETION_WINDOWS", "24h,72h")
    with pytest.raises(
        ConfigurationError,
        match=r"is shorter than the 72h window of \[vllm_batch\] openai_completion_windows",
    ):
        openai_batch_dag(model="m", **given)


def test_a_longer_timeout_given_is_kept():
    task = openai_batch_dag(model="m", execution_timeout=timedelta(hours=30)).get_task(TASK_ID)
    assert task.execution_timeout == timedelta(hours=30)
