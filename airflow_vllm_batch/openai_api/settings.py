"""The OpenAI API's settings, read from Airflow's configuration (section ``[vllm_batch]``)."""

from __future__ import annotations

from dataclasses import dataclass

from airflow_vllm_batch.exceptions import ConfigurationError
from airflow_vllm_batch.openai_api.files import split_files_uri

SECTION = "vllm_batch"
#: OpenAI's own limit on a batch input file.
DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024
DEFAULT_BATCH_DAG_ID = "vllm_batch_openai"
#: The completion windows accepted by default: OpenAI's only one.
DEFAULT_COMPLETION_WINDOWS = ("24h",)
#: The URL prefix the plugin mounts its app at; the SDK's ``base_url`` is ``<airflow>`` + this.
URL_PREFIX = "/vllm-batch/openai/v1"


@dataclass(frozen=True)
class OpenAIApiSettings:
    """What the OpenAI API needs from the configuration.

    :param files_uri: ``s3://bucket/prefix/`` under which files (uploads and results) are kept.
    :param max_file_bytes: the largest upload accepted.
    :param batch_dag_id: the DAG a new batch triggers a run of.
    :param aws_conn_id: the AWS connection for ``files_uri``.
    :param completion_windows: the ``completion_window`` values ``POST /batches`` accepts.
    """

    files_uri: str
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    batch_dag_id: str = DEFAULT_BATCH_DAG_ID
    aws_conn_id: str = "aws_default"
    completion_windows: tuple[str, ...] = DEFAULT_COMPLETION_WINDOWS

    @property
    def bucket(self) -> str:
        return split_files_uri(self.files_uri)[0]

    @property
    def prefix(self) -> str:
        """The key prefix, empty or ending with ``/``."""
        return split_files_uri(self.files_uri)[1]


def load_settings() -> OpenAIApiSettings:
    """Read the settings from Airflow's configuration.

    :raises ConfigurationError: ``openai_files_uri`` is missing or not an ``s3://`` URI, or the size limit is not a positive integer.
    """
    from airflow_vllm_batch.version_compat import conf

    files_uri = conf.get(SECTION, "openai_files_uri", fallback="") or ""
    if not files_uri.startswith("s3://") or len(files_uri) <= len("s3://") or files_uri[5] == "/":
        raise ConfigurationError(
            f"[{SECTION}] openai_files_uri is {files_uri!r}: set it to the s3://bucket/prefix/ where the OpenAI API keeps "
            "files (AIRFLOW__VLLM_BATCH__OPENAI_FILES_URI)"
        )
    raw_max = conf.get(SECTION, "openai_max_file_bytes", fallback=str(DEFAULT_MAX_FILE_BYTES))
    try:
        max_file_bytes = int(raw_max)
    except ValueError:
        max_file_bytes = 0
    if max_file_bytes <= 0:
        raise ConfigurationError(
            f"[{SECTION}] openai_max_file_bytes is {raw_max!r}: give a positive number of bytes"
        )
    return OpenAIApiSettings(
        files_uri=files_uri,
        completion_windows=parse_windows(conf.get(SECTION, "openai_completion_windows", fallback="") or ""),
        max_file_bytes=max_file_bytes,
        batch_dag_id=conf.get(SECTION, "openai_batch_dag_id", fallback=DEFAULT_BATCH_DAG_ID)
        or DEFAULT_BATCH_DAG_ID,
        aws_conn_id=conf.get(SECTION, "openai_aws_conn_id", fallback="aws_default") or "aws_default",
    )


def load_completion_windows() -> tuple[str, ...]:
    """The completion windows ``POST /batches`` accepts (``openai_completion_windows``), read alone: the batch DAG's file needs only them.

    :raises ConfigurationError: a window is not a whole number of hours or days.
    """
    from airflow_vllm_batch.version_compat import conf

    return parse_windows(conf.get(SECTION, "openai_completion_windows", fallback="") or "")


def parse_windows(raw: str) -> tuple[str, ...]:
    """The completion windows of ``openai_completion_windows`` (comma-separated, e.g. ``24h,72h``); OpenAI's ``24h`` when empty.

    :raises ConfigurationError: a window is not a whole number of hours (``<n>h``) or days (``<n>d``).
    """
    from airflow_vllm_batch.openai_api.status import window_seconds

    windows = tuple(w.strip() for w in raw.split(",") if w.strip()) or DEFAULT_COMPLETION_WINDOWS
    for window in windows:
        try:
            window_seconds(window)
        except ValueError:
            raise ConfigurationError(
                f"[{SECTION}] openai_completion_windows has {window!r}: give windows such as 24h or 7d, separated by commas"
            ) from None
    return windows
