"""The Batch API routes on the service's OpenAI app (OpenAI's shapes):

  POST /v1/files                    multipart `file` + `purpose` ("batch") -> file object
  GET  /v1/files/{id}               the file object;   GET /v1/files/{id}/content: its bytes
  POST /v1/batches                  {input_file_id, endpoint, completion_window, metadata}
  GET  /v1/batches/{id}             the batch;   GET /v1/batches?limit=&after=: newest first
  POST /v1/batches/{id}/cancel      the batch, cancelling (the runner finishes it)

Bad input is an OpenAI-style 400 naming the parameter, an unknown id a 404, a cancel of
a batch that is done (or being finalized) a 409. Any service answers these (state on
disk); the master runs the batches (runner.py).
"""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from xllm_py.api.errors import APIError
from xllm_service.batch.files import FileStore
from xllm_service.batch.state import COMPLETION_WINDOW_S, ENDPOINTS, BatchRecord, BatchStatus
from xllm_service.batch.store import BatchStore, new_batch_id

MAX_LIST = 100


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(message, status_code=400, error_type="invalid_request_error", param=param)


def _not_found(what: str, ident: str) -> APIError:
    return APIError(f"no {what} with id {ident!r}", status_code=404,
                    error_type="invalid_request_error", code="not_found")


def _view(store: BatchStore, record: BatchRecord) -> dict:
    out = record.to_api()
    if not record.status.is_final and store.cancel_requested(record.id):
        out["status"] = BatchStatus.CANCELLING.value
    return out


def install_batch_api(app: FastAPI, files: FileStore, store: BatchStore) -> None:
    @app.post("/v1/files")
    async def create_file(request: Request) -> Response:
        try:
            form = await request.form()
        except Exception as exc:  # not multipart, or unreadable
            raise _bad(f"expected a multipart form with file and purpose: {exc}") from None
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise _bad(f"purpose must be 'batch', got {purpose!r}", "purpose")
        if upload is None or isinstance(upload, str):
            raise _bad("file is required (a multipart file field)", "file")
        data = await upload.read()
        return JSONResponse(files.create(data, upload.filename or "upload.jsonl", purpose))

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> Response:
        meta = files.get(file_id)
        if meta is None:
            raise _not_found("file", file_id)
        return JSONResponse(meta)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        data = files.content(file_id)
        if data is None:
            raise _not_found("file", file_id)
        return Response(data, media_type="application/octet-stream")

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise _bad("the body must be JSON") from None
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or files.get(file_id) is None:
            raise _bad(f"input_file_id {file_id!r} names no uploaded file", "input_file_id")
        if files.get(file_id)["purpose"] != "batch":
            raise _bad(f"file {file_id} was not uploaded with purpose 'batch'", "input_file_id")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise _bad(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}",
                       "endpoint")
        window = body.get("completion_window", "24h")
        if window not in COMPLETION_WINDOW_S:
            raise _bad(f"completion_window must be one of {', '.join(COMPLETION_WINDOW_S)}, "
                       f"got {window!r}", "completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise _bad("metadata must be an object", "metadata")
        record = BatchRecord(id=new_batch_id(), input_file_id=file_id, endpoint=endpoint,
                             completion_window=window, metadata=metadata)
        store.save(record)
        return JSONResponse(_view(store, record))

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str) -> Response:
        record = store.get(batch_id)
        if record is None:
            raise _not_found("batch", batch_id)
        return JSONResponse(_view(store, record))

    @app.get("/v1/batches")
    async def list_batches(limit: int = 20, after: str | None = None) -> Response:
        if not 1 <= limit <= MAX_LIST:
            raise _bad(f"limit must be in [1, {MAX_LIST}], got {limit}", "limit")
        records = store.list()
        if after is not None:
            ids = [r.id for r in records]
            records = records[ids.index(after) + 1:] if after in ids else []
        page = records[:limit]
        return JSONResponse({"object": "list", "data": [_view(store, r) for r in page],
                             "first_id": page[0].id if page else None,
                             "last_id": page[-1].id if page else None,
                             "has_more": len(records) > limit})

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> Response:
        record = store.get(batch_id)
        if record is None:
            raise _not_found("batch", batch_id)
        if record.status.is_final or record.status is BatchStatus.FINALIZING:
            raise APIError(f"batch {batch_id} is {record.status.value}: it cannot be "
                           "cancelled", status_code=409, error_type="invalid_request_error")
        store.request_cancel(batch_id)
        return JSONResponse(_view(store, record))
