"""The prompts example DAG parses, and its operator takes the upstream task's list as requests (run end to end in integration)."""

from __future__ import annotations

from airflow.sdk.definitions.xcom_arg import XComArg

from tests.airflow_compat import DagBag
from tests.conftest import REPO

DAG_FILE = REPO / "dags" / "vllm_batch_prompts.py"


def test_prompts_flow_from_a_task_through_the_operator_to_a_task():
    bag = DagBag(dag_folder=str(DAG_FILE))
    assert bag.import_errors == {}
    dag = bag.dags["vllm_batch_prompts"]
    classify = dag.get_task("classify")
    assert isinstance(classify.requests, XComArg)
    assert classify.input_uri is None
    assert classify.upstream_task_ids == {"prompts"}
    assert classify.downstream_task_ids == {"use_answers"}
