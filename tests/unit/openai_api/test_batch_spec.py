"""A batch run does what the API signed, and nothing else: a hand-made or edited conf fails before any read or write."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from airflow_vllm_batch.openai_api.access import owner_key
from airflow_vllm_batch.openai_api.batch_dag import UNBOUND, OpenAIBatchOperator, _chosen_route
from airflow_vllm_batch.openai_api.batch_spec import BatchSpec, ForgedBatchError, signing_key
from airflow_vllm_batch.openai_api.files import FileStore
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.openai_api.conftest import FILES_URI, KEY

DAG = "vllm_batch_openai"
SPEC = BatchSpec(
    batch_id="batch_abcdefab",
    dag_id=DAG,
    owner="alice",
    input_file_id="file-0123456789",
    input_version="0f0f0f",
    endpoint="/v1/chat/completions",
    route="",
    created_at=1_800_000_000,
    window_s=86400,
)


def run(conf, run_id=SPEC.batch_id, dag_id=DAG):
    return {"dag_run": SimpleNamespace(conf=conf, run_id=run_id, dag_id=dag_id)}


class NoS3:
    """A hook whose every use fails the test: binding a batch touches no S3."""

    def __getattr__(self, name):
        raise AssertionError(f"S3 was used ({name}) before the batch was verified")


@pytest.fixture
def operator(monkeypatch):
    monkeypatch.setattr(OpenAIBatchOperator, "hook", property(lambda self: NoS3()))
    return OpenAIBatchOperator(task_id="vllm_batch", model="m")


def test_a_signed_spec_verifies_for_its_own_run_and_says_when_it_expires():
    assert BatchSpec.verified(SPEC.sign(KEY), SPEC.batch_id, KEY, DAG) == SPEC
    assert SPEC.expires_at == 1_800_000_000 + 86400


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("owner", "bob"),
        ("input_file_id", "file-9999999999"),
        ("input_version", "other"),
        ("endpoint", "/v1/embeddings"),
        ("route", "vllm_batch__other"),
        ("created_at", 1_900_000_000),
        ("window_s", 10 * 86400),
        ("batch_id", "batch_00000000"),
        ("dag_id", "another_batch_dag"),
    ],
)
def test_an_edited_field_fails_the_signature(field, value):
    conf = {**SPEC.sign(KEY), field: value}
    with pytest.raises(ForgedBatchError, match="signature does not match"):
        BatchSpec.verified(conf, conf["batch_id"], KEY, DAG)


@pytest.mark.parametrize(
    ("conf", "why"),
    [
        (None, "no conf from the OpenAI API"),
        (
            {"input_uri": "s3://b/p/files/x/file-1.jsonl", "output_uri": "s3://b/mine.jsonl"},
            "not a batch of the OpenAI API",
        ),
        ({k: v for k, v in SPEC.sign(KEY).items() if k != "signature"}, "no signature"),
        ({**SPEC.sign(KEY), "created_at": "1800000000"}, "not a batch of the OpenAI API"),
    ],
)
def test_a_conf_the_api_did_not_sign_is_refused_saying_why(conf, why):
    with pytest.raises(ForgedBatchError, match=why):
        BatchSpec.verified(conf, SPEC.batch_id, KEY, DAG)


def test_a_spec_signed_with_another_key_or_for_another_run_is_refused():
    with pytest.raises(ForgedBatchError, match="signature does not match"):
        BatchSpec.verified(SPEC.sign("x" * 40), SPEC.batch_id, KEY, DAG)
    with pytest.raises(ForgedBatchError, match="not for this run 'batch_ffffffff'"):
        BatchSpec.verified(SPEC.sign(KEY), "batch_ffffffff", KEY, DAG)


def test_a_spec_replayed_into_another_batch_dag_is_refused():
    """Another DAG built with openai_batch_dag (a staging DAG, a leftover after a rename) runs none of this DAG's batches."""
    with pytest.raises(
        ForgedBatchError, match="signed for the batch DAG 'vllm_batch_openai', not for 'team_b_batches'"
    ):
        BatchSpec.verified(SPEC.sign(KEY), SPEC.batch_id, KEY, "team_b_batches")


def test_the_locations_are_derived_from_the_files_uri_the_owner_and_the_ids_as_the_api_keeps_them():
    where = SPEC.locations(FILES_URI)
    store = FileStore(None, "b", "p/")
    owner = owner_key("alice")
    uri = store.uri
    assert where.input_uri == uri(store.batch_input_key(SPEC.batch_id))
    assert where.output_uri == uri(store.content_key(owner, "file-abcdefabout"))
    assert where.error_uri == uri(store.content_key(owner, "file-abcdefaberr"))
    assert where.failure_uri == uri(store.failure_key(SPEC.batch_id))
    assert where.cancel_uri == uri(store.cancel_key(SPEC.batch_id))
    assert where.progress_uri == uri(store.progress_key(SPEC.batch_id))
    assert where.record_uri == uri(store.batch_record_key(SPEC.batch_id))
    assert SPEC.locations("s3://b/p") == where


def test_the_batch_task_takes_no_location_arguments_and_renders_none():
    with pytest.raises(Exception, match="takes no failure_uri, output_uri"):
        OpenAIBatchOperator(task_id="t", model="m", output_uri="s3://b/o.jsonl", failure_uri="s3://b/f.json")
    assert not {"input_uri", "output_uri", "error_uri"} & set(OpenAIBatchOperator.template_fields)


def test_the_batch_task_binds_a_signed_batch_to_its_derived_locations(operator):
    operator._bind_batch(run(SPEC.sign(KEY)))
    where = SPEC.locations(FILES_URI)
    assert operator.batch == SPEC
    bound = (
        operator.input_uri,
        operator.output_uri,
        operator.error_uri,
        operator.failure_uri,
        operator.cancel_uri,
        operator.progress_uri,
    )
    assert bound == (
        where.input_uri,
        where.output_uri,
        where.error_uri,
        where.failure_uri,
        where.cancel_uri,
        where.progress_uri,
    )
    assert operator.supported_urls == ["/v1/chat/completions"]


@pytest.mark.parametrize(
    ("conf", "run_id"),
    [
        # A hand-triggered run naming another user's files as its own (issue 33, item 2).
        (
            {
                "input_uri": "s3://b/p/files/bob/file-1.jsonl",
                "output_uri": "s3://b/p/files/mallory/file-2.jsonl",
                "endpoint": "/v1/chat/completions",
            },
            SPEC.batch_id,
        ),
        ({**SPEC.sign(KEY), "owner": "mallory"}, SPEC.batch_id),
        (SPEC.sign(KEY), "manual__2026-11-27T19:00:00"),
        # The same run id and conf, triggered in another DAG built with openai_batch_dag (review 2.1).
        (SPEC.sign(KEY), (SPEC.batch_id, "team_b_batches")),
        (
            dataclasses.replace(SPEC, batch_id="batch_0000000000").sign(
                "not the deployment's key, but long enough"
            ),
            "batch_0000000000",
        ),
    ],
)
def test_a_hand_made_or_edited_run_fails_before_any_read_or_write_without_retry(operator, conf, run_id):
    run_id, dag_id = run_id if isinstance(run_id, tuple) else (run_id, DAG)
    with pytest.raises(AirflowFailException, match="nothing was read or written"):
        operator.execute(run(conf, run_id, dag_id))
    assert operator.batch is None
    assert operator.output_uri == operator.failure_uri == UNBOUND


def test_a_batch_task_other_than_its_route_refuses_it(operator):
    with pytest.raises(AirflowFailException, match="runs on the task 'vllm_batch__qwen'"):
        operator._bind_batch(run(dataclasses.replace(SPEC, route="vllm_batch__qwen").sign(KEY)))


def test_the_route_task_follows_the_verified_route_only():
    routed = dataclasses.replace(SPEC, route="vllm_batch__qwen")
    assert (
        _chosen_route(SimpleNamespace(conf=routed.sign(KEY), run_id=SPEC.batch_id, dag_id=DAG))
        == "vllm_batch__qwen"
    )
    with pytest.raises(AirflowFailException, match="signature does not match"):
        _chosen_route(
            SimpleNamespace(
                conf={**routed.sign(KEY), "route": "vllm_batch__llama"}, run_id=SPEC.batch_id, dag_id=DAG
            )
        )


@pytest.mark.parametrize("value", ["", "short"])
def test_a_missing_or_short_signing_key_is_refused_naming_the_setting(monkeypatch, value):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY", value)
    with pytest.raises(Exception, match=r"\[vllm_batch\] openai_signing_key is (unset|shorter than 32)"):
        signing_key()


def test_the_api_shows_no_run_it_did_not_sign_even_one_naming_the_caller_as_owner():
    from airflow_vllm_batch.openai_api import app as app_module

    verify = app_module._verifier()
    assert verify(SimpleNamespace(conf=SPEC.sign(KEY), run_id=SPEC.batch_id, dag_id=DAG)) == SPEC
    forged = {k: v for k, v in SPEC.sign(KEY).items() if k != "signature"}
    assert verify(SimpleNamespace(conf=forged, run_id=SPEC.batch_id, dag_id=DAG)) is None
    other_dag = SimpleNamespace(conf=SPEC.sign(KEY), run_id=SPEC.batch_id, dag_id="another_batch_dag")
    assert verify(other_dag) is None


@pytest.mark.parametrize(
    ("setting", "named"),
    [("OPENAI_FILES_URI", "openai_files_uri"), ("OPENAI_SIGNING_KEY", "openai_signing_key")],
)
def test_a_worker_without_the_apis_settings_fails_the_batch_naming_the_setting(
    operator, monkeypatch, setting, named
):
    monkeypatch.setenv(f"AIRFLOW__VLLM_BATCH__{setting}", "")
    with pytest.raises(AirflowFailException, match=rf"\[vllm_batch\] {named}"):
        operator.execute(run(SPEC.sign(KEY)))
    assert operator.output_uri == UNBOUND


class Head:
    """A hook whose input copy has the ETag ``etag`` (None: gone); records the failure records written."""

    def __init__(self, etag):
        self.etag, self.written = etag, {}
        self.exceptions = SimpleNamespace(ClientError=Exception)

    def get_conn(self):
        return self

    def head_object(self, *, Bucket, Key):
        from botocore.exceptions import ClientError

        if self.etag is None:
            raise ClientError({"Error": {"Code": "404"}}, "HeadObject")
        return {"ETag": f'"{self.etag}"'}

    def get_object(self, *, Bucket, Key):
        from botocore.exceptions import ClientError

        raise ClientError(
            {"Error": {"Code": "NoSuchKey"}}, "GetObject"
        )  # no manifest: the batch has not ended

    def delete_object(self, *, Bucket, Key):
        pass

    def load_bytes(self, data, key, bucket_name, replace):
        self.written[key] = data


@pytest.mark.parametrize(("etag", "why"), [("another", "not the one made at create"), (None, "gone")])
def test_a_batch_whose_input_copy_changed_fails_without_running_and_says_so(monkeypatch, etag, why):
    import json

    from airflow_vllm_batch.operators.vllm_batch import VLLMBatchOperator

    hook = Head(etag)
    monkeypatch.setattr(OpenAIBatchOperator, "hook", property(lambda self: hook))
    monkeypatch.setattr(VLLMBatchOperator, "execute", lambda self, context: pytest.fail("the batch ran"))
    operator = OpenAIBatchOperator(task_id="vllm_batch", model="m")
    with pytest.raises(AirflowFailException, match=why):
        operator.execute(run(SPEC.sign(KEY)))
    (record,) = hook.written.values()
    assert why in json.loads(record)["errors"][0]["message"]
