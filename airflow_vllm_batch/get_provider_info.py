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
                    },
                    "stall_timeout": {
                        "description": "Seconds the batch runner (VLLMRunner) may make no progress (no new output "
                        "line, no higher count in its progress report, no other log line) before it is stopped and "
                        "the try fails as retryable, keeping the answers it wrote; 0: no bound. Read on the worker "
                        "when the task starts; VLLMRunner(stall_timeout=...) overrides it. Raise it when one request "
                        "may take longer.",
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": "3600",
                        "default": "1800",
                    },
                    "openai_files_uri": {
                        "description": "s3://bucket/prefix/ where the OpenAI Files and Batches API (the provider's "
                        "plugin, <airflow>/vllm-batch/openai/v1) keeps uploaded files and batch results, one prefix per "
                        "user. Read by the API server and by every worker that runs the batch DAG's task (it derives each "
                        "batch's locations from it): set the same value on both. Empty: the API answers 503 and every "
                        "batch task fails.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://my-bucket/openai/",
                        "default": "",
                    },
                    "openai_max_file_bytes": {
                        "description": "The largest file the OpenAI API accepts, in bytes (streamed to S3; never held "
                        "whole in the API server's memory).",
                        "version_added": "0.1.0",
                        "type": "integer",
                        "example": "1073741824",
                        "default": "209715200",
                    },
                    "openai_batch_dag_id": {
                        "description": "The DAG a batch created through the OpenAI API runs as (one DAG run per batch); "
                        "build it with airflow_vllm_batch.openai_api.batch_dag.openai_batch_dag.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "vllm_batch_openai",
                        "default": "vllm_batch_openai",
                    },
                    "openai_aws_conn_id": {
                        "description": "The AWS connection the API server reaches openai_files_uri with.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "aws_default",
                        "default": "aws_default",
                    },
                    "openai_completion_windows": {
                        "description": "The completion_window values POST /batches accepts, comma-separated (e.g. "
                        "24h,72h); any other is refused with 400 listing these. A batch expires at created_at plus its "
                        "window. Empty: 24h, OpenAI's only window.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "24h,72h",
                        "default": "",
                    },
                    "openai_users": {
                        "description": "Who may use the OpenAI API: user names separated by commas, or * for every "
                        "signed-in user the auth manager grants the API's resource (VLLM Batch OpenAI API). Under the "
                        "simple auth manager, which grants that resource to every role, this list is the rule: keep API "
                        "users at role viewer (which changes no DAG run) and list them here. Under FAB the role's "
                        "permission on the resource decides, and a list narrows it further.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "alice,bob",
                        "default": "*",
                    },
                    "openai_signing_key": {
                        "description": "The key the OpenAI API signs each batch run's conf with (HMAC-SHA256) and the "
                        "batch task verifies it with: a run the API did not make, or whose conf was edited, fails before "
                        "it reads or writes anything. Set the same random value (32 characters or more) on the API server "
                        "and on every worker that runs the batch DAG; as a sensitive option it may also come from the "
                        "secrets backend (AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY_SECRET) or a command (..._CMD). Empty: "
                        "POST /batches answers 503 and batch runs fail.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "sensitive": True,
                        "example": None,
                        "default": "",
                    },
                    "openai_old_signing_keys": {
                        "description": "Earlier values of openai_signing_key, comma-separated, whose batches stay "
                        "valid: a batch run signed with one of them is still listed, shown, cancellable and retried. "
                        "New batches are signed with openai_signing_key only. To rotate, move the old key here and set a "
                        "new openai_signing_key, alike on the API server and every worker; remove an old key once its "
                        "batches are no longer wanted (they are then hidden, and their runs fail as forged ones). Each "
                        "key 32 characters or more.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "sensitive": True,
                        "example": None,
                        "default": "",
                    },
                    "openai_media_domains": {
                        "description": "The hosts whose http(s) media URLs (image_url, audio_url, video_url parts of a "
                        "chat message) an API batch may carry, comma-separated: the workers fetch them from their "
                        "network. A batch with a media URL of another host, or of another scheme than http(s) and data:, "
                        "fails before any engine starts, naming its lines. Empty: no http(s) media URL (data: URLs only). "
                        "Read by the workers that run the batch DAG.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "images.example.com,cdn.example.com",
                        "default": "",
                    },
                    "openai_max_user_files": {
                        "description": "The most uploaded files one user of the OpenAI API may keep; an upload over it is "
                        "answered 429 (code files_limit_exceeded). 0: no limit.",
                        "version_added": "0.1.0",
                        "type": "integer",
                        "example": "100",
                        "default": "0",
                    },
                    "openai_max_user_bytes": {
                        "description": "The most bytes of uploaded files one user of the OpenAI API may keep; an upload "
                        "over it is answered 429 (code bytes_limit_exceeded) and nothing is kept. 0: no limit.",
                        "version_added": "0.1.0",
                        "type": "integer",
                        "example": "10737418240",
                        "default": "0",
                    },
                    "openai_max_user_active_batches": {
                        "description": "The most batches one user may have that have not ended (validating, in_progress, "
                        "finalizing, cancelling); POST /batches over it is answered 429 (code batches_limit_exceeded). "
                        "auto (the default): half the batch DAG's max_active_runs, at least 1, so that one user's burst "
                        "leaves the other run slots to the others' batches. 0: no limit.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "2",
                        "default": "auto",
                    },
                    "openai_max_user_enqueued_requests": {
                        "description": "The most requests (input lines) one user's batches that have not ended may hold "
                        "together; POST /batches over it is answered 429 (code requests_limit_exceeded). 0: no limit.",
                        "version_added": "0.1.0",
                        "type": "integer",
                        "example": "100000",
                        "default": "0",
                    },
                    "openai_models": {
                        "description": "JSON mapping each model name the OpenAI API serves to its engine: a warm "
                        "fleet's vllm connection ({\"vllm_conn_id\": ...}; the key is a name in the fleet's /v1/models) "
                        'or the runner on a queue ({"queue": "gpu", "engine_args": [...]}; the key is passed as the '
                        "runner's --model, so it is a model path or Hugging Face repo id). Read by the API server (a "
                        "batch naming another model is refused), by the dag-processor when it parses the batch DAG "
                        "file (one task per model) and by the workers that run it: set it alike on all of them. "
                        "Empty: one model, the batch DAG's.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": '{"qwen-1.5b": {"vllm_conn_id": "vllm_qwen"}, '
                        '"meta-llama/Llama-3.1-70B-Instruct": {"queue": "gpu"}}',
                        "default": "",
                    },
                },
            }
        },
        "hooks": [
            {
                "integration-name": "vLLM Batch",
                "python-modules": ["airflow_vllm_batch.hooks.vllm"],
            }
        ],
        "connection-types": [
            {
                "hook-class-name": "airflow_vllm_batch.hooks.vllm.VLLMServerHook",
                "connection-type": "vllm",
            }
        ],
    }
