"""Airflow names the tests use whose home moved between the Airflow 3 minors the provider supports.

The provider's own are in :mod:`airflow_vllm_batch.version_compat`; these are the test
helpers' (loading, serializing and redacting as Airflow does), so that the unit tests run
on the floor (Airflow 3.0) too. The newer path first; Airflow 3.0's where it is missing.
"""

from __future__ import annotations

try:
    from airflow.dag_processing.dagbag import DagBag
except ImportError:  # Airflow 3.0
    from airflow.models.dagbag import DagBag  # type: ignore[no-redef]

try:
    from airflow.serialization.serialized_objects import DagSerialization
except ImportError:  # Airflow 3.0: the same to_dict/from_dict on SerializedDAG
    from airflow.serialization.serialized_objects import SerializedDAG as DagSerialization  # type: ignore[no-redef]

try:
    from airflow.sdk.log import redact
except ImportError:  # Airflow 3.0
    from airflow.sdk.execution_time.secrets_masker import redact  # type: ignore[no-redef]

try:
    from airflow.sdk.types import TaskInstanceKey
except ImportError:  # Airflow 3.0
    from airflow.models.taskinstancekey import TaskInstanceKey  # type: ignore[no-redef]

__all__ = ["DagBag", "DagSerialization", "TaskInstanceKey", "redact"]
