"""The "vLLM batch output" extra link: a button from the task to its results object.

Airflow 3 way, as amazon's ``BaseAwsLink``: during ``execute`` the operator stores the
output's bucket and key in XCom (:meth:`VLLMBatchOutputLink.persist`); when the task
finishes, the task runner calls :meth:`VLLMBatchOutputLink.get_link` on the worker and
stores the formatted URL under the link's ``xcom_key``, which is what the UI shows.
So the URL template is read on the worker, from the worker's configuration.

The URL comes from a template formatted with ``{bucket}`` and ``{key}`` (the key
percent-encoded, ``/`` kept), taken from, in order:

1. Airflow config ``[vllm_batch] output_link_template`` (or the environment variable
   ``AIRFLOW__VLLM_BATCH__OUTPUT_LINK_TEMPLATE``), e.g. a SeaweedFS filer
   ``http://localhost:8888/buckets/{bucket}/{key}`` or a MinIO console;
2. for a connection with its own ``endpoint_url`` (MinIO, SeaweedFS, Ceph...), the
   object's path-style URL on that endpoint: the AWS console knows nothing of that store;
3. the AWS S3 console, :data:`DEFAULT_OUTPUT_LINK_TEMPLATE`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

from airflow_vllm_batch.version_compat import conf

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator, Context

    from airflow_vllm_batch.version_compat import TaskInstanceKey

log = logging.getLogger(__name__)

#: The AWS S3 console page of one object.
DEFAULT_OUTPUT_LINK_TEMPLATE = "https://s3.console.aws.amazon.com/s3/object/{bucket}?prefix={key}"
#: Config section and option of the template; the env var is AIRFLOW__VLLM_BATCH__OUTPUT_LINK_TEMPLATE.
CONFIG_SECTION = "vllm_batch"
CONFIG_OPTION = "output_link_template"


def output_link_template() -> str:
    """Return the configured URL template, or the AWS S3 console's when none is set."""
    return conf.get(CONFIG_SECTION, CONFIG_OPTION, fallback=None) or DEFAULT_OUTPUT_LINK_TEMPLATE


def format_output_link(bucket: str, key: str, template: str | None = None) -> str:
    """Return the URL of an output object.

    :param bucket: the bucket.
    :param key: the object key; percent-encoded into the URL, ``/`` kept.
    :param template: a URL with ``{bucket}`` and ``{key}``. Default: :func:`output_link_template`.
    :raises KeyError: if the template names a placeholder other than bucket and key.
    """
    # A key is free text (spaces, '+', '#', '?'); unencoded it would change the URL's meaning.
    return (template or output_link_template()).format(
        bucket=quote(bucket, safe=""), key=quote(key, safe="/")
    )


class VLLMBatchOutputLink(BaseOperatorLink):
    """Link from a ``VLLMBatchOperator`` task to its output object (S3 console or a configured URL)."""

    name = "vLLM batch output"
    #: XCom key of what :meth:`persist` stores: ``{"bucket": ..., "key": ...}``.
    key: ClassVar[str] = "vllm_batch_output_link"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        """Return the output's URL, or ``""`` when the task stored none (it failed before publishing).

        :param operator: the task's operator.
        :param ti_key: the task instance to return the link for.
        """
        # The task runner's XCom (custom backends included); imported here, not when DAG files are parsed.
        from airflow.sdk.execution_time.xcom import XCom

        # A link must never break the task or the UI: any failure is an empty link.
        try:
            stored: dict[str, Any] | None = XCom.get_value(key=self.key, ti_key=ti_key)
            if not stored:
                return ""
            template = conf.get(CONFIG_SECTION, CONFIG_OPTION, fallback=None)
            if not template and stored.get("endpoint_url"):
                template = stored["endpoint_url"].rstrip("/") + "/{bucket}/{key}"
            return format_output_link(stored["bucket"], stored["key"], template)
        except Exception:
            log.warning("Could not build the %r link of %s", self.name, ti_key, exc_info=True)
            return ""

    @classmethod
    def persist_empty(cls, *, context: Context) -> None:
        """Store "no output yet", so that a task failing before publishing has an empty link, not an error."""
        try:
            context["ti"].xcom_push(key=cls.key, value=None)
        except Exception:
            log.warning("Could not reset the %r link", cls.name, exc_info=True)

    @classmethod
    def persist(cls, *, context: Context, output_uri: str, endpoint_url: str | None = None) -> None:
        """Store where the output is, for :meth:`get_link`; call it from ``execute`` once published.

        Only the bucket, key and S3 endpoint are stored (never a URL with credentials), so
        the link follows the template configured when the task finishes.

        A failure here is logged, not raised: the results are already published, and a
        missing button is no reason to fail (and retry) the task.

        :param context: the task's context (its ``ti`` pushes the XCom).
        :param output_uri: ``s3://bucket/key`` of the published results.
        :param endpoint_url: the S3 endpoint of the connection, when it is not AWS's.
        """
        try:
            # Imported here: the links module is loaded by the API server, which needs no S3 code.
            from airflow_vllm_batch.storage.s3 import split_s3_uri

            bucket, key = split_s3_uri(output_uri, "output_uri")
            value = {"bucket": bucket, "key": key}
            if endpoint_url:
                value["endpoint_url"] = endpoint_url
            context["ti"].xcom_push(key=cls.key, value=value)
        except Exception:
            log.warning("Could not store the %r link of %s", cls.name, output_uri, exc_info=True)
