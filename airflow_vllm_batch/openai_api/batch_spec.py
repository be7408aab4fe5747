"""What a batch run of the OpenAI API may do, signed by the API server and verified by the batch task.

A batch is a run of the batch DAG, and anyone with trigger permission on that DAG can start a
run with a conf of their own making through Airflow's UI or REST API. So the batch task trusts
nothing in a run's conf but a :class:`BatchSpec` whose HMAC-SHA256 signature, made with the key
the API server and the workers share (``[vllm_batch] openai_signing_key``, or an earlier key kept
in ``openai_old_signing_keys`` while a rotation's batches are wanted), checks out, for that very
run id. Every S3 location the task touches is *derived* from the spec and ``[vllm_batch]
openai_files_uri`` (:meth:`BatchSpec.locations`), never read from the conf, so a hand-made or
edited run fails before it reads or writes anything.

Free of Airflow imports but the configuration read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from airflow_vllm_batch.docs_links import doc_ref
from airflow_vllm_batch.exceptions import ConfigurationError, VLLMBatchError
from airflow_vllm_batch.openai_api.access import owner_key
from airflow_vllm_batch.openai_api.files import BATCH_ID, FILE_ID, FileStore, result_file_ids

#: The conf key of the signature; its value starts with the scheme's version.
SIGNATURE = "signature"
_SCHEME = "v1"
#: A shorter key can be guessed: refuse it.
MIN_KEY_CHARS = 32


class ForgedBatchError(VLLMBatchError):
    """A batch run's conf is not one the OpenAI API made (no signature, a wrong one, or another run's); not retried."""

    retryable = False


@dataclass(frozen=True)
class BatchLocations:
    """Where one batch's objects are, all under ``openai_files_uri``.

    :param input_uri: the batch's pinned copy of its input file.
    :param output_uri: the output file (a file of the owner's: ``output_file_id``).
    :param error_uri: the error file (``error_file_id``).
    :param failure_uri: why the batch failed, written by its task.
    :param cancel_uri: a cancel request, written by the API.
    :param progress_uri: the live counts, written by the task as it goes.
    :param record_uri: the API's record of the batch (its metadata), read by the API only.
    """

    input_uri: str
    output_uri: str
    error_uri: str
    failure_uri: str
    cancel_uri: str
    progress_uri: str
    record_uri: str


@dataclass(frozen=True)
class BatchSpec:
    """What the API decided for one batch; everything a run of it needs, and nothing a user may change.

    :param batch_id: the batch's id, which is its DAG run's run_id.
    :param dag_id: the batch DAG it runs in (``[vllm_batch] openai_batch_dag_id`` when it was created):
        a run of its conf in any other DAG (one built with ``openai_batch_dag`` too) is refused.
    :param owner: the id of the user who created it.
    :param input_file_id: the uploaded file it answers.
    :param input_version: the ETag of the batch's pinned copy of that file, made at create.
    :param endpoint: the URL every line must name (``/v1/chat/completions``...).
    :param route: the batch task that runs it (``openai_models``), or ``""`` for the DAG's one task.
    :param created_at: when it was created, seconds since the epoch.
    :param window_s: its completion window, in seconds.
    """

    batch_id: str
    dag_id: str
    owner: str
    input_file_id: str
    input_version: str
    endpoint: str
    route: str
    created_at: int
    window_s: int

    @property
    def expires_at(self) -> int:
        """When the completion window passes, seconds since the epoch."""
        return self.created_at + self.window_s

    def _payload(self) -> bytes:
        return json.dumps({"scheme": _SCHEME, **asdict(self)}, sort_keys=True, separators=(",", ":")).encode()

    def _signature(self, key: str) -> str:
        return f"{_SCHEME}:" + hmac.new(key.encode(), self._payload(), hashlib.sha256).hexdigest()

    def sign(self, key: str) -> dict[str, Any]:
        """The run conf of this batch: its fields and their signature.

        :param key: the signing key (:func:`signing_key`).
        """
        return {**asdict(self), SIGNATURE: self._signature(key)}

    @classmethod
    def verified(cls, conf: Any, run_id: str, keys: str | Sequence[str], dag_id: str) -> BatchSpec:
        """The spec of a run's conf, when the API made it for this run of this DAG.

        :param conf: the DAG run's conf.
        :param run_id: the DAG run's run_id.
        :param keys: the accepted keys (:func:`verification_keys`: the signing key, then the old keys kept
            for rotation); a signature made with any of them verifies. One key alone may be given as a string.
        :param dag_id: the DAG run's dag_id.
        :raises ForgedBatchError: the conf has no spec, its signature is missing or wrong, or it was made for
            another run or another DAG.
        """
        fix = "Create batches with POST /batches of the OpenAI API; a run triggered by hand or with an edited conf is refused."
        if not isinstance(conf, dict):
            raise ForgedBatchError(
                f"This run of the batch DAG has no conf from the OpenAI API: nothing was read or written. {fix}"
            )
        try:
            values = {f.name: conf[f.name] for f in fields(cls)}
            spec = cls(**values)
            ints = isinstance(spec.created_at, int) and isinstance(spec.window_s, int)
            strings = all(
                isinstance(getattr(spec, f.name), str)
                for f in fields(cls)
                if f.name not in ("created_at", "window_s")
            )
        except (KeyError, TypeError):
            ints = strings = False
        if not (ints and strings):
            names = ", ".join(f.name for f in fields(cls))
            raise ForgedBatchError(
                f"This run's conf is not a batch of the OpenAI API (it needs {names} and a signature): nothing was read or written. {fix}"
            )
        signature = conf.get(SIGNATURE)
        accepted = (keys,) if isinstance(keys, str) else tuple(keys)
        # Every key is tried (no early exit): the time taken does not tell which key matched.
        matches = [
            hmac.compare_digest(signature.encode(), spec._signature(key).encode())
            for key in accepted
            if isinstance(signature, str)
        ]
        if not any(matches):
            raise ForgedBatchError(
                f"This run's conf is not signed by the OpenAI API ({'no signature' if not signature else 'the signature does not match'}): "
                f"nothing was read or written. {fix}"
            )
        if spec.batch_id != run_id:
            raise ForgedBatchError(
                f"This run's conf was signed for the batch {spec.batch_id!r}, not for this run {run_id!r}: nothing was read or written. {fix}"
            )
        if spec.dag_id != dag_id:
            raise ForgedBatchError(
                f"This run's conf was signed for the batch DAG {spec.dag_id!r}, not for {dag_id!r}: nothing was read or written. {fix}"
            )
        if not BATCH_ID.match(spec.batch_id) or not FILE_ID.match(spec.input_file_id):
            raise ForgedBatchError(
                f"This run's conf names a malformed batch or file id: nothing was read or written. {fix}"
            )
        return spec

    @property
    def output_file_id(self) -> str:
        return result_file_ids(self.batch_id)[0]

    @property
    def error_file_id(self) -> str:
        return result_file_ids(self.batch_id)[1]

    def locations(self, files_uri: str) -> BatchLocations:
        """Every object of this batch, derived from ``openai_files_uri``, the owner and the ids (the layout of :class:`~.files.FileStore`).

        :param files_uri: ``[vllm_batch] openai_files_uri``.
        """
        layout = FileStore.layout(files_uri)
        owner, batch = owner_key(self.owner), self.batch_id
        return BatchLocations(
            input_uri=layout.uri(layout.batch_input_key(batch)),
            output_uri=layout.uri(layout.content_key(owner, self.output_file_id)),
            error_uri=layout.uri(layout.content_key(owner, self.error_file_id)),
            failure_uri=layout.uri(layout.failure_key(batch)),
            cancel_uri=layout.uri(layout.cancel_key(batch)),
            progress_uri=layout.uri(layout.progress_key(batch)),
            record_uri=layout.uri(layout.batch_record_key(batch)),
        )


def signing_key() -> str:
    """The key the API server signs batch runs with and the batch task checks them with.

    Read from ``[vllm_batch] openai_signing_key`` (a sensitive option: also
    ``AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY_SECRET`` to read it from the secrets backend, or
    ``..._CMD``), and registered with the secrets masker.

    :raises ConfigurationError: it is unset or shorter than :data:`MIN_KEY_CHARS` characters.
    """
    from airflow_vllm_batch.version_compat import conf

    key = conf.get("vllm_batch", "openai_signing_key", fallback="") or ""
    if len(key) < MIN_KEY_CHARS:
        raise ConfigurationError(
            f"[vllm_batch] openai_signing_key is {'unset' if not key else 'shorter than ' + str(MIN_KEY_CHARS) + ' characters'}. "
            "Set the same random key on the API server and the workers (AIRFLOW__VLLM_BATCH__OPENAI_SIGNING_KEY, or "
            f"..._SECRET from the secrets backend); {doc_ref('The OpenAI Files and Batches API', 'Deploying it')}."
        )
    _mask(key)
    return key


def verification_keys() -> tuple[str, ...]:
    """The keys a batch run's signature is accepted under: the signing key, then ``[vllm_batch] openai_old_signing_keys``.

    Rotating the key without losing batches: the new key becomes ``openai_signing_key`` (new batches are
    signed with it) and the old one moves to ``openai_old_signing_keys`` (comma-separated, a sensitive
    option like the signing key), on the API server and every worker; the batches signed with it stay
    listed, shown, cancellable, and their retries run. Once no batch signed with an old key is wanted
    any more, remove it from the list: those batches are then hidden (404, not listed) and their runs
    fail at the signature check, as a forged run.

    :raises ConfigurationError: the signing key is unset or short, or an old key is shorter than
        :data:`MIN_KEY_CHARS` characters.
    """
    from airflow_vllm_batch.version_compat import conf

    current = signing_key()
    raw = conf.get("vllm_batch", "openai_old_signing_keys", fallback="") or ""
    old = tuple(k.strip() for k in raw.split(",") if k.strip())
    for number, key in enumerate(old, start=1):
        if len(key) < MIN_KEY_CHARS:
            raise ConfigurationError(
                f"[vllm_batch] openai_old_signing_keys: its key number {number} is shorter than {MIN_KEY_CHARS} characters. "
                "List earlier values of openai_signing_key, comma-separated "
                f"({doc_ref('The OpenAI Files and Batches API', 'Rotating the signing key')})."
            )
        _mask(key)
    return (current, *(k for k in old if k != current))


def _mask(key: str) -> None:
    """Register a key with the secrets masker, so that no log line shows it."""
    try:
        from airflow.sdk.log import mask_secret

        mask_secret(key)
    except ImportError:  # pragma: no cover - the masker is in every supported Airflow
        pass
