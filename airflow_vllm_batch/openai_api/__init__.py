"""The OpenAI Files and Batches API on Airflow's API server: any OpenAI SDK submits batches that Airflow runs.

An Airflow plugin (:mod:`.plugin`) mounts a FastAPI app (:mod:`.app`) at
``<airflow>/vllm-batch/openai/v1``. Files live in S3 under ``[vllm_batch] openai_files_uri``
(:mod:`.files`), one prefix per user; a batch is a DAG run of the batch DAG
(``[vllm_batch] openai_batch_dag_id``, :mod:`.batch_dag` builds its task) whose status is
mapped to OpenAI's (:mod:`.status`). Who may do what is the auth manager's answer (:mod:`.access`).
"""
