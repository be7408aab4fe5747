"""The OpenAI API's batch DAG parses, and its task takes no location from the run's conf (it derives them from the signed spec)."""

from __future__ import annotations

from airflow_vllm_batch.openai_api.batch_dag import TASK_ID, UNBOUND, OpenAIBatchOperator
from airflow_vllm_batch.openai_api.settings import DEFAULT_BATCH_DAG_ID
from tests.airflow_compat import DagBag
from tests.conftest import REPO

DAG_FILE = REPO / "dags" / "vllm_batch_openai.py"


def test_the_batch_dag_parses_with_no_location_templated_from_the_conf():
    bag = DagBag(dag_folder=str(DAG_FILE))
    assert bag.import_errors == {}
    dag = bag.dags[DEFAULT_BATCH_DAG_ID]
    task = dag.get_task(TASK_ID)
    assert isinstance(task, OpenAIBatchOperator)
    assert task.input_uri == task.output_uri == task.failure_uri == UNBOUND
    assert dag.schedule is None
    assert dag.fileloc == str(DAG_FILE)


def test_the_example_batch_dag_runs_on_the_gpu_queue_with_retries():
    task = DagBag(dag_folder=str(DAG_FILE)).dags[DEFAULT_BATCH_DAG_ID].get_task(TASK_ID)
    assert task.queue == "gpu"
    assert task.retries == 2
