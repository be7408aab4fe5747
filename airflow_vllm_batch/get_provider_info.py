"""Provider metadata read by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    """Return the provider's metadata.

    ``package-name`` must equal the distribution name, or every ``airflow`` command fails.
    """
    return {
        "package-name": "airflow-vllm-batch",
        "name": "vLLM Batch",
        "description": "Run vLLM offline batch inference on OpenAI-batch-format JSONL files in S3.",
        "versions": ["0.1.0"],
        "integrations": [
            {
                "integration-name": "vLLM Batch",
                "external-doc-url": "https://docs.vllm.ai/",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "vLLM Batch",
                "python-modules": [
                    "airflow_vllm_batch.operators.vllm_batch",
                    "airflow_vllm_batch.operators.shards",
                ],
            }
        ],
        "task-decorators": [
            {"class-name": "airflow_vllm_batch.decorators.vllm_batch.vllm_batch_task", "name": "vllm_batch"},
        ],
        "extra-links": ["airflow_vllm_batch.links.output.VLLMBatchOutputLink"],
        "config": {
            "vllm_batch": {
                "description": "Settings of the airflow-vllm-batch provider.",
                "options": {
                    "output_link_template": {
                        "description": 'URL of the "vLLM batch output" extra link, formatted with {bucket} '
                        "and {key} (the key percent-encoded). Read on the worker when the task finishes. "
                        "Empty: the object on the AWS connection's endpoint_url when it has one, else the "
                        "AWS S3 console.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "http://localhost:8888/buckets/{bucket}/{key}",
                        # Empty: the AWS S3 console, or the object on a connection's own endpoint_url.
                        "default": "",
                    }
                },
            }
        },
        "hooks": [
            {
                "integration-name": "vLLM Batch",
                "python-modules": [
                    "airflow_vllm_batch.hooks.vllm_engine",
                    "airflow_vllm_batch.hooks.vllm_server",
                ],
            }
        ],
        "connection-types": [
            {
                "hook-class-name": "airflow_vllm_batch.hooks.vllm_server.VLLMServerHook",
                "connection-type": "vllm",
            }
        ],
    }
