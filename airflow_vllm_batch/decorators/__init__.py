"""TaskFlow decorators of the provider: ``@task.vllm_batch`` (registered under ``task-decorators``)."""
