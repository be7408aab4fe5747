"""The run layer: one batch from settings to manifest (:class:`~.batch.BatchRun`), settings checked once
(:class:`~.settings.BatchSettings`), the input (:mod:`.inputs`) and the worker's scratch space (:mod:`airflow_vllm_batch.scratch`).

It knows S3 and the engines' interface, not Airflow's task machinery: the operator feeds it
rendered settings and the task instance's identity, and turns its outcome into XCom.
"""

from __future__ import annotations

from airflow_vllm_batch.run.batch import BatchOutcome, BatchRun
from airflow_vllm_batch.run.settings import (
    AnswerCacheOptions,
    BatchSettings,
    InputLimits,
    check_static_settings,
)

__all__ = [
    "AnswerCacheOptions",
    "BatchOutcome",
    "BatchRun",
    "BatchSettings",
    "InputLimits",
    "check_static_settings",
]
