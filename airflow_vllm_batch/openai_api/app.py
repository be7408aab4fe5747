"""The FastAPI app of the OpenAI Files and Batches API, mounted on Airflow's API server by :mod:`.plugin`.

The SDK's ``api_key`` is an Airflow API token (``POST /auth/token``): the app resolves the
user with Airflow's own dependency (``airflow.api_fastapi.core_api.security.get_user``), so
a request without one is answered 401, and every route takes its caller from
:mod:`.callers`, which asks the API's own rule (:func:`.access.may_use`): 403 if it says no. API users need no
permission on the batch DAG: the API triggers, reads and cancels its runs itself. Errors
have OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) so that the SDK
raises its own exception classes.

The routes and the error shapes only: the work behind them is in :mod:`.files` (the S3
layout and uploads), :mod:`.batch_runs` (the batch DAG's runs in Airflow's database),
:mod:`.batch_view` (what a batch shows), :mod:`.status` (OpenAI's statuses),
:mod:`.routes` (which engine serves a model), :mod:`.batch_spec` (the signed spec),
:mod:`.access` (who may do what) and :mod:`.errors` (the error every route raises).
"""

from __future__ import annotations

import logging
import time
import uuid
from functools import lru_cache
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from airflow_vllm_batch.exceptions import ConfigurationError, ManifestVersionError
from airflow_vllm_batch.openai_api.access import owner_key, register_fab_permissions, warn_if_not_isolated
from airflow_vllm_batch.openai_api.batch_runs import BatchRun, Verifier, find_run, trigger_run, user_runs
from airflow_vllm_batch.openai_api.batch_spec import (
    BatchSpec,
    ForgedBatchError,
    signing_key,
    verification_keys,
)
from airflow_vllm_batch.openai_api.batch_view import batch_from_run, shown_conf
from airflow_vllm_batch.openai_api.callers import Canceller, Creator, Deleter, Reader
from airflow_vllm_batch.openai_api.errors import OpenAIError
from airflow_vllm_batch.openai_api.files import (
    BATCH_ID,
    PART_BYTES,
    FileStore,
    FormReader,
    LineCounter,
    UploadError,
    file_object_from_record,
    new_batch_id,
    new_file_id,
)
from airflow_vllm_batch.openai_api.limits import (
    LimitExceeded,
    UserLimits,
    check_batch,
    check_file_bytes,
    check_upload,
    load_limits,
)
from airflow_vllm_batch.openai_api.routes import load_routes, models_in, route_of
from airflow_vllm_batch.openai_api.settings import OpenAIApiSettings, load_settings
from airflow_vllm_batch.openai_api.status import BatchDagRun, batch_object, window_seconds
from airflow_vllm_batch.storage.s3 import ObjectWriter

log = logging.getLogger(__name__)

#: The endpoints a batch may name (the engines' batch URLs).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
#: OpenAI's limits on a batch's metadata.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: Parameters of OpenAI's that this API refuses rather than ignore (it keeps files until they are deleted).
REFUSED_FILE_FIELDS = ("expires_after[anchor]", "expires_after[seconds]", "expires_after")


class BatchCreate(BaseModel):
    """The body of ``POST /batches``; a parameter it does not know is refused (400 naming it), not ignored."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(default=None)


app = FastAPI(title="OpenAI Files and Batches API (airflow-vllm-batch)", version="1")


class RequestIdMiddleware:
    """Give every response an ``x-request-id`` (``req_<hex>``), as OpenAI's do: the SDK shows it as ``_request_id``.

    Pure ASGI, so that uploads and downloads stream through it untouched.

    :param app: the ASGI app it wraps.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


app.add_middleware(RequestIdMiddleware)
# Once, when the app is built (the plugin imports this module on the API server's first request).
warn_if_not_isolated()
register_fab_permissions()


def _error_body(
    message: str,
    status_code: int,
    param: str | None = None,
    code: str | None = None,
    kind: str | None = None,
) -> dict[str, Any]:
    if kind is None:
        kind = "invalid_request_error" if status_code < 500 else "server_error"
        if status_code == 401:
            kind = "authentication_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@app.exception_handler(HTTPException)
async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
    detail = err.detail if isinstance(err.detail, str) else str(err.detail)
    status_code, headers = err.status_code, getattr(err, "headers", None)
    if status_code in (401, 403) and not isinstance(err, OpenAIError):
        # Airflow's token check (the only other source of these) answers 403 for a wrong token:
        # to OpenAI's clients any token that does not authenticate is a 401 (AuthenticationError).
        status_code, headers = 401, {"WWW-Authenticate": "Bearer"}
        detail = f"The API key (an Airflow API token) was not accepted ({detail}): get a new one with POST /auth/token and pass it as api_key."
    body = _error_body(detail, status_code, getattr(err, "param", None), getattr(err, "code", None))
    return JSONResponse(body, status_code=status_code, headers=headers)


@app.exception_handler(LimitExceeded)
async def _over_limit(request: Request, err: LimitExceeded) -> JSONResponse:
    # Only a deleted file or an ended batch changes the answer: the SDK should not retry it.
    body = _error_body(str(err), err.status, err.param, err.code, err.kind)
    return JSONResponse(body, status_code=err.status, headers={"x-should-retry": "false"})


@app.exception_handler(Exception)
async def _server_error(request: Request, err: Exception) -> JSONResponse:
    # Outside the middleware stack (Starlette's last resort): the request id is given here.
    log.exception("The OpenAI API failed on %s %s", request.method, request.url.path)
    body = _error_body("The server failed on this request; its log says why. Try again later.", 500)
    return JSONResponse(body, status_code=500, headers={"x-request-id": new_request_id()})


@app.exception_handler(ManifestVersionError)
async def _newer_manifest(request: Request, err: ManifestVersionError) -> JSONResponse:
    # A batch published by a newer release of the provider than this API server runs: upgrade the server.
    return JSONResponse(_error_body(str(err), 500), status_code=500)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0] if err.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    message = f"{param}: {first.get('msg', 'invalid request')}"
    if first.get("type") == "extra_forbidden":
        message = f"{param} is not a parameter this API takes: leave it out (a batch's files are kept until they are deleted)"
    return JSONResponse(_error_body(message, 400, param), status_code=400)


def _settings() -> OpenAIApiSettings:
    try:
        return load_settings()
    except ConfigurationError as err:
        raise OpenAIError(503, str(err)) from None


@lru_cache(maxsize=4)
def _s3_client(aws_conn_id: str) -> Any:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    return S3Hook(aws_conn_id=aws_conn_id).get_conn()


def _store(settings: OpenAIApiSettings) -> FileStore:
    return FileStore(_s3_client(settings.aws_conn_id), settings.bucket, settings.prefix)


def _page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


# -- files ----------------------------------------------------------------------------


@app.post("/files")
async def create_file(request: Request, user: Creator) -> dict[str, Any]:
    """Upload a batch input file (``multipart/form-data``: ``purpose=batch``, ``file``), streamed to S3 part by part."""
    settings = await run_in_threadpool(_settings)
    store = await run_in_threadpool(_store, settings)
    owner, file_id = owner_key(user.get_id()), new_file_id()
    try:
        reader = FormReader(request.headers.get("content-type", ""))
    except UploadError as err:
        raise OpenAIError(err.status, str(err)) from None
    limits = _limits()
    kept = await run_in_threadpool(check_upload, limits, store, owner)
    writer = ObjectWriter(
        store.client, store.bucket, store.content_key(owner, file_id), content_type="application/jsonl"
    )
    counter, pending = LineCounter(), bytearray()
    try:
        async for chunk in request.stream():
            data = reader.feed(chunk)
            if not data:
                continue
            _check_purpose(reader.fields.get("purpose", "batch"))
            _check_no_expiry(reader.fields)
            counter.add(data)
            check_file_bytes(limits, kept, counter.bytes)
            if counter.bytes > settings.max_file_bytes:
                raise UploadError(
                    f"the file is larger than {settings.max_file_bytes} bytes ([vllm_batch] openai_max_file_bytes): split it",
                    413,
                )
            pending += data
            while len(pending) >= PART_BYTES:
                # One copy of a part, not two (a slice of a bytearray is a copy too).
                with memoryview(pending) as view:
                    part = bytes(view[:PART_BYTES])
                del pending[:PART_BYTES]
                await run_in_threadpool(writer.write_part, part)
        reader.finish()
        _check_purpose(reader.fields.get("purpose"))
        _check_no_expiry(reader.fields)
        await run_in_threadpool(writer.finish, bytes(pending))
    except UploadError as err:
        await run_in_threadpool(writer.abort)
        raise OpenAIError(
            err.status, str(err), err.param or ("file" if err.status == 413 else None)
        ) from None
    except BaseException:
        await run_in_threadpool(writer.abort)
        raise
    record = {
        "id": file_id,
        "bytes": counter.bytes,
        "created_at": int(time.time()),
        "filename": reader.filename or f"{file_id}.jsonl",
        "purpose": "batch",
        "lines": counter.lines,
    }
    await run_in_threadpool(store.save_record, owner, record)
    return file_object_from_record(record)


def _limits() -> UserLimits:
    try:
        return load_limits()
    except ConfigurationError as err:
        raise OpenAIError(503, str(err)) from None


def _check_no_expiry(fields: dict[str, str]) -> None:
    if any(name in fields for name in REFUSED_FILE_FIELDS):
        raise UploadError(
            "expires_after is not supported: this API keeps a file until it is deleted (DELETE /files/{id}); leave it out",
            param="expires_after",
        )


def _check_purpose(purpose: str | None) -> None:
    if purpose != "batch":
        raise UploadError(
            f"purpose is {purpose!r}: this API keeps batch input files only, send purpose='batch'"
        )


@app.get("/files")
def list_files(
    user: Reader,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = Query(10000, ge=1, le=10000),
    order: str = Query("desc", pattern="^(asc|desc)$"),
) -> dict[str, Any]:
    """The caller's files, newest first (``order=asc``: oldest first), paged by ``after`` and ``limit``."""
    store = _store(_settings())
    files = store.list_files(owner_key(user.get_id()), purpose)
    if order == "asc":
        files.reverse()
    return _page(files, after, limit)


@app.get("/files/{file_id}")
def retrieve_file(file_id: str, user: Reader) -> dict[str, Any]:
    """One of the caller's files."""
    found = _store(_settings()).file_object(owner_key(user.get_id()), file_id)
    if found is None:
        raise _no_file(file_id)
    return found


@app.get("/files/{file_id}/content")
def file_content(file_id: str, user: Reader) -> StreamingResponse:
    """The bytes of one of the caller's files, streamed from S3."""
    chunks = _store(_settings()).content(owner_key(user.get_id()), file_id)
    if chunks is None:
        raise _no_file(file_id)
    return StreamingResponse(chunks, media_type="application/octet-stream")


@app.delete("/files/{file_id}")
def delete_file(file_id: str, user: Deleter) -> dict[str, Any]:
    """Delete one of the caller's files."""
    if not _store(_settings()).delete_file(owner_key(user.get_id()), file_id):
        raise _no_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def _no_file(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such File object: {file_id}", "file_id")


# -- batches --------------------------------------------------------------------------


@app.post("/batches")
def create_batch(body: BatchCreate, user: Creator) -> dict[str, Any]:
    """Start a batch: pin its input, sign what its run may do, trigger a run of the batch DAG."""
    settings = _settings()
    dag_id = settings.batch_dag_id
    if body.endpoint not in ENDPOINTS:
        raise OpenAIError(400, f"endpoint {body.endpoint!r} is not one of {', '.join(ENDPOINTS)}", "endpoint")
    if body.completion_window not in settings.completion_windows:
        accepted = ", ".join(repr(w) for w in settings.completion_windows)
        raise OpenAIError(
            400,
            f"completion_window {body.completion_window!r} is not offered here: use {accepted} ([vllm_batch] openai_completion_windows)",
            "completion_window",
        )
    window_s = window_seconds(body.completion_window)
    _check_metadata(body.metadata)
    key = _signing_key()
    store = _store(settings)
    owner = owner_key(user.get_id())
    record = (
        store.get_json(store.record_key(owner, body.input_file_id))
        if body.input_file_id.startswith("file-")
        else None
    )
    if record is None:
        raise _not_an_input(body.input_file_id)
    check_batch(
        _limits(), dag_id, store, settings.aws_conn_id, user, int(record.get("lines") or 0), _verifier()
    )
    batch_id = new_batch_id()
    # The batch runs this copy (its ETag is signed): deleting or replacing the file later changes nothing of it.
    version = store.pin_input(owner, body.input_file_id, batch_id)
    if version is None:
        raise _not_an_input(body.input_file_id)
    try:
        route = _route(store, store.batch_input_key(batch_id))  # the models of the copy the batch runs
    except BaseException:
        _forget_batch(store, batch_id)
        raise
    spec = BatchSpec(
        batch_id=batch_id,
        dag_id=dag_id,
        owner=user.get_id(),
        input_file_id=body.input_file_id,
        input_version=version,
        endpoint=body.endpoint,
        route=route.get("route", ""),
        created_at=int(time.time()),
        window_s=window_s,
    )
    # What everyone who may read the batch DAG's runs sees: the signed spec only, no S3 location and no
    # metadata. What the status shows besides is the API's own record's (never an unsigned conf field).
    conf = spec.sign(key)
    shown = {
        "metadata": body.metadata or {},
        "completion_window": body.completion_window,
        "total": int(record.get("lines") or 0),
        **({"model": route["model"]} if "model" in route else {}),
    }
    try:
        store.put_json(store.batch_record_key(batch_id), shown)
        _trigger(dag_id, batch_id, conf, user.get_name())
    except BaseException:
        _forget_batch(store, batch_id)
        raise
    return batch_object(batch_id, BatchDagRun(conf=shown_conf(spec, shown), run_state="queued"), time.time())


def _forget_batch(store: FileStore, batch_id: str) -> None:
    """Remove what a create that failed made (the input copy, the record): no run will ever read them."""
    for key in (store.batch_input_key(batch_id), store.batch_record_key(batch_id)):
        try:
            store.client.delete_object(Bucket=store.bucket, Key=key)
        except Exception as err:  # noqa: BLE001 - the create's own error is the one to answer
            log.warning("Could not remove %s of a batch that was not created: %s", key, err)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """Refuse metadata over OpenAI's limits: 16 pairs, keys of 64 characters, values of 512."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise OpenAIError(
            400, f"metadata has {len(metadata)} keys: give at most {MAX_METADATA_PAIRS}", "metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise OpenAIError(
                400,
                f"metadata key {key[:20]!r}... has {len(key)} characters: give at most {MAX_METADATA_KEY_CHARS}",
                "metadata",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise OpenAIError(
                400,
                f"metadata[{key!r}] has {len(value)} characters: give at most {MAX_METADATA_VALUE_CHARS}",
                "metadata",
            )


def _not_an_input(file_id: str) -> OpenAIError:
    return OpenAIError(
        400,
        f"input_file_id {file_id!r} names none of your uploaded files: upload it with purpose='batch'",
        "input_file_id",
    )


def _signing_key() -> str:
    try:
        return signing_key()
    except ConfigurationError as err:
        raise OpenAIError(503, str(err)) from None


def _route(store: FileStore, key: str) -> dict[str, str]:
    """The model and batch task of a file's batch, when ``openai_models`` is configured: its lines must name one of them.

    Reads the file's lines for their ``body.model`` (streamed; it stops at the tenth model).
    """
    try:
        routes = load_routes()
    except ConfigurationError as err:
        raise OpenAIError(503, str(err)) from None
    if not routes:
        return {}
    body = store.client.get_object(Bucket=store.bucket, Key=key)["Body"]
    try:
        models = models_in(body.iter_lines())
    finally:
        body.close()
    try:
        chosen = route_of(models, routes)
    except ValueError as err:
        raise OpenAIError(400, str(err), "model") from None
    return {"model": chosen.model, "route": chosen.task_id}


def _trigger(dag_id: str, batch_id: str, conf: dict[str, Any], user_name: str) -> None:
    try:
        trigger_run(dag_id, batch_id, conf, user_name)
    except ConfigurationError as err:
        raise OpenAIError(503, str(err)) from None


@app.get("/batches")
def list_batches(
    user: Reader, after: str | None = None, limit: int = Query(20, ge=1, le=100)
) -> dict[str, Any]:
    """The caller's batches, newest first, paged by ``after`` (a batch id) and ``limit``."""
    settings = _settings()
    store = _store(settings)
    runs = user_runs(settings.batch_dag_id, user.get_id(), user.get_name(), after, limit + 1, _verifier())
    objects = [batch_from_run(store, batch, settings.aws_conn_id) for batch in runs]
    return {
        "object": "list",
        "data": objects[:limit],
        "first_id": objects[0]["id"] if objects else None,
        "last_id": objects[:limit][-1]["id"] if objects else None,
        "has_more": len(objects) > limit,
    }


@app.get("/batches/{batch_id}")
def retrieve_batch(batch_id: str, user: Reader) -> dict[str, Any]:
    """One of the caller's batches."""
    settings = _settings()
    batch = _own_run(settings, batch_id, user)
    return batch_from_run(_store(settings), batch, settings.aws_conn_id, live=True)


@app.post("/batches/{batch_id}/cancel")
def cancel_batch(batch_id: str, user: Canceller) -> dict[str, Any]:
    """Cancel one of the caller's batches: ask its run to stop; the run publishes what it answered and ends ``cancelled``.

    Nothing here stops a task or changes the DAG run: the batch task polls the cancel request
    under its lease, stops sending, and publishes its finished answers (the rest as
    ``batch_cancelled``) through the run protocol. A batch whose task has not started stays
    ``cancelling`` until it does; it then publishes without starting an engine. An ended batch
    (cancelled included) answers 409.
    """
    settings = _settings()
    batch = _own_run(settings, batch_id, user)
    store = _store(settings)
    before = batch_from_run(store, batch, settings.aws_conn_id)
    if before["status"] == "cancelling":
        return before
    if before["status"] in ("completed", "failed", "expired", "cancelled"):
        raise OpenAIError(409, f"Cannot cancel a batch with status {before['status']!r}: it has ended")
    now = int(time.time())
    store.put_json(store.cancel_key(batch_id), {"cancelling_at": now, "by": user.get_name()})
    return {**before, "status": "cancelling", "cancelling_at": now}


def _verifier() -> Verifier:
    """The request's check of batch runs: the accepted keys are read (and masked) once, each run's signature checked once.

    Any accepted key verifies (the signing key or an old one kept for rotation): a rotation hides no batch.
    """
    try:
        keys = verification_keys()
    except ConfigurationError as err:
        raise OpenAIError(503, str(err)) from None

    def verify(run: Any) -> BatchSpec | None:
        try:
            return BatchSpec.verified(run.conf, run.run_id, keys, run.dag_id)
        except ForgedBatchError:
            return None

    return verify


def _own_run(settings: OpenAIApiSettings, batch_id: str, user: Any) -> BatchRun:
    """One of the caller's batch runs, its spec verified; 404 for anyone else's, and for a run the API did not make."""
    missing = OpenAIError(404, f"No such Batch object: {batch_id}", "batch_id")
    if not BATCH_ID.match(batch_id):
        raise missing
    found = find_run(settings.batch_dag_id, batch_id, user.get_id(), _verifier())
    if found is None:
        raise missing
    return found
