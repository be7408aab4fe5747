"""The storage layer: everything a batch keeps in S3 beside its output.

Its modules, each with one reason to change:

- :mod:`~airflow_vllm_batch.storage.layout`: where each object of an output lives (the names);
- :mod:`~airflow_vllm_batch.storage.s3`: the S3 primitives (URIs, uploads, copies, reads,
  deletes, S3's errors);
- :mod:`~airflow_vllm_batch.storage.staging`: one run's staging prefix (:class:`RunStaging`);
- :mod:`~airflow_vllm_batch.storage.publishing`: the publish protocol and the manifest's
  writes and reads (:class:`OutputStore`);
- :mod:`~airflow_vllm_batch.storage.answers`: a published batch's answers, read pinned.

Only :func:`read_answers` is re-exported here: it is the users' entry point
(``airflow_vllm_batch.storage.read_answers`` in the README, the example DAGs and the message
:func:`airflow_vllm_batch.batchfile.read_answers` gives for an ``s3://`` URI). The package's
own modules import each name from the module that holds it, so that the layering test sees
the real dependencies.
"""

from __future__ import annotations

from airflow_vllm_batch.storage.answers import read_answers

__all__ = ["read_answers"]
