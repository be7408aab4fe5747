"""Who may do what: files are their uploader's; batches are their creator's, within the batch DAG's permissions.

The auth manager answers for the batch DAG: creating a batch needs permission to trigger
its runs (``POST`` on its DAG runs), seeing one to read them (``GET``), cancelling one to
change them (``PUT``). On top of that a user sees only batches they created and files they
uploaded (or their batches made): another user's are not listed and answer 404, as an
unknown id does, so ids cannot be probed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Literal

Method = Literal["GET", "POST", "PUT"]


def owner_key(user_id: str) -> str:
    """The S3 key segment of a user's files: a digest, so that any user id makes a safe, fixed-length key."""
    return hashlib.sha256(user_id.encode()).hexdigest()[:24]


def owns(conf: Mapping[str, Any] | None, user_id: str) -> bool:
    """Whether the batch whose DAG run has this conf was created by ``user_id``."""
    return bool(conf and conf.get("owner") == user_id)


def may(user: Any, method: Method, dag_id: str) -> bool:
    """Whether the auth manager lets ``user`` act with ``method`` on the DAG runs of ``dag_id``."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails

    return get_auth_manager().is_authorized_dag(
        method=method, access_entity=DagAccessEntity.RUN, details=DagDetails(id=dag_id), user=user
    )
