"""[vllm_batch] openai_models maps a line's model to a warm fleet or the runner: checked when a batch is created, one task per model in the batch DAG."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient

from airflow_vllm_batch.engines import VLLMRunner, WarmVLLMServer
from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.openai_api import app as app_module, callers
from airflow_vllm_batch.openai_api.batch_dag import openai_batch_dag
from airflow_vllm_batch.openai_api.batch_runs import BatchRun
from airflow_vllm_batch.openai_api.batch_view import batch_from_run
from airflow_vllm_batch.openai_api.files import FileStore
from airflow_vllm_batch.openai_api.routes import ModelRoute, models_in, parse_routes, route_of
from airflow_vllm_batch.openai_api.settings import OpenAIApiSettings
from airflow_vllm_batch.storage.layout import manifest_uri
from tests.unit.openai_api.conftest import KEY, DictS3
from tests.unit.openai_api.test_app import User
from tests.unit.openai_api.test_batch_spec import SPEC

ROUTES = '{"qwen": {"vllm_conn_id": "vllm_fleet"}, "llama/70b": {"queue": "gpu", "engine_args": ["--tensor-parallel-size", "2"]}}'


def line(model: str | None, cid: str = "a") -> bytes:
    body = {"messages": []} if model is None else {"model": model, "messages": []}
    return json.dumps(
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
    ).encode()


def test_the_config_maps_served_names_to_a_fleet_or_the_runners_queue():
    routes = parse_routes(ROUTES)
    assert routes["qwen"] == ModelRoute("qwen", vllm_conn_id="vllm_fleet")
    assert routes["llama/70b"].queue == "gpu"
    assert routes["llama/70b"].task_id == "vllm_batch__llama_70b"
    assert parse_routes("") == {}


@pytest.mark.parametrize(
    "raw", ["[1]", "{", '{"m": {"conn": "x"}}', '{"m": {"engine_args": "--x"}}', '{"a/b": {}, "a_b": {}}']
)
def test_a_malformed_model_map_is_refused_naming_the_option(raw):
    with pytest.raises(ConfigurationError, match="openai_models"):
        parse_routes(raw)


def test_the_models_of_a_file_are_its_lines_distinct_body_models():
    assert models_in([line("qwen"), b"", b"not json", line("qwen", "b"), line(None, "c")]) == ["qwen", None]


def test_a_file_naming_an_unknown_model_is_refused_naming_it_and_the_configured_ones():
    with pytest.raises(
        ValueError, match=r"'gpt-4o' is not served here: the configured models are llama/70b, qwen"
    ):
        route_of(["gpt-4o"], parse_routes(ROUTES))


def test_a_file_naming_two_models_is_refused():
    with pytest.raises(ValueError, match="several models"):
        route_of(["qwen", "llama/70b"], parse_routes(ROUTES))


def test_the_batch_dag_has_one_task_per_model_behind_a_route_task():
    dag = openai_batch_dag(routes=parse_routes(ROUTES), engine=WarmVLLMServer(conn_id="ignored"))
    fleet, runner = dag.get_task("vllm_batch__qwen"), dag.get_task("vllm_batch__llama_70b")
    assert dag.get_task("route").downstream_task_ids == {"vllm_batch__qwen", "vllm_batch__llama_70b"}
    assert (fleet.model, fleet.engine) == ("qwen", WarmVLLMServer(conn_id="vllm_fleet"))
    assert (runner.model, runner.queue, runner.engine) == (
        "llama/70b",
        "gpu",
        VLLMRunner(args=["--tensor-parallel-size", "2"]),
    )


class Bucket:
    def __init__(self, objects):
        self.objects = objects

    def get_object(self, *, Bucket, Key):
        body = io.BytesIO(self.objects[Key])
        body.iter_lines = lambda: iter(body.getvalue().splitlines())
        return {"Body": body}

    def copy_object(self, *, Bucket, Key, CopySource, **kw):
        self.objects[Key] = self.objects[CopySource["Key"]]
        return {"CopyObjectResult": {"ETag": '"copied"'}}

    def put_object(self, *, Bucket, Key, Body, **kw):
        self.objects[Key] = Body

    def delete_object(self, *, Bucket, Key):
        self.objects.pop(Key, None)


@pytest.fixture
def create(monkeypatch):
    store = FileStore(None, "b", "p/")
    owner = app_module.owner_key("alice")
    objects = {
        store.record_key(owner, "file-0123456789"): json.dumps({"id": "file-0123456789", "lines": 2}).encode()
    }
    store.client = Bucket(objects)
    triggered = []
    monkeypatch.setattr(app_module, "_settings", lambda: OpenAIApiSettings(files_uri="s3://b/p/"))
    monkeypatch.setattr(app_module, "_store", lambda settings: store)
    monkeypatch.setattr(callers, "may_use", lambda user, method: True)
    monkeypatch.setattr(app_module, "_trigger", lambda dag_id, batch_id, conf, user: triggered.append(conf))
    monkeypatch.setattr(app_module, "load_routes", lambda: parse_routes(ROUTES))
    app_module.app.dependency_overrides[get_user] = User

    def post(*lines: bytes):
        objects[store.content_key(owner, "file-0123456789")] = b"\n".join(lines)
        body = {
            "input_file_id": "file-0123456789",
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        return TestClient(app_module.app).post("/batches", json=body)

    post.objects = objects
    yield post, triggered
    app_module.app.dependency_overrides.clear()


def test_creating_a_batch_for_an_unknown_model_answers_400_and_starts_nothing(create):
    post, triggered = create
    answer = post(line("gpt-4o"), line("gpt-4o", "b"))
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "model"
    assert (
        "'gpt-4o' is not served here: the configured models are llama/70b, qwen"
        in answer.json()["error"]["message"]
    )
    assert triggered == []
    assert not [key for key in post.objects if "/batches/" in key]


def test_a_batch_of_a_configured_model_runs_on_its_task(create):
    post, triggered = create
    answer = post(line("llama/70b"), line("llama/70b", "b"))
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "llama/70b"
    assert triggered[0]["route"] == "vllm_batch__llama_70b"
    assert (
        app_module.BatchSpec.verified(triggered[0], answer.json()["id"], KEY, "vllm_batch_openai").route
        == "vllm_batch__llama_70b"
    )


def test_a_routed_batch_is_validating_until_its_model_task_runs_whatever_the_route_task_did():
    from types import SimpleNamespace as NS

    store = FileStore(DictS3(), "b", "p/")
    spec = dataclasses.replace(SPEC, route="vllm_batch__qwen")
    run = NS(
        run_id="batch_abcdefab",
        dag_id="vllm_batch_openai",
        conf=spec.sign(KEY),
        state="running",
        end_date=None,
    )
    routed = [
        NS(task_id="route", state="success", start_date=None, end_date=None),
        NS(task_id="vllm_batch__qwen", state="scheduled", start_date=None, end_date=None),
    ]
    skipped = NS(task_id="vllm_batch__llama_70b", state="skipped", start_date=None, end_date=None)
    assert (
        batch_from_run(store, BatchRun(run, spec, [*routed, skipped]), "aws_default")["status"]
        == "validating"
    )
    routed[1].state = "success"
    assert (
        batch_from_run(store, BatchRun(run, spec, [*routed, skipped]), "aws_default")["status"]
        == "finalizing"
    )


def test_a_publishs_tombstone_at_the_manifest_key_is_no_published_output():
    from types import SimpleNamespace as NS

    from airflow_vllm_batch.manifest import Tombstone

    output_uri = SPEC.locations("s3://b/p/").output_uri
    tombstone = json.loads(Tombstone("0" * 32, output_uri, "f" * 64).to_json())
    layout = FileStore.layout("s3://b/p/")
    manifest_key = manifest_uri(output_uri).split("/", 3)[3]
    records = {manifest_key: tombstone, layout.batch_record_key(SPEC.batch_id): {"model": "qwen"}}
    store = FileStore(DictS3({k: json.dumps(v).encode() for k, v in records.items()}), "b", "p/")
    spec = dataclasses.replace(SPEC, route="vllm_batch__qwen")
    run = NS(
        run_id=SPEC.batch_id, dag_id="vllm_batch_openai", conf=spec.sign(KEY), state="running", end_date=None
    )
    tis = [NS(task_id="vllm_batch__qwen", state="success", start_date=None, end_date=None)]
    batch = batch_from_run(store, BatchRun(run, spec, tis), "aws_default")
    assert (batch["output_file_id"], batch["error_file_id"], batch["usage"], batch["model"]) == (
        None,
        None,
        None,
        "qwen",
    )


def test_lines_naming_no_model_are_left_to_preflight_when_others_name_a_configured_one():
    assert route_of([None, "qwen"], parse_routes(ROUTES)).model == "qwen"
    with pytest.raises(ValueError, match=r"name no body.model"):
        route_of([None], parse_routes(ROUTES))
