"""The ``@task.vllm_batch`` example DAG parses into reviews -> classify -> use_answers (run end to end in integration)."""

from __future__ import annotations

from tests.airflow_compat import DagBag
from tests.conftest import REPO

DAG_FILE = REPO / "dags" / "vllm_batch_taskflow.py"


def test_the_decorated_task_takes_the_upstream_list_and_hands_its_manifest_downstream():
    from airflow_vllm_batch.decorators.vllm_batch import _VLLMBatchDecoratedOperator

    bag = DagBag(dag_folder=str(DAG_FILE))
    assert bag.import_errors == {}
    dag = bag.dags["vllm_batch_taskflow"]
    classify = dag.get_task("classify")
    assert isinstance(classify, _VLLMBatchDecoratedOperator)
    assert classify.input_uri is None
    assert classify.upstream_task_ids == {"reviews"}
    assert classify.downstream_task_ids == {"use_answers"}
    assert classify.output_uri.endswith("/answers.jsonl")
    assert classify.model == "{{ params.model }}"
