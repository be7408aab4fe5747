"""What differs between the Airflow 3 minors this provider supports, in one place.

The version flags follow apache/airflow's own providers (``AIRFLOW_V_3_x_PLUS``); the
rest of the package imports these names from here, never from the versioned paths. Each
name comes from the Task SDK where the running Airflow has it there, else from where
Airflow 3.0 kept it:

========================  ============================  ==========================================
name                      Task SDK path, since           Airflow 3.0 path
========================  ============================  ==========================================
``BaseHook``              ``airflow.sdk`` (3.1)          ``airflow.hooks.base``
``conf``                  ``airflow.sdk`` (3.2)          ``airflow.configuration``
``AirflowFailException``  ``airflow.sdk.exceptions``     ``airflow.exceptions``
                          (3.2)
``AirflowTaskTimeout``    ``airflow.sdk.exceptions``     ``airflow.exceptions``
                          (3.2)
``TaskInstanceKey``       ``airflow.sdk.types`` (3.2)    ``airflow.models.taskinstancekey``
                                                         (type hints only)
``determine_kwargs``      ``airflow.sdk.bases``          ``airflow.utils.operator_helpers``
                          ``.decorator``
========================  ============================  ==========================================
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING


@functools.cache
def get_base_airflow_version_tuple() -> tuple[int, int, int]:
    """Return the running Airflow's ``(major, minor, micro)``, pre-release and local parts dropped."""
    from airflow import __version__
    from packaging.version import Version

    version = Version(__version__)
    return version.major, version.minor, version.micro


AIRFLOW_V_3_1_PLUS: bool = get_base_airflow_version_tuple() >= (3, 1, 0)
AIRFLOW_V_3_2_PLUS: bool = get_base_airflow_version_tuple() >= (3, 2, 0)

if AIRFLOW_V_3_1_PLUS:
    from airflow.sdk import BaseHook
else:
    from airflow.hooks.base import BaseHook  # type: ignore[attr-defined,no-redef]  # Airflow 3.0 only

if AIRFLOW_V_3_2_PLUS:
    from airflow.sdk import conf
    from airflow.sdk.exceptions import AirflowFailException, AirflowTaskTimeout
else:
    from airflow.configuration import conf  # type: ignore[assignment]  # Airflow < 3.2: core's parser
    from airflow.exceptions import AirflowFailException, AirflowTaskTimeout  # type: ignore[no-redef]

try:
    from airflow.sdk.bases.decorator import determine_kwargs
except ImportError:  # Airflow 3.0 kept it with the operator helpers
    from airflow.utils.operator_helpers import determine_kwargs

if TYPE_CHECKING:
    # For annotations only: 3.0's module imports Airflow's ORM models.
    if AIRFLOW_V_3_2_PLUS:
        # Re-exported for annotations (links/output.py imports it under TYPE_CHECKING too).
        from airflow.sdk.types import TaskInstanceKey
    else:
        from airflow.models.taskinstancekey import TaskInstanceKey  # type: ignore[assignment]  # noqa: F401

__all__ = [
    "AIRFLOW_V_3_1_PLUS",
    "AIRFLOW_V_3_2_PLUS",
    "AirflowFailException",
    "AirflowTaskTimeout",
    "BaseHook",
    "conf",
    "determine_kwargs",
    "get_base_airflow_version_tuple",
]
