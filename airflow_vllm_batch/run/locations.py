"""The S3 locations one run reads and writes, and the check that no two of them collide.

Invariant *No strangers*: a run writes and deletes only what it owns, never its input. An
output has its results, error file, manifest, lease and staging prefix
(:mod:`airflow_vllm_batch.storage`); the input is ``input_uri`` or, with ``requests=``, the
prefix the requests are written under; the answer cache owns everything under
``answer_cache_uri``. Two of these naming the same object, or one object lying under
another's prefix, would let the run overwrite or delete its own input, its results or
the cache (``output_uri == input_uri`` once replaced the input by the results). Such
settings are refused before any engine starts and before any S3 write: at DAG parse time
for plain strings (:func:`check_locations` with ``rendered=False`` skips templated ones),
and when the task starts for rendered ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_vllm_batch.exceptions import LocationError, VLLMBatchError
from airflow_vllm_batch.storage.layout import default_error_uri, manifest_uri, output_stem
from airflow_vllm_batch.storage.s3 import split_s3_uri


@dataclass(frozen=True, kw_only=True)
class Location:
    """One object (or, with ``prefix``, everything under a key prefix) that a run reads or writes.

    :param parameter: the operator parameter that decides it.
    :param label: what it is, for messages (``"the manifest of output_uri"``).
    :param bucket: its bucket.
    :param key: its key, or the prefix (ending with ``/``, or empty for the whole bucket).
    :param prefix: whether it owns everything under ``key``.
    """

    parameter: str
    label: str
    bucket: str
    key: str
    prefix: bool = False

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def meets(self, other: Location) -> str | None:
        """How this location collides with ``other`` (words for a message), or None when it does not."""
        if self.bucket != other.bucket:
            return None
        if not self.prefix and not other.prefix:
            return "is the same object as" if self.key == other.key else None
        if self.prefix and other.key.startswith(self.key):
            return "holds" if not other.prefix or other.key != self.key else "is the same prefix as"
        if other.prefix and self.key.startswith(other.key):
            return "lies under"
        return None


def lease_uri(output_uri: str) -> str:
    """The output's lease object: ``<stem>.lease.json`` (as :meth:`~airflow_vllm_batch.storage.publishing.OutputStore.lease` names it)."""
    return f"{output_stem(output_uri)}.lease.json"


def staging_uri(output_uri: str) -> str:
    """The prefix every run's staging of this output lies under: ``<output key>.staging/``."""
    return f"{output_uri}.staging/"


def run_locations(values: Mapping[str, Any], *, rendered: bool = True) -> list[Location]:
    """The locations of a run's settings: its output's objects, its input, the answer cache.

    :param values: the operator's arguments (rendered, or as given in the DAG file).
    :param rendered: False at DAG parse time: a value that is templated (or not a plain
        string yet, e.g. an XCom) is left out, to be checked once rendered.
    """
    return list(_locations(values, rendered=rendered))


def check_locations(values: Mapping[str, Any], *, rendered: bool = True) -> None:
    """Refuse settings whose locations collide (see the module's docstring).

    :param values: the operator's arguments.
    :param rendered: False at DAG parse time (templated values are checked when the task starts).
    :raises LocationError: naming both parameters, the objects and the fix; not retried.
    """
    for one, other in itertools.combinations(run_locations(values, rendered=rendered), 2):
        if one.parameter == other.parameter:
            continue  # the objects of one output are named apart by construction
        how = one.meets(other)
        if how is not None:
            raise LocationError(_message(one, how, other))


def _locations(values: Mapping[str, Any], *, rendered: bool) -> Iterator[Location]:
    output = _plain(values.get("output_uri"), rendered)
    if output is not None:
        error = values.get("error_uri")
        for label, uri in (
            ("output_uri", output),
            ("the manifest of output_uri", manifest_uri(output)),
            ("the lease of output_uri", lease_uri(output)),
            *(
                []
                if error is not None
                else [("the default error file of output_uri", default_error_uri(output))]
            ),
        ):
            yield from _object("output_uri", label, uri)
        yield from _prefix("output_uri", "the staging prefix of output_uri", staging_uri(output))
        if values.get("requests") is not None:
            yield from _prefix(
                "requests", "the prefix requests= are written under", f"{output_stem(output)}.requests/"
            )
    error = _plain(values.get("error_uri"), rendered)
    if error is not None:
        yield from _object("error_uri", "error_uri", error)
    source = _plain(values.get("input_uri"), rendered)
    if source is not None and source.startswith("s3://"):
        yield from _object("input_uri", "input_uri", source)
    cache = _plain(values.get("answer_cache_uri"), rendered)
    if cache is not None and cache.startswith("s3://"):
        bucket, _, key = cache.removeprefix("s3://").partition("/")
        if bucket:
            yield Location(
                parameter="answer_cache_uri",
                label="answer_cache_uri",
                bucket=bucket,
                key=key if not key or key.endswith("/") else key + "/",
                prefix=True,
            )


def _plain(value: Any, rendered: bool) -> str | None:
    """``value`` when it is a string known now; at parse time a template is not."""
    if not isinstance(value, str) or (not rendered and "{{" in value):
        return None
    return value


def _object(parameter: str, label: str, uri: str) -> Iterator[Location]:
    try:
        bucket, key = split_s3_uri(uri, parameter)
    except VLLMBatchError:
        return  # malformed: refused on its own, naming the parameter, when the settings are read
    yield Location(parameter=parameter, label=label, bucket=bucket, key=key)


def _prefix(parameter: str, label: str, uri: str) -> Iterator[Location]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if uri.startswith("s3://") and bucket and key:
        yield Location(parameter=parameter, label=label, bucket=bucket, key=key, prefix=True)


#: Which parameter to move when two collide: never the input the user has, first what is easiest to move.
_MOVE_FIRST = ("answer_cache_uri", "error_uri", "output_uri", "requests", "input_uri")
_ADVICE = {
    "output_uri": "a key of its own, e.g. beside the input with a different name (the run never writes its input)",
    "error_uri": "a key of its own, or leave it unset for <output stem>.errors.jsonl",
    "answer_cache_uri": "a prefix of its own that holds neither the input nor the output, e.g. s3://bucket/answer-cache/",
    "requests": "another output_uri",
    "input_uri": "another input_uri",
}


def _message(one: Location, how: str, other: Location) -> str:
    inputs = {"input_uri", "requests"}
    harm = (
        "overwrite or delete its own input"
        if inputs & {one.parameter, other.parameter}
        else "overwrite or delete one with the other"
    )
    move = min((one.parameter, other.parameter), key=_MOVE_FIRST.index)
    return (
        f"{one.parameter} and {other.parameter} collide: {one.label} ({one.uri}) {how} {other.label} ({other.uri}), "
        f"so the run would {harm}. Give {move} {_ADVICE[move]}. Nothing was run or written."
    )
