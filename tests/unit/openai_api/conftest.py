"""The OpenAI API's unit tests run with a signing key and a files URI, as a deployment has them."""

from __future__ import annotations

import pytest

from airflow_vllm_batch.version_compat import AIRFLOW_V_3_1_PLUS

#: The signing key of the unit tests (what ``[vllm_batch] openai_signing_key`` holds in a deployment).
KEY = "k" * 40
FILES_URI = "s3://b/p/"
#: For the tests that read the batch DAG's runs as the API does (:mod:`airflow_vllm_batch.openai_api.batch_runs`):
#: on Airflow 3.0 (the floor) the API does not exist and those reads refuse, saying so (test_plugin.py checks that).
needs_batch_runs = pytest.mark.skipif(
    not AIRFLOW_V_3_1_PLUS, reason="the OpenAI API reads the batch DAG's runs on Airflow 3.1 or later only"
)


@pytest.fixture(autouse=True)
def signing_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY", KEY)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_FILES_URI", FILES_URI)
    # The default batch cap (auto) reads the batch DAG's max_active_runs from Airflow's database, which
    # these tests stand in for; test_limits.py sets it back to auto where it is the subject.
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__OPENAI_MAX_USER_ACTIVE_BATCHES", "0")
    return KEY


class DictS3:
    """A boto3 S3 client over a dict of key to bytes: what the status reads (get, head) of a store without S3.

    :param objects: the objects, by key (one bucket).
    """

    def __init__(self, objects: dict[str, bytes] | None = None) -> None:
        from types import SimpleNamespace

        from botocore.exceptions import ClientError

        self.objects = objects if objects is not None else {}
        self.exceptions = SimpleNamespace(ClientError=ClientError)

    def _missing(self, operation: str) -> Exception:
        from botocore.exceptions import ClientError

        return ClientError({"Error": {"Code": "NoSuchKey" if operation == "GetObject" else "404"}}, operation)

    def get_object(self, *, Bucket: str, Key: str) -> dict:
        import io

        if Key not in self.objects:
            raise self._missing("GetObject")
        return {"Body": io.BytesIO(self.objects[Key])}

    def head_object(self, *, Bucket: str, Key: str) -> dict:
        import hashlib

        if Key not in self.objects:
            raise self._missing("HeadObject")
        return {"ETag": f'"{hashlib.md5(self.objects[Key]).hexdigest()}"'}


class AllowingAuthManager:
    """A stand-in auth manager that grants the API's resource to every user, and records what it was asked."""

    def __init__(self, allowed: bool = True) -> None:
        self.allowed = allowed
        self.asked: list[tuple[str, str, str]] = []

    def is_authorized_custom_view(self, *, method: str, resource_name: str, user) -> bool:
        self.asked.append((method, resource_name, user.get_name()))
        return self.allowed


@pytest.fixture(autouse=True)
def auth_manager(monkeypatch: pytest.MonkeyPatch) -> AllowingAuthManager:
    """The auth manager the API asks (:func:`airflow_vllm_batch.openai_api.access.may_use`): one that allows, by default."""
    import airflow.api_fastapi.app as api_app

    manager = AllowingAuthManager()
    # Where the API looks it up at each call (3.0, the floor, has no _AuthManagerState to set).
    monkeypatch.setattr(api_app, "get_auth_manager", lambda: manager)
    return manager
