"""An in-memory S3 with a virtual clock and seeded faults: the boto3 client calls the run code makes.

:class:`FakeS3` holds the objects (with ETags, ``LastModified`` on the simulator's virtual
clock) and a log of every mutation (who made it, and the lease object's holder at that
moment), which the invariants read after a schedule. :class:`FakeS3Client` is what
``S3Hook.get_conn()`` returns under the simulator (:class:`FakeS3Hook`); it implements
exactly the calls the provider and ``S3Hook`` make: ``get_object``, ``put_object``,
``head_object``, ``head_bucket``, ``delete_object``, ``delete_objects``, the
``list_objects_v2`` paginator, the managed ``copy``, ``upload_file``/``upload_fileobj``
(one PUT: the simulator's files are small, below s3transfer's multipart threshold) and
``generate_presigned_url``. Conditional requests (``IfMatch``, ``IfNoneMatch``) answer 412
``PreconditionFailed`` as S3 and SeaweedFS do; tests/integration/test_s3_fake_contract.py
runs the same call sequences on this fake and on a real SeaweedFS and compares.

Every call is a step of the schedule (:meth:`Scheduler.step`): the scheduler may run
another try or thread there, kill the calling try there, or inject a fault. Faults are
modelled the way botocore meets them, with its retries (legacy mode: 5 attempts):

* ``error``: a 500/503 ``SlowDown`` before the call reaches S3 (nothing happens; retried);
* ``lost_response``: the call *succeeded* on S3 but its response was lost (a read
  timeout): botocore sends it again, with the same conditions (so an ``IfMatch`` retry of
  a write that landed meets its own new ETag and gets 412);
* ``slow``: the call takes tens of virtual seconds (leases age meanwhile);
* ``outage``: every attempt fails, so the call raises to the code;
* ``conflict``: a conditional write answered 409 ``ConditionalRequestConflict`` (S3's answer
  to a conditional write racing another write of the same key; not retried, nothing applied);
* ``partial``: a ``DeleteObjects`` whose answer lists some keys under ``Errors`` (S3 answers
  200 and leaves those keys in place).

Besides the faults drawn at the plan's rate, a schedule may *target* one call site (an
operation on one kind of object, :meth:`FakeS3.site`): the world forces a fault of a chosen
kind on the n-th call there (:attr:`FakeS3.forced`), so every (site, fault kind) pair is
reached by construction rather than by chance, and :attr:`FakeS3.coverage` counts them.
The fake's own nondeterminism is drawn from the seed too: a schedule may list keys in
another order than S3's (``shuffle_lists``; the code must not depend on it).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.utils import format_datetime
from os.path import commonpath
from typing import Any

from airflow.providers.amazon.aws.hooks.s3 import S3Hook
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

#: The virtual clock's zero, as S3's wall clock.
EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
#: Botocore's legacy retry mode: one call, four retries.
BOTO_ATTEMPTS = 5
#: The calls that change something (the ones the fencing and ownership checks look at).
MUTATIONS = frozenset(
    {"put_object", "delete_object", "delete_objects", "copy", "copy_object", "upload_file", "upload_fileobj"}
)


@dataclass
class StoredObject:
    body: bytes
    etag: str
    last_modified: dt.datetime
    writer: str


@dataclass
class Mutation:
    """One change S3 applied: the step, who made it, what, and who held the output's lease then."""

    step: int
    actor: str
    try_label: str | None
    op: str
    bucket: str
    key: str
    conditional: bool
    lease_holder: str | None
    body: bytes | None = None
    #: Virtual seconds at which it applied.
    at: float = 0.0
    #: The object's body before the change (None: there was none).
    before: bytes | None = None


def client_error(code: str, status: int, operation: str, message: str = "") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": message or code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        operation,
    )


class FaultPlan:
    """Which fault each attempt of each call meets, drawn from the schedule's random generator.

    :param rng: the schedule's ``random.Random``.
    :param rate: the chance that one attempt meets a fault (split over the kinds).
    """

    KINDS = ("error", "lost_response", "slow", "outage")
    #: Kinds only a targeted fault injects (they exist only at some calls).
    TARGETED_ONLY = ("conflict", "partial")

    def __init__(self, rng: Any, rate: float) -> None:
        self.rng = rng
        self.rate = rate
        self.injected: dict[str, int] = {}

    def count(self, kind: str) -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1

    def draw(self) -> str | None:
        if self.rate <= 0 or self.rng.random() >= self.rate:
            return None
        kind = self.rng.choices(self.KINDS, weights=(4, 3, 3, 1))[0]
        self.count(kind)
        return kind


class FakeS3:
    """The objects of every bucket, the mutation log, and the fault plan.

    :param scheduler: the schedule's scheduler (its virtual clock and steps); None for a plain fake.
    :param faults: the fault plan; None for none.
    :param lease_key: ``(bucket, key)`` of the output's lease, to note its holder at each mutation.
    """

    def __init__(
        self, scheduler: Any = None, faults: FaultPlan | None = None, lease_key: tuple[str, str] | None = None
    ) -> None:
        self.buckets: dict[str, dict[str, StoredObject]] = {}
        self.scheduler = scheduler
        self.faults = faults
        self.lease_key = lease_key
        self.mutations: list[Mutation] = []
        self.calls = 0
        #: What each try read of staging, by key: the body a get or head returned, or that a listing
        #: showed the key with (what it could know was durable; not what was written after its reads).
        self.staging_seen: dict[str, dict[str, bytes]] = {}
        #: Client calls the run code made that the fake does not model (the campaign reports them).
        self.unsupported: set[str] = set()
        #: One line per attempt of every call (who, what, which fault, what came of it), and the
        #: run code's log lines (:meth:`note`), in order: ``benchmarks/simulate.py --seed N --trace``.
        self.trace: list[str] = []
        self._local_now = 0.0
        #: ``(op, bucket, key) -> site name``: which call site a call is (set by the world); None: no sites.
        self.site_of: Callable[[str, str, str], str] | None = None
        #: The site of the call being made (what the world's step hook sees).
        self.current_site: str | None = None
        #: A fault the world forces on the next attempt of the current call (a targeted fault).
        self.forced: str | None = None
        #: ``(site, fault kind) -> count`` of faults injected at each site.
        self.coverage: dict[tuple[str, str], int] = {}
        #: ``(try label, key) -> MD5s`` of every body a try asked to write there (landed or not).
        self.attempted: dict[tuple[str | None, str], set[str]] = {}
        #: Called after every applied mutation with its :class:`Mutation` records (the per-step checks).
        self.on_change: Callable[[list[Mutation]], None] | None = None
        #: List keys in a seeded random order instead of S3's (lexicographic) one.
        self.shuffle_lists = False

    # -- the clock -----------------------------------------------------------------

    @property
    def now(self) -> dt.datetime:
        seconds = self.scheduler.now if self.scheduler is not None else self._local_now
        return EPOCH + dt.timedelta(seconds=seconds)

    def create_bucket(self, name: str) -> None:
        self.buckets.setdefault(name, {})

    def objects(self, bucket: str) -> dict[str, StoredObject]:
        return self.buckets[bucket]

    def lease_holder(self) -> str | None:
        """The lease object's holder (``try <n>``) right now, or None when there is no lease."""
        if self.lease_key is None:
            return None
        obj = self.buckets.get(self.lease_key[0], {}).get(self.lease_key[1])
        if obj is None:
            return None
        import json

        try:
            data = json.loads(obj.body)
            return f"{data['run_id']}/try-{data['try_number']}"
        except (ValueError, KeyError):
            return "?"

    def note(self, line: str) -> None:
        """Add a line to the trace at the current step (a log line of the run code)."""
        self.trace.append(f"{self.calls:5d}          {line}")

    def _trace(
        self, op: str, key: str, attempt: int, fault: str | None, outcome: str, conditions: str
    ) -> None:
        actor = self.scheduler.current_actor() if self.scheduler is not None else None
        who = (actor.try_label or actor.name) if actor is not None else "-"
        self.trace.append(
            f"{self.calls:5d} t={self.now:%H:%M:%S} {who:<14} {op} {key}{conditions} "
            f"attempt {attempt + 1}{f' [{fault}]' if fault else ''}: {outcome}"
        )

    # -- one call, with botocore's retries ------------------------------------------

    def call(
        self,
        op: str,
        bucket: str,
        key: str,
        apply: Callable[[], Any],
        conditional: bool = False,
        keys: list[str] | None = None,
        conditions: str = "",
    ) -> Any:
        """Run one client call: the scheduler's step, faults and botocore's retries around ``apply``.

        :param conditions: the call's ``IfMatch``/``IfNoneMatch``, for the trace only.
        """
        self.calls += 1
        scheduler = self.scheduler
        # A DeleteObjects of several keys is the removal of a prefix: its site is their common prefix's.
        where = commonpath(keys) if keys and len(keys) > 1 else key
        if where is not key and ".staging/" in where:
            head, rest = where.split(".staging/", 1)
            where = f"{head}.staging/{rest.split('/', 1)[0]}/"
        self.current_site = self.site_of(op, bucket, where) if self.site_of is not None else None
        if scheduler is not None:
            scheduler.step(f"s3.{op}")
        last_error: Exception | None = None
        # Local to this call: other actors' calls run while this one waits (a slow attempt).
        before: dict[tuple[str, str], bytes | None] = {}
        for attempt in range(BOTO_ATTEMPTS):
            fault = self.faults.draw() if self.faults is not None else None
            if attempt == 0 and self.forced is not None:
                fault, self.forced = self.forced, None
                if self.faults is not None:
                    self.faults.count(fault)
            if fault == "conflict" and not conditional:
                fault = "error"
            if fault == "partial" and op != "delete_objects":
                fault = "error"
            if fault is not None:
                self.note_fault(fault)
            if scheduler is not None:
                scheduler.sleep(30.0 + scheduler.rng.random() * 60 if fault == "slow" else 0.05)
            if fault == "error":
                self._trace(op, key, attempt, fault, "503 before S3 (retried)", conditions)
                last_error = client_error("SlowDown", 503, op, "Please reduce your request rate.")
                continue
            if fault == "outage":
                self._trace(op, key, attempt, fault, "raises EndpointConnectionError", conditions)
                raise EndpointConnectionError(endpoint_url=f"http://s3.sim/{bucket}")
            if fault == "conflict":
                self._trace(op, key, attempt, fault, "raises ConditionalRequestConflict (409)", conditions)
                raise client_error(
                    "ConditionalRequestConflict",
                    409,
                    op,
                    "A conflicting conditional operation is in progress",
                )
            if bucket not in self.buckets and op != "head_bucket":
                raise client_error("NoSuchBucket", 404, op)
            if op in MUTATIONS:
                for changed in keys or [key]:
                    obj = self.buckets.get(bucket, {}).get(changed)
                    before.setdefault((bucket, changed), obj.body if obj is not None else None)
            try:
                result = apply() if fault != "partial" else self._partial(apply, bucket, keys or [key])
            except ClientError as err:
                # A 4xx is final: botocore does not retry it.
                self._trace(op, key, attempt, fault, f"raises {err.response['Error']['Code']}", conditions)
                raise err from None
            etag = result.get("ETag") if isinstance(result, dict) else None
            self._trace(
                op,
                key,
                attempt,
                fault,
                ("applied, response lost (retried)" if fault == "lost_response" else "ok")
                + (f" ETag {etag}" if etag else ""),
                conditions,
            )
            if op in MUTATIONS:
                failed = {e["Key"] for e in result.get("Errors", [])} if isinstance(result, dict) else set()
                applied = [
                    self.note_mutation(op, bucket, changed, conditional, before.get((bucket, changed)))
                    for changed in keys or [key]
                    if changed not in failed
                ]
                if self.on_change is not None and applied:
                    self.on_change(applied)
            elif (
                ".staging/" in key
                and scheduler is not None
                and (actor := scheduler.current_actor()) is not None
            ):
                seen = self.staging_seen.setdefault(actor.try_label or "-", {})
                listed = (
                    [item["Key"] for item in result.get("Contents", [])] if op == "list_objects_v2" else [key]
                )
                for read in listed:
                    if (obj := self.buckets[bucket].get(read)) is not None:
                        seen[read] = obj.body
            if fault == "lost_response":
                last_error = ReadTimeoutError(endpoint_url=f"http://s3.sim/{bucket}/{key}")
                continue
            return result
        assert last_error is not None
        raise last_error

    def note_fault(self, kind: str) -> None:
        """Count a fault at the current site, and against the try whose call met it."""
        actor = self.scheduler.current_actor() if self.scheduler is not None else None
        if actor is not None and actor.owner is not None:
            actor.owner.faults += 1
        if self.current_site is not None:
            self.coverage[(self.current_site, kind)] = self.coverage.get((self.current_site, kind), 0) + 1

    def _partial(self, apply: Callable[[], Any], bucket: str, keys: list[str]) -> dict:
        """A DeleteObjects that deletes some keys and answers the others under ``Errors`` (S3's per-key failures)."""
        rng = self.scheduler.rng if self.scheduler is not None else None
        failing = [k for k in keys if rng is None or rng.random() < 0.5] or keys[:1]
        kept = {k: self.buckets[bucket][k] for k in failing if k in self.buckets[bucket]}
        result = apply()
        self.buckets[bucket].update(kept)
        result["Deleted"] = [{"Key": k} for k in keys if k not in failing]
        result["Errors"] = [
            {
                "Key": k,
                "Code": "InternalError",
                "Message": "We encountered an internal error. Please try again.",
            }
            for k in failing
        ]
        return result

    def note_mutation(
        self, op: str, bucket: str, key: str, conditional: bool, before: bytes | None = None
    ) -> Mutation:
        actor = self.scheduler.current_actor() if self.scheduler is not None else None
        obj = self.buckets.get(bucket, {}).get(key)
        self.mutations.append(
            Mutation(
                step=self.calls,
                actor=actor.name if actor is not None else "-",
                try_label=actor.try_label if actor is not None else None,
                op=op,
                bucket=bucket,
                key=key,
                conditional=conditional,
                lease_holder=self.lease_holder(),
                body=obj.body if obj is not None and op != "delete_object" else None,
                at=self.scheduler.now if self.scheduler is not None else self._local_now,
                before=before,
            )
        )
        return self.mutations[-1]

    # -- the operations, applied -----------------------------------------------------

    def writer(self) -> str:
        actor = self.scheduler.current_actor() if self.scheduler is not None else None
        return actor.try_label if actor is not None and actor.try_label else "-"

    def check_conditions(
        self, op: str, current: StoredObject | None, if_match: str | None, if_none_match: str | None
    ) -> None:
        if if_none_match is not None and current is not None:
            raise client_error(
                "PreconditionFailed", 412, op, "At least one of the pre-conditions you specified did not hold"
            )
        if if_match is not None:
            if current is None:
                raise client_error("NoSuchKey", 404, op)
            if _unquote(if_match) != _unquote(current.etag):
                raise client_error(
                    "PreconditionFailed",
                    412,
                    op,
                    "At least one of the pre-conditions you specified did not hold",
                )

    def put(
        self,
        bucket: str,
        key: str,
        body: bytes,
        if_match: str | None = None,
        if_none_match: str | None = None,
    ) -> dict:
        actor = self.scheduler.current_actor() if self.scheduler is not None else None
        self.attempted.setdefault((actor.try_label if actor is not None else None, key), set()).add(
            hashlib.md5(body).hexdigest()
        )
        self.check_conditions("PutObject", self.buckets[bucket].get(key), if_match, if_none_match)
        etag = f'"{hashlib.md5(body).hexdigest()}"'
        self.buckets[bucket][key] = StoredObject(body, etag, self.now.replace(microsecond=0), self.writer())
        return {"ETag": etag, "ResponseMetadata": self.metadata(200)}

    def metadata(self, status: int) -> dict:
        return {"HTTPStatusCode": status, "HTTPHeaders": {"date": format_datetime(self.now, usegmt=True)}}


def _conditions(if_match: str | None, if_none_match: str | None) -> str:
    """A call's conditions as the trace shows them."""
    return (f" IfMatch={if_match}" if if_match else "") + (
        f" IfNoneMatch={if_none_match}" if if_none_match else ""
    )


def _unquote(etag: str) -> str:
    return etag.strip('"')


def _read_body(body: Any) -> bytes:
    if body is None:
        return b""
    if isinstance(body, (bytes, bytearray)):
        return bytes(body)
    if isinstance(body, str):
        return body.encode()
    return body.read()


class _Body(io.BytesIO):
    """A ``StreamingBody`` stand-in: ``read``, ``iter_lines``, ``iter_chunks``, ``close``."""

    def iter_chunks(self, chunk_size: int = 1024) -> Iterator[bytes]:
        while chunk := self.read(chunk_size):
            yield chunk


class _Paginator:
    def __init__(self, client: FakeS3Client) -> None:
        self.client = client

    def paginate(
        self, Bucket: str, Prefix: str = "", Delimiter: str = "", PaginationConfig: Any = None, **_: Any
    ) -> Iterator[dict]:
        yield self.client.list_objects_v2(Bucket=Bucket, Prefix=Prefix)


class FakeS3Client:
    """The boto3 S3 client calls the provider and ``S3Hook`` make, on a :class:`FakeS3`."""

    def __init__(self, s3: FakeS3) -> None:
        self.s3 = s3

    def get_object(
        self, Bucket: str, Key: str, IfMatch: str | None = None, VersionId: str | None = None, **_: Any
    ) -> dict:
        def apply() -> dict:
            obj = self.s3.buckets[Bucket].get(Key)
            if obj is None:
                raise client_error("NoSuchKey", 404, "GetObject", "The specified key does not exist.")
            if IfMatch is not None and _unquote(IfMatch) != _unquote(obj.etag):
                raise client_error("PreconditionFailed", 412, "GetObject")
            return {
                "Body": _Body(obj.body),
                "ETag": obj.etag,
                "LastModified": obj.last_modified,
                "ContentLength": len(obj.body),
                "ResponseMetadata": self.s3.metadata(200),
            }

        return self.s3.call("get_object", Bucket, Key, apply)

    def head_object(self, Bucket: str, Key: str, **_: Any) -> dict:
        def apply() -> dict:
            obj = self.s3.buckets[Bucket].get(Key)
            if obj is None:
                raise client_error("404", 404, "HeadObject", "Not Found")
            return {
                "ETag": obj.etag,
                "LastModified": obj.last_modified,
                "ContentLength": len(obj.body),
                "ResponseMetadata": self.s3.metadata(200),
            }

        return self.s3.call("head_object", Bucket, Key, apply)

    def head_bucket(self, Bucket: str, **_: Any) -> dict:
        def apply() -> dict:
            if Bucket not in self.s3.buckets:
                raise client_error("404", 404, "HeadBucket", "Not Found")
            return {"ResponseMetadata": self.s3.metadata(200)}

        return self.s3.call("head_bucket", Bucket, "", apply)

    def put_object(
        self,
        Bucket: str,
        Key: str,
        Body: Any = b"",
        IfMatch: str | None = None,
        IfNoneMatch: str | None = None,
        **_: Any,
    ) -> dict:
        data = _read_body(Body)
        return self.s3.call(
            "put_object",
            Bucket,
            Key,
            lambda: self.s3.put(Bucket, Key, data, if_match=IfMatch, if_none_match=IfNoneMatch),
            conditional=IfMatch is not None or IfNoneMatch is not None,
            conditions=_conditions(IfMatch, IfNoneMatch),
        )

    def upload_fileobj(
        self, Fileobj: Any, Bucket: str, Key: str, ExtraArgs: dict | None = None, **_: Any
    ) -> None:
        data = _read_body(Fileobj)
        extra = ExtraArgs or {}
        self.s3.call(
            "upload_fileobj",
            Bucket,
            Key,
            lambda: self.s3.put(
                Bucket, Key, data, if_match=extra.get("IfMatch"), if_none_match=extra.get("IfNoneMatch")
            ),
            conditional="IfMatch" in extra or "IfNoneMatch" in extra,
        )

    def upload_file(
        self, Filename: str, Bucket: str, Key: str, ExtraArgs: dict | None = None, **_: Any
    ) -> None:
        with open(Filename, "rb") as f:
            data = f.read()
        extra = ExtraArgs or {}
        self.s3.call(
            "upload_file",
            Bucket,
            Key,
            lambda: self.s3.put(
                Bucket, Key, data, if_match=extra.get("IfMatch"), if_none_match=extra.get("IfNoneMatch")
            ),
            conditional="IfMatch" in extra or "IfNoneMatch" in extra,
        )

    def delete_object(self, Bucket: str, Key: str, IfMatch: str | None = None, **_: Any) -> dict:
        def apply() -> dict:
            current = self.s3.buckets[Bucket].get(Key)
            if IfMatch is not None:
                if current is None:  # as SeaweedFS answers (tests/integration/test_s3_fake_contract.py)
                    raise client_error("PreconditionFailed", 412, "DeleteObject")
                if _unquote(IfMatch) != _unquote(current.etag):
                    raise client_error("PreconditionFailed", 412, "DeleteObject")
            self.s3.buckets[Bucket].pop(Key, None)
            return {"ResponseMetadata": self.s3.metadata(204)}

        return self.s3.call(
            "delete_object",
            Bucket,
            Key,
            apply,
            conditional=IfMatch is not None,
            conditions=_conditions(IfMatch, None),
        )

    def delete_objects(self, Bucket: str, Delete: dict, **_: Any) -> dict:
        keys = [o["Key"] for o in Delete.get("Objects", [])]

        def apply() -> dict:
            for key in keys:
                self.s3.buckets[Bucket].pop(key, None)
            return {"Deleted": [{"Key": k} for k in keys], "ResponseMetadata": self.s3.metadata(200)}

        # One request on S3; one mutation per key in the log (the checks look at keys).
        return self.s3.call("delete_objects", Bucket, keys[0] if keys else "", apply, keys=keys)

    def copy(self, CopySource: dict, Bucket: str, Key: str, **_: Any) -> None:
        def apply() -> None:
            source = self.s3.buckets[CopySource["Bucket"]].get(CopySource["Key"])
            if source is None:
                raise client_error("404", 404, "HeadObject", "Not Found")
            self.s3.put(Bucket, Key, source.body)

        self.s3.call("copy", Bucket, Key, apply)

    def copy_object(
        self,
        Bucket: str,
        Key: str,
        CopySource: dict,
        IfMatch: str | None = None,
        IfNoneMatch: str | None = None,
        **_: Any,
    ) -> dict:
        def apply() -> dict:
            source = self.s3.buckets[CopySource["Bucket"]].get(CopySource["Key"])
            if source is None:
                raise client_error("NoSuchKey", 404, "CopyObject", "The specified key does not exist.")
            put = self.s3.put(Bucket, Key, source.body, if_match=IfMatch, if_none_match=IfNoneMatch)
            return {"CopyObjectResult": {"ETag": put["ETag"]}, "ResponseMetadata": put["ResponseMetadata"]}

        return self.s3.call(
            "copy_object",
            Bucket,
            Key,
            apply,
            conditional=IfMatch is not None or IfNoneMatch is not None,
            conditions=_conditions(IfMatch, IfNoneMatch),
        )

    def __getattr__(self, name: str) -> Any:
        # A boto3 call the fake does not model: recorded, so the campaign reports it rather than a bug of the run code.
        if name.startswith("_"):
            raise AttributeError(name)
        self.s3.unsupported.add(name)
        raise NotImplementedError(f"the simulator's S3 does not model {name}()")

    def list_objects_v2(self, Bucket: str, Prefix: str = "", **_: Any) -> dict:
        def apply() -> dict:
            contents = [
                {"Key": k, "Size": len(o.body), "ETag": o.etag, "LastModified": o.last_modified}
                for k, o in sorted(self.s3.buckets[Bucket].items())
                if k.startswith(Prefix)
            ]
            if self.s3.shuffle_lists and self.s3.scheduler is not None:
                self.s3.scheduler.rng.shuffle(contents)
            page: dict[str, Any] = {"KeyCount": len(contents), "ResponseMetadata": self.s3.metadata(200)}
            if contents:
                page["Contents"] = contents
            return page

        return self.s3.call("list_objects_v2", Bucket, Prefix, apply)

    def get_paginator(self, name: str) -> _Paginator:
        assert name == "list_objects_v2", name
        return _Paginator(self)

    def generate_presigned_url(self, ClientMethod: str, Params: dict, ExpiresIn: int = 3600, **_: Any) -> str:
        return f"http://s3.sim/{Params['Bucket']}/{Params['Key']}?X-Amz-Signature=sim{ExpiresIn}"


class FakeS3Hook(S3Hook):
    """``S3Hook`` with its client replaced by the fake: every hook method the run code calls runs as it would."""

    def __init__(self, client: FakeS3Client, aws_conn_id: str = "aws_default") -> None:
        super().__init__(aws_conn_id=aws_conn_id)
        self._fake_client = client
        self._log = logging.getLogger("airflow.task.hooks.sim_s3")

    def get_conn(self) -> FakeS3Client:  # type: ignore[override]
        return self._fake_client

    @property
    def conn(self) -> FakeS3Client:  # type: ignore[override]
        return self._fake_client

    def generate_presigned_url(
        self,
        client_method: str,
        params: dict | None = None,
        expires_in: int = 3600,
        http_method: str | None = None,
    ) -> str:  # type: ignore[override]
        return self._fake_client.generate_presigned_url(client_method, params or {}, expires_in)
