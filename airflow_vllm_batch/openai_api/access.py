"""Who may do what: the API's own permission decides who may use it; files are their uploader's, batches their creator's.

An API user holds no permission on the batch DAG: the API itself triggers, reads and
cancels its runs (a cancel writes an S3 record the run reads under its lease). Who may use
the API is decided here, by one rule for every endpoint (:func:`may_use`):

- the auth manager's permission on the API's own resource, :data:`RESOURCE_NAME`
  (``is_authorized_custom_view``): under FAB a permission of its own (``can_read`` for
  reads, ``can_create`` to upload or create, ``can_edit`` to cancel, ``can_delete`` to delete
  a file), which a role is given as any other;
- and ``[vllm_batch] openai_users``: the user names that may use the API, or ``*`` (the
  default) for every signed-in user the auth manager allows. The simple auth manager grants
  every custom resource to every role (viewer and up), and its roles must stay ``viewer``
  for users not to change each other's DAG runs, so a role cannot say who may use the API
  there: a list of names can.

On top of that a user sees only batches they created and files they uploaded (or their
batches made): another user's are not listed and answer 404, as an unknown id does, so ids
cannot be probed.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any, Literal

from airflow_vllm_batch.exceptions import ConfigurationError

log = logging.getLogger(__name__)

Method = Literal["GET", "POST", "PUT", "DELETE"]

#: The auth manager resource of the API (under FAB: the resource its role's permissions name).
RESOURCE_NAME = "VLLM Batch OpenAI API"
#: FAB's action for each method the API asks about (FAB's own map: reads, creates, cancels, deletes).
FAB_ACTIONS = {"GET": "can_read", "POST": "can_create", "PUT": "can_edit", "DELETE": "can_delete"}
SIMPLE_AUTH_MANAGER = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
FAB_AUTH_MANAGER = "airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager"


def owner_key(user_id: str) -> str:
    """The S3 key segment of a user's files: a digest, so that any user id makes a safe, fixed-length key."""
    return hashlib.sha256(user_id.encode()).hexdigest()[:24]


def owns(conf: Mapping[str, Any] | None, user_id: str) -> bool:
    """Whether the batch whose DAG run has this conf was created by ``user_id``."""
    return bool(conf and conf.get("owner") == user_id)


def parse_users(raw: str) -> frozenset[str] | None:
    """The user names of ``[vllm_batch] openai_users`` (comma-separated); None for ``*``, every user.

    :raises ConfigurationError: the option is empty, or mixes ``*`` with names.
    """
    names = [name.strip() for name in raw.split(",") if name.strip()]
    if names == ["*"]:
        return None
    if not names or "*" in names:
        raise ConfigurationError(
            f"[vllm_batch] openai_users is {raw!r}: give the user names that may use the OpenAI API, separated by "
            "commas, or * for every signed-in user (AIRFLOW__VLLM_BATCH__OPENAI_USERS)"
        )
    return frozenset(names)


def load_users() -> frozenset[str] | None:
    """``[vllm_batch] openai_users``, parsed (:func:`parse_users`); ``*`` when unset."""
    from airflow_vllm_batch.version_compat import conf

    return parse_users(conf.get("vllm_batch", "openai_users", fallback="*") or "*")


def may_use(user: Any, method: Method) -> bool:
    """Whether ``user`` may call the API with ``method``: listed in ``openai_users`` and allowed the API's resource.

    :param user: the user Airflow's token resolved to.
    :param method: ``GET`` to read, ``POST`` to upload or create, ``PUT`` to cancel, ``DELETE`` to delete.
    :raises ConfigurationError: ``openai_users`` is malformed.
    """
    from airflow.api_fastapi.app import get_auth_manager

    users = load_users()
    if users is not None and user.get_name() not in users:
        return False
    return bool(
        get_auth_manager().is_authorized_custom_view(method=method, resource_name=RESOURCE_NAME, user=user)
    )


def class_path(manager: Any) -> str:
    kind = type(manager)
    return f"{kind.__module__}.{kind.__qualname__}"


def isolation_gaps(manager_class: str, all_admins: bool) -> list[str]:
    """What a deployment's auth manager cannot keep apart between API users (empty: nothing known).

    :param manager_class: the auth manager's class path.
    :param all_admins: ``[core] simple_auth_manager_all_admins``.
    """
    if manager_class == SIMPLE_AUTH_MANAGER:
        if all_admins:
            return [
                "[core] simple_auth_manager_all_admins is on: every request is the same admin user, so the "
                "OpenAI API cannot tell users apart (each sees and cancels every batch) and anyone can change "
                "every DAG run; turn it off and give API users role viewer"
            ]
        return [
            "the simple auth manager's roles are global: every role reads every DAG run's conf and task logs, "
            "and role user or above may change any batch run; give API users role viewer, or use FAB (see the "
            "OpenAI API docs' trust model)"
        ]
    if manager_class == FAB_AUTH_MANAGER:
        return []
    return [
        f"the auth manager {manager_class} is not one the OpenAI API knows: it asks it for the custom view "
        f"{RESOURCE_NAME!r}, but cannot tell whether API users may read or change each other's batch runs "
        "through Airflow's own API; check its roles against the OpenAI API docs' trust model"
    ]


def warn_if_not_isolated() -> None:
    """Log a warning for each way this deployment's configuration cannot isolate API users (called once, when the app is built)."""
    from airflow.api_fastapi.app import get_auth_manager

    from airflow_vllm_batch.version_compat import conf

    try:
        manager = get_auth_manager()
    except Exception as err:  # noqa: BLE001 - a warning is no reason to fail the API's start
        log.warning("The OpenAI API could not check its auth manager: %s", err)
        return
    all_admins = conf.getboolean("core", "simple_auth_manager_all_admins", fallback=False)
    for gap in isolation_gaps(class_path(manager), all_admins):
        log.warning("The OpenAI API cannot isolate users: %s.", gap)


def register_fab_permissions() -> None:
    """Under FAB, create the API's resource and its four permissions, so that roles can be given them.

    FAB's ``airflow roles add-perms`` and ``[fab] custom_roles`` refuse a resource that does
    not exist; nothing else creates a plugin's. Idempotent (FAB's own ``create_permission``),
    and a no-op under any other auth manager. A failure is logged, never raised: the API works
    without it, only the roles cannot be granted yet.
    """
    from airflow.api_fastapi.app import get_auth_manager

    try:
        if class_path(get_auth_manager()) != FAB_AUTH_MANAGER:
            return
        from airflow.providers.fab.www.security_appless import ApplessAirflowSecurityManager
        from airflow.utils.session import create_session

        with create_session() as session:
            manager = ApplessAirflowSecurityManager(session=session)
            for action in FAB_ACTIONS.values():
                manager.create_permission(action, RESOURCE_NAME)
    except Exception as err:  # noqa: BLE001 - the API works without it; the roles cannot name it yet
        log.warning("The OpenAI API could not register its FAB permissions on %r: %s", RESOURCE_NAME, err)
