"""The OpenAI API's batch DAG parses, and its task takes the URIs of the batch from the run's conf."""

from __future__ import annotations

from airflow_vllm_batch.openai_api.batch_dag import TASK_ID, OpenAIBatchOperator
from airflow_vllm_batch.openai_api.settings import DEFAULT_BATCH_DAG_ID
from tests.airflow_compat import DagBag
from tests.conftest import REPO

DAG_FILE = REPO / "dags" / "vllm_batch_openai.py"


def test_the_batch_dag_runs_the_file_the_run_conf_names():
    bag = DagBag(dag_folder=str(DAG_FILE))
    assert bag.import_errors == {}
    dag = bag.dags[DEFAULT_BATCH_DAG_ID]
    task = dag.get_task(TASK_ID)
    assert isinstance(task, OpenAIBatchOperator)
    assert task.input_uri == "{{ dag_run.conf['input_uri'] }}"
    assert task.failure_uri == "{{ dag_run.conf['failure_uri'] }}"
    assert dag.schedule is None and dag.fileloc == str(DAG_FILE)
