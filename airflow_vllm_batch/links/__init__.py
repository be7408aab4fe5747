"""Operator extra links of the provider: buttons on the task instance page."""

from __future__ import annotations

from airflow_vllm_batch.links.output import VLLMBatchOutputLink

__all__ = ["VLLMBatchOutputLink"]
