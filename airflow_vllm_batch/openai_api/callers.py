"""Who calls a route of the OpenAI API: the user of Airflow's token, let in by the API's own rule (:func:`.access.may_use`).

Each route takes its caller as one of :data:`Reader`, :data:`Creator`, :data:`Canceller` or
:data:`Deleter`: a FastAPI dependency that resolves the user with Airflow's own
``get_user`` (401 without a token) and answers 403, in OpenAI's shape, when the rule refuses
that user the route's method. No route needs any permission on the batch DAG.
"""

from __future__ import annotations

from typing import Annotated, Any

from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.core_api.security import GetUserDep  # noqa: TC002 - FastAPI reads the annotation at runtime
from fastapi import Depends

from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.openai_api.access import FAB_ACTIONS, RESOURCE_NAME, Method, may_use
from airflow_vllm_batch.openai_api.errors import OpenAIError

#: What each method lets a user do, for the 403's message.
DOING = {
    "GET": "read files and batches",
    "POST": "upload files or create batches",
    "PUT": "cancel batches",
    "DELETE": "delete files",
}


def _api_user(method: Method) -> Any:
    """A dependency: the caller (Airflow's token), if the API's rule lets them use it with ``method``; 403 otherwise."""

    def allowed(user: GetUserDep) -> BaseUser:
        try:
            ok = may_use(user, method)
        except ConfigurationError as err:
            raise OpenAIError(503, str(err)) from None
        if not ok:
            raise OpenAIError(
                403,
                f"you may not {DOING[method]} with this API: ask your Airflow admin for {FAB_ACTIONS[method]!r} on "
                f"{RESOURCE_NAME!r} (FAB), or to be listed in [vllm_batch] openai_users",
            )
        return user

    return Depends(allowed)


Reader = Annotated[BaseUser, _api_user("GET")]
Creator = Annotated[BaseUser, _api_user("POST")]
Canceller = Annotated[BaseUser, _api_user("PUT")]
Deleter = Annotated[BaseUser, _api_user("DELETE")]
