"""Rotating the signing key loses no batch: runs signed with an old key kept in ``openai_old_signing_keys`` still verify."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from airflow_vllm_batch.openai_api import app as app_module
from airflow_vllm_batch.openai_api.batch_dag import OpenAIBatchOperator, _chosen_route
from airflow_vllm_batch.openai_api.batch_spec import BatchSpec, verification_keys
from airflow_vllm_batch.version_compat import AirflowFailException
from tests.unit.openai_api.conftest import KEY, needs_batch_runs
from tests.unit.openai_api.test_batch_spec import DAG, SPEC, NoS3, run
from tests.unit.openai_api.test_cancel import BATCH, api  # noqa: F401 - the fixture

NEW = "n" * 40
#: The API's own lookup of a batch's run (the cancel fixture replaces it).
OWN_RUN = app_module._own_run


@pytest.fixture
def rotated(monkeypatch):
    """The deployment after a rotation: a new signing key, the one the batches were signed with kept as an old key."""
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY", NEW)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_OLD_SIGNING_KEYS", f"{'o' * 40}, {KEY}")


@pytest.fixture
def dropped(monkeypatch):
    """Later: the old key removed from the list."""
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY", NEW)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_OLD_SIGNING_KEYS", "o" * 40)


@pytest.fixture
def database(api, monkeypatch):  # noqa: F811 - the fixture
    """The batch's run found in the database as the API's own lookup does (find_run, its verifier): the cancel fixture's shortcut undone."""
    import contextlib

    import airflow.utils.session

    monkeypatch.setattr(app_module, "_own_run", OWN_RUN)

    class Session:
        def scalar(self, query):
            return api.state.run

        def scalars(self, query):
            return list(api.state.tis)

        def expunge_all(self):
            pass

    @contextlib.contextmanager
    def create_session():
        yield Session()

    monkeypatch.setattr(airflow.utils.session, "create_session", create_session)
    return api


def test_the_signing_key_comes_first_then_the_old_keys(rotated):
    assert verification_keys() == (NEW, "o" * 40, KEY)


def test_a_short_old_key_is_refused_naming_the_option(monkeypatch):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_OLD_SIGNING_KEYS", f"{KEY},short")
    with pytest.raises(Exception, match=r"openai_old_signing_keys: its key number 2 is shorter than 32"):
        verification_keys()


def test_new_batches_are_signed_with_the_new_key_only(rotated):
    assert app_module._signing_key() == NEW


def test_after_a_rotation_an_old_batch_is_still_listed_and_a_retry_of_its_run_verifies(rotated, monkeypatch):
    # Listed and shown: user_runs and find_run keep exactly the runs the request's verifier verifies.
    assert (
        app_module._verifier()(SimpleNamespace(conf=SPEC.sign(KEY), run_id=SPEC.batch_id, dag_id=DAG)) == SPEC
    )
    # A retry of the running batch: its task binds it, and the route task follows its route.
    monkeypatch.setattr(OpenAIBatchOperator, "hook", property(lambda self: NoS3()))
    operator = OpenAIBatchOperator(task_id="vllm_batch", model="m")
    operator._bind_batch(run(SPEC.sign(KEY)))
    assert operator.batch == SPEC
    routed = SPEC.__class__(**{**SPEC.__dict__, "route": "vllm_batch__qwen"})
    assert (
        _chosen_route(SimpleNamespace(conf=routed.sign(KEY), run_id=SPEC.batch_id, dag_id=DAG))
        == "vllm_batch__qwen"
    )
    # A batch made after the rotation verifies too, and an edited one still does not.
    assert BatchSpec.verified(SPEC.sign(NEW), SPEC.batch_id, verification_keys(), DAG) == SPEC
    forged = {**SPEC.sign(KEY), "owner": "mallory"}
    assert app_module._verifier()(SimpleNamespace(conf=forged, run_id=SPEC.batch_id, dag_id=DAG)) is None


@needs_batch_runs
def test_after_a_rotation_an_old_batch_is_shown_and_cancellable(rotated, database):
    batch = database
    batch.state.tis = [SimpleNamespace(task_id="vllm_batch", state="running", start_date=None, end_date=None)]
    shown = batch.http.get(f"/batches/{BATCH}")
    assert shown.status_code == 200, shown.json()
    assert shown.json()["status"] == "in_progress"
    cancelled = batch.http.post(f"/batches/{BATCH}/cancel")
    assert cancelled.status_code == 200, cancelled.json()
    assert cancelled.json()["status"] == "cancelling"


@needs_batch_runs
def test_once_its_key_is_removed_a_batch_is_hidden_and_its_run_fails_as_forged(
    dropped, database, monkeypatch
):
    batch = database
    assert (
        app_module._verifier()(SimpleNamespace(conf=SPEC.sign(KEY), run_id=SPEC.batch_id, dag_id=DAG)) is None
    )
    assert batch.http.get(f"/batches/{BATCH}").status_code == 404
    monkeypatch.setattr(OpenAIBatchOperator, "hook", property(lambda self: NoS3()))
    operator = OpenAIBatchOperator(task_id="vllm_batch", model="m")
    with pytest.raises(AirflowFailException, match="signature does not match"):
        operator._bind_batch(run(SPEC.sign(KEY)))
