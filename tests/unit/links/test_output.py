"""The "vLLM batch output" extra link: its URL, and its round trip through XCom."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
from airflow.sdk import DAG, BaseOperator
from airflow.sdk.execution_time.xcom import XCom

from airflow_vllm_batch.links import VLLMBatchOutputLink
from airflow_vllm_batch.links.output import (
    DEFAULT_OUTPUT_LINK_TEMPLATE,
    format_output_link,
)
from tests.airflow_compat import TaskInstanceKey

ENV = "AIRFLOW__VLLM_BATCH__OUTPUT_LINK_TEMPLATE"
TI_KEY = TaskInstanceKey(dag_id="d", task_id="vllm_batch", run_id="manual__1", try_number=1, map_index=-1)


class FakeTaskInstance:
    """A task instance whose ``xcom_push`` records into a dict shared with a fake ``XCom.get_value``."""

    def __init__(self, key: TaskInstanceKey = TI_KEY) -> None:
        self.key = key
        self.store: dict[tuple[TaskInstanceKey, str], Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.store[(self.key, key)] = value

    def get_value(self, *, ti_key: TaskInstanceKey, key: str) -> Any:
        return self.store.get((ti_key, key))


class LinkedOperator(BaseOperator):
    operator_extra_links = (VLLMBatchOutputLink(),)

    def execute(self, context):
        return None


@pytest.fixture(autouse=True)
def no_configured_template(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture
def ti():
    fake = FakeTaskInstance()
    with mock.patch.object(XCom, "get_value", side_effect=fake.get_value):
        yield fake


def test_default_link_is_the_aws_s3_console_page_of_the_object():
    assert format_output_link("my-bucket", "batches/2026-01-01/results.jsonl") == (
        "https://s3.console.aws.amazon.com/s3/object/my-bucket?prefix=batches/2026-01-01/results.jsonl"
    )


def test_template_from_airflow_config_env_var_replaces_the_default(monkeypatch):
    monkeypatch.setenv(ENV, "http://localhost:8888/buckets/{bucket}/{key}")
    assert format_output_link("b", "k/results.jsonl") == "http://localhost:8888/buckets/b/k/results.jsonl"


def test_empty_configured_template_falls_back_to_the_default(monkeypatch):
    monkeypatch.setenv(ENV, "")
    assert format_output_link("b", "k") == DEFAULT_OUTPUT_LINK_TEMPLATE.format(bucket="b", key="k")


def test_key_is_percent_encoded_with_slashes_kept():
    url = format_output_link("b", "runs/manual 2026+01#1?x/results.jsonl", template="{bucket}|{key}")
    assert url == "b|runs/manual%202026%2B01%231%3Fx/results.jsonl"


def test_persist_stores_bucket_and_key_under_the_link_key():
    context = {"ti": mock.Mock()}
    VLLMBatchOutputLink.persist(context=context, output_uri="s3://b/batches/results.jsonl")
    context["ti"].xcom_push.assert_called_once_with(
        key=VLLMBatchOutputLink.key, value={"bucket": "b", "key": "batches/results.jsonl"}
    )


def test_get_link_reads_back_what_persist_stored(ti):
    VLLMBatchOutputLink.persist(context={"ti": ti}, output_uri="s3://b/batches/results.jsonl")
    link = VLLMBatchOutputLink().get_link(LinkedOperator(task_id="vllm_batch"), ti_key=TI_KEY)
    assert link == "https://s3.console.aws.amazon.com/s3/object/b?prefix=batches/results.jsonl"


def test_get_link_uses_the_template_configured_when_the_link_is_built(ti, monkeypatch):
    VLLMBatchOutputLink.persist(context={"ti": ti}, output_uri="s3://b/k.jsonl")
    monkeypatch.setenv(ENV, "http://minio:9001/browser/{bucket}/{key}")
    assert (
        VLLMBatchOutputLink().get_link(LinkedOperator(task_id="t"), ti_key=TI_KEY)
        == "http://minio:9001/browser/b/k.jsonl"
    )


def test_get_link_is_empty_when_nothing_was_persisted(ti):
    assert VLLMBatchOutputLink().get_link(LinkedOperator(task_id="vllm_batch"), ti_key=TI_KEY) == ""


def test_get_link_is_empty_when_the_template_names_an_unknown_field(ti, monkeypatch):
    VLLMBatchOutputLink.persist(context={"ti": ti}, output_uri="s3://b/k.jsonl")
    monkeypatch.setenv(ENV, "http://x/{region}/{bucket}/{key}")
    assert VLLMBatchOutputLink().get_link(LinkedOperator(task_id="t"), ti_key=TI_KEY) == ""


@pytest.mark.parametrize("output_uri", ["/local/results.jsonl", "s3://bucket-only", "s3:///no-bucket"])
def test_persist_stores_nothing_and_does_not_raise_for_a_non_object_uri(output_uri):
    context = {"ti": mock.Mock()}
    VLLMBatchOutputLink.persist(context=context, output_uri=output_uri)
    context["ti"].xcom_push.assert_not_called()


def test_persist_does_not_fail_the_task_when_the_xcom_push_fails():
    context = {"ti": mock.Mock(**{"xcom_push.side_effect": RuntimeError("API server away")})}
    VLLMBatchOutputLink.persist(context=context, output_uri="s3://b/k.jsonl")
    context["ti"].xcom_push.assert_called_once()


def test_serialized_dag_keeps_the_link_name_and_xcom_key(monkeypatch):
    from tests.airflow_compat import DagSerialization

    # Process-wide switch that Airflow's DAG processor turns off when it deserializes
    # (load_op_links=False); an earlier test in the same process may have left it off.
    monkeypatch.setattr(DagSerialization, "_load_operator_extra_links", True)

    with DAG("link_dag", schedule=None) as dag:
        LinkedOperator(task_id="vllm_batch")
    task = DagSerialization.from_dict(DagSerialization.to_dict(dag)).task_dict["vllm_batch"]
    (link,) = task.operator_extra_links
    assert (link.name, link.xcom_key) == ("vLLM batch output", VLLMBatchOutputLink().xcom_key)


def test_a_custom_s3_endpoint_links_to_the_object_there_not_to_the_aws_console(monkeypatch):
    from airflow_vllm_batch.links import output as link_module

    monkeypatch.delenv(ENV, raising=False)
    stored = {"bucket": "b", "key": "runs/r 1/results.jsonl", "endpoint_url": "http://127.0.0.1:8333/"}
    monkeypatch.setattr("airflow.sdk.execution_time.xcom.XCom.get_value", lambda **kw: stored)
    url = link_module.VLLMBatchOutputLink().get_link(None, ti_key=None)
    assert url == "http://127.0.0.1:8333/b/runs/r%201/results.jsonl"


def test_a_failed_task_has_an_empty_link():
    pushed = {}

    class TI:
        def xcom_push(self, key, value):
            pushed[key] = value

    VLLMBatchOutputLink.persist_empty(context={"ti": TI()})
    assert pushed == {VLLMBatchOutputLink.key: None}
