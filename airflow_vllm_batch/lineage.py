"""OpenLineage datasets of a vLLM batch task: what it read and what it published.

The operator's ``get_openlineage_facets_on_complete`` returns :func:`lineage_for`. The
OpenLineage provider is optional: it is imported only when this function runs, which
happens only when that provider is installed (its listener is what calls the method).

Dataset naming follows the OpenLineage spec, as Airflow's own providers do:

========================  ==========================  ==================
location                  namespace                   name
========================  ==========================  ==================
``s3://bucket/key``       ``s3://bucket``             ``key``
``/local/path``           ``file``                    the absolute path
``https://host:port/p``   ``https://host:port``       ``/p``
========================  ==========================  ==================

An http(s) URL loses its query string and any user info: a presigned URL carries its
signature there, and lineage events leave Airflow.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from airflow.providers.common.compat.openlineage.facet import Dataset
    from airflow.providers.openlineage.extractors import OperatorLineage


def dataset_name(uri: str) -> tuple[str, str]:
    """Return the OpenLineage ``(namespace, name)`` of an input or output location.

    :param uri: ``s3://bucket/key``, an http(s) URL, a ``file://`` URI or a local path.
    """
    parts = urlsplit(uri)
    if parts.scheme == "s3":
        return f"s3://{parts.netloc}", parts.path.lstrip("/")
    if parts.scheme in ("http", "https"):
        # hostname/port, not netloc: netloc may hold "user:password@".
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        return f"{parts.scheme}://{host}", parts.path or "/"
    if parts.scheme == "file":
        return (f"file://{parts.netloc}" if parts.netloc else "file"), parts.path
    return "file", os.path.abspath(uri)


def _dataset(uri: str) -> Dataset:
    from airflow.providers.common.compat.openlineage.facet import Dataset

    namespace, name = dataset_name(uri)
    return Dataset(namespace=namespace, name=name)


def lineage_for(input_uri: str | None, output_uri: str, error_uri: str | None) -> OperatorLineage:
    """Return the lineage of one batch run: the input file in, the results (and error file) out.

    :param input_uri: the batch file the task read; None when it failed before writing
        the file of its ``requests``.
    :param output_uri: the published results, ``s3://bucket/key``.
    :param error_uri: the published error file, or None when no line failed (no file
        was written, so it is no output).
    """
    from airflow.providers.openlineage.extractors import OperatorLineage

    outputs = [_dataset(output_uri)]
    if error_uri:
        outputs.append(_dataset(error_uri))
    return OperatorLineage(inputs=[_dataset(input_uri)] if input_uri else [], outputs=outputs)
