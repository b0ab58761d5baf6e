"""OpenAI's Files and Batch APIs: /v1/files and /v1/batches, served from a ``BatchStore``.

    POST /v1/files (multipart: file, purpose=batch)   GET /v1/files   GET|DELETE /v1/files/{id}
    GET /v1/files/{id}/content
    POST /v1/batches   GET /v1/batches   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

``BatchService`` is the app's side of it: the store folder (``--batch-store``, by default
``$PAGEDSERVE_HOME/batches``), opened on first use or, when it already holds a database, at
startup, so that a restarted server resumes its batches at once; and the ``BatchWorker`` that
runs them at ``--batch-priority``, at most ``--batch-max-seq-share`` of ``--max-num-seqs``
sequences at a time.

The worker lives in the event loop that serves the app (uvicorn's one loop). An in-process test
client without the lifespan runs each request in a loop of its own: the worker then starts
again in the new loop and resumes the store's batches, as after a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from pydantic import BaseModel
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from pagedserve.server.batch_runner import LineRunner, SequenceBudget, served_post_paths
from pagedserve.server.batch_store import BatchStore, StoreLockedError
from pagedserve.server.batch_worker import BatchNotCancellable, BatchWorker
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.protocol_batches import (
    BatchList,
    BatchObject,
    CreateBatchRequest,
    FileDeleted,
    FileList,
    FileObject,
    FileUpload,
)
from pagedserve.server.request_bodies import read_body
from pagedserve.server.state import ServerState, now_s

logger = logging.getLogger("pagedserve.server")
FILE_FIELDS = frozenset(FileUpload.model_fields)  # the form parts POST /v1/files reads


def default_store_folder() -> Path:
    home = os.environ.get("PAGEDSERVE_HOME") or Path.home() / ".cache" / "pagedserve"
    return Path(home) / "batches"


class BatchService:
    """The Batch API of one served model (see the module docstring)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state
        config = state.config
        self.folder = Path(config.batch_store) if config.batch_store else default_store_folder()
        self._store: BatchStore | None = None
        self._worker: BatchWorker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def capacity(self) -> int:
        """The sequences batch requests may hold in the engine at once."""
        max_num_seqs = self.state.engine.scheduler_config.max_num_seqs
        return max(1, int(self.state.config.batch_max_seq_share * max_num_seqs))

    def store(self) -> BatchStore:
        if self._store is None:
            try:
                self._store = BatchStore.open(self.folder)
            except StoreLockedError as e:
                raise APIError(str(e), 503, code="batch_store_locked") from e
        return self._store

    def worker(self) -> BatchWorker:
        """The worker of this event loop, started (and the store's batches resumed) on first
        use in it."""
        loop = asyncio.get_running_loop()
        if self._worker is None or self._loop is not loop:
            config = self.state.config
            runner = LineRunner(self.app, config.api_key, config.batch_priority)
            budget = SequenceBudget(self.capacity)
            served = served_post_paths(self.app)
            self._worker = BatchWorker(self.store(), runner, budget, served)
            self._loop = loop
            self._worker.start()
            self._advise_priority_policy()
        return self._worker

    def _advise_priority_policy(self) -> None:
        policy = self.state.engine.scheduler_config.policy
        if policy != "priority":
            logger.warning(
                "batches run under --scheduling-policy %s: their priority (--batch-priority) "
                "changes nothing, only their cap of %d sequences keeps room for interactive "
                "requests; --scheduling-policy priority also lets interactive requests go "
                "first in the queue and preempt batch requests",
                policy,
                self.capacity,
            )

    async def start(self) -> None:
        """At startup: resume the batches of a store that already exists (a restart)."""
        if (self.folder / "batches.sqlite3").exists():
            try:
                self.worker()
            except APIError as e:
                logger.warning("the Batch API cannot resume its batches: %s", e.message)

    async def stop(self) -> None:
        if self._worker is not None:
            await self._worker.stop()
            await self._worker.runner.aclose()
            self._worker = None
        if self._store is not None:
            self._store.close()
            self._store = None


def service_of(request: Request) -> BatchService:
    """The app's Batch API (``pagedserve serve``'s; the cluster's ingress has none)."""
    service = getattr(request.app.state, "batches", None)
    if service is None:
        raise APIError(
            f"no route {request.method} {request.url.path}: this server has no Batch API", 404
        )
    return service


def answer(model: type[BaseModel], data: dict, status_code: int = 200) -> JSONResponse:
    return JSONResponse(model.model_validate(data).model_dump(), status_code=status_code)


def list_limit(request: Request, default: int, most: int) -> int:
    text = request.query_params.get("limit", str(default))
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise bad_request(f"limit must be an integer in [1, {most}], got {text!r}", "limit")
    return int(text)


# ---- files ---------------------------------------------------------------------------------


async def create_file(request: Request) -> Response:
    """POST /v1/files: a JSONL file of batch requests (purpose ``batch``), multipart."""
    service = service_of(request)
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise APIError(f"the body must be multipart/form-data, got {content_type!r}", 415)
    async with request.form(max_files=1, max_fields=len(FILE_FIELDS)) as form:
        unknown = sorted(set(form.keys()) - FILE_FIELDS)
        if unknown:
            raise bad_request(
                f"unknown field {unknown[0]!r}: a file takes file and purpose", unknown[0]
            )
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise bad_request(
                f"purpose must be 'batch' (pagedserve stores files for the Batch API), got "
                f"{purpose!r}",
                "purpose",
            )
        if not isinstance(upload, UploadFile):
            raise bad_request(
                "file must be a file upload (a multipart part with a filename)", "file"
            )
        store = service.store()
        filename = upload.filename or "upload.jsonl"
        file = await asyncio.to_thread(store.add_file, upload.file, filename, "batch", now_s())
    return answer(FileObject, file)


def known_file(request: Request) -> dict:
    file_id = request.path_params["file_id"]
    file = service_of(request).store().get_file(file_id)
    if file is None:
        raise APIError(f"No such File object: {file_id}", 404, param="file_id")
    return file


async def retrieve_file(request: Request) -> Response:
    return answer(FileObject, known_file(request))


async def file_content(request: Request) -> Response:
    file = known_file(request)
    path = service_of(request).store().file_path(file["id"])
    return FileResponse(path, media_type="application/octet-stream", filename=file["filename"])


async def list_files(request: Request) -> Response:
    params = request.query_params
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be asc or desc, got {order!r}", "order")
    limit = list_limit(request, 10_000, 10_000)
    store = service_of(request).store()
    files = store.list_files(params.get("purpose"), params.get("after"), limit + 1, order)
    return answer(FileList, listing(files, limit))


async def delete_file(request: Request) -> Response:
    file = known_file(request)
    store = service_of(request).store()
    for batch_id in store.active_batch_ids():
        if store.get_batch(batch_id)["input_file_id"] == file["id"]:
            raise APIError(f"the file is the input of {batch_id}, which is still running", 409)
    store.delete_file(file["id"])
    return answer(FileDeleted, {"id": file["id"], "deleted": True})


def listing(items: list[dict], limit: int) -> dict:
    """OpenAI's list page of ``items`` (fetched one past ``limit``, to know whether more follow)."""
    page = items[:limit]
    return {
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


# ---- batches -------------------------------------------------------------------------------


async def create_batch(request: Request) -> Response:
    body = await read_body(request, CreateBatchRequest)
    service = service_of(request)
    file = service.store().get_file(body.input_file_id)
    if file is None or file["purpose"] != "batch":
        what = "no such file" if file is None else f"a file of purpose {file['purpose']!r}"
        message = f"input_file_id {body.input_file_id!r} is {what}: upload one with purpose batch"
        raise bad_request(message, "input_file_id")
    if body.endpoint not in served_post_paths(request.app):
        raise bad_request(f"this server does not serve {body.endpoint}", "endpoint")
    worker = service.worker()
    batch = worker.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata)
    return answer(BatchObject, batch)


def known_batch(request: Request) -> dict:
    batch_id = request.path_params["batch_id"]
    batch = service_of(request).store().get_batch(batch_id)
    if batch is None:
        raise APIError(f"No batch found with id {batch_id!r}", 404, param="batch_id")
    return batch


async def retrieve_batch(request: Request) -> Response:
    return answer(BatchObject, known_batch(request))


async def list_batches(request: Request) -> Response:
    limit = list_limit(request, 20, 100)
    store = service_of(request).store()
    batches = store.list_batches(request.query_params.get("after"), limit + 1)
    return answer(BatchList, listing(batches, limit))


async def cancel_batch(request: Request) -> Response:
    batch = known_batch(request)
    try:
        batch = service_of(request).worker().cancel(batch["id"])
    except BatchNotCancellable as e:
        raise APIError(str(e), 409, param="batch_id") from e
    return answer(BatchObject, batch)


ROUTES = [
    Route("/v1/files", create_file, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", retrieve_file, methods=["GET"]),
    Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
    Route("/v1/batches", create_batch, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", retrieve_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
]
