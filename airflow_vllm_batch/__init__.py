"""Apache Airflow provider for vLLM offline batch inference on OpenAI-batch JSONL in S3."""

from __future__ import annotations

__version__ = "0.1.0"
