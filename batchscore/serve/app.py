"""The HTTP routes of `batchscore serve`, shaped as the OpenAI Files and Batch API: the same
objects, statuses, list pagination and `{"error": {message, type, param, code}}` bodies."""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchscore.errors import APIError
from batchscore.formats.openai_batch import CHAT_URLS, DECISION_URLS
from batchscore.io.readers import lone_surrogate_field
from batchscore.serve.auth import authorized
from batchscore.serve.requests import SURROGATE, metadata_calibration, metadata_labels, safe_name
from batchscore.serve.store import Store, new_id, now
from batchscore.serve.worker import Worker, stage_input

log = logging.getLogger(__name__)

ENDPOINTS = CHAT_URLS + DECISION_URLS
COMPLETION_WINDOW = "24h"
WINDOW_S = 24 * 3600
CHUNK = 1 << 20


@dataclass
class Limits:
    max_file_bytes: int = 200 * 1024 * 1024  # as the OpenAI Batch API: 200 MB per input file
    max_requests: int = 50_000  # as the OpenAI Batch API: 50,000 requests per batch


def create_app(store: Store, worker: Worker, key: str | None, model: str, limits: Limits) -> FastAPI:
    app = FastAPI(title="batchscore", docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=EncodableJSON)

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if not authorized(key, request.url.path, request.headers.get("authorization")):
            given = bool(request.headers.get("authorization"))
            return _error(APIError(401, "Incorrect API key provided." if given else
                                   "You didn't provide an API key: send it as 'Authorization: Bearer KEY'.",
                                   code="invalid_api_key"))
        return await call_next(request)

    @app.middleware("http")
    async def access_log(request: Request, call_next):
        """One INFO line per request: method, path, status, time (never the key or a body).
        Added last, so outermost: refused requests (401) are logged too."""
        started = time.perf_counter()
        response = await call_next(request)
        log.info("%s %s %d %.0f ms", request.method, request.url.path, response.status_code,
                 (time.perf_counter() - started) * 1000)
        return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(APIError(400, f"{where or 'request'}: {first.get('msg', 'invalid request')}", param=where))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        """A route that is not there (404) or a method it does not take (405), as OpenAI words them."""
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            error = APIError(404, f"Invalid URL ({where})", code="not_found")
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
            error = APIError(405, f"Invalid method ({where})" + (f"; this URL takes {allowed}" if allowed else ""),
                             code="method_not_allowed")
        else:
            error = APIError(exc.status_code, str(exc.detail))
        response = _error(error)
        response.headers.update({k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"})
        return response

    @app.get("/health")
    def health():
        return {"status": "ok"}

    # --- files ------------------------------------------------------------------------------

    @app.post("/v1/files")
    async def upload(request: Request):
        # The form is parsed here, not by FastAPI before the call: an upload over the limit is
        # refused as its bytes arrive (a declared length at once), never received whole first.
        declared = request.headers.get("content-length") or "0"
        if not declared.isdigit() or int(declared) > limits.max_file_bytes + CHUNK:  # + the multipart envelope
            raise _too_large(limits)
        form = await Request(request.scope, _at_most(request.receive, limits.max_file_bytes + CHUNK, limits)).form(
            max_files=1, max_fields=4)
        file, purpose = form.get("file"), form.get("purpose")
        if not isinstance(file, UploadFile):
            raise APIError(400, "file: missing (send the file as the multipart field 'file')", param="file",
                           code="missing_required_parameter")
        if purpose != "batch":
            raise APIError(400, f"purpose: {purpose!r} is not accepted; this server takes 'batch' files",
                           param="purpose", code="invalid_value")
        target, size, lines = store.incoming_path(), 0, 0
        try:
            with target.open("wb") as out:
                while chunk := await file.read(CHUNK):
                    size += len(chunk)
                    lines += chunk.count(b"\n")
                    if size > limits.max_file_bytes:
                        raise _too_large(limits)
                    out.write(chunk)
            if lines > limits.max_requests + 1:  # + 1: a last line without its newline is not counted
                raise APIError(400, f"file: {lines} lines; a batch takes at most {limits.max_requests} requests",
                               param="file", code="too_many_requests")
            return store.add_file(target, file.filename or "input.jsonl", purpose)
        finally:
            target.unlink(missing_ok=True)
            await form.close()

    @app.get("/v1/files")
    def list_files(purpose: str | None = None, limit: int = 10_000, order: str = "desc", after: str | None = None):
        if not 1 <= limit <= 10_000:
            raise APIError(400, "limit: must be between 1 and 10000", param="limit", code="invalid_value")
        if order not in ("asc", "desc"):
            raise APIError(400, "order: must be 'asc' or 'desc'", param="order", code="invalid_value")
        items, has_more = store.list_files(limit, after, purpose, newest_first=order == "desc")
        return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None, "has_more": has_more}

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str):
        return store.file(file_id)

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str):
        path = store.file_path(file_id)
        if not path.is_file():
            raise APIError(500, f"the content of {file_id} is missing on this server", type="server_error",
                           param="file_id", code="file_content_missing")
        # the name as a plain file name: an uploaded name can hold folders, quotes, line breaks
        return FileResponse(path, media_type="application/jsonl", filename=safe_name(store.file(file_id)["filename"]))

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str):
        return store.delete_file(file_id)

    # --- batches ----------------------------------------------------------------------------

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        body = await _json_object(request)
        input_file_id = _required_text(body, "input_file_id")
        endpoint = _required_text(body, "endpoint")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint: {endpoint!r} is not one this server runs ({', '.join(ENDPOINTS)})",
                           param="endpoint", code="invalid_value")
        if body.get("completion_window") != COMPLETION_WINDOW:
            raise APIError(400, f"completion_window: must be {COMPLETION_WINDOW!r}", param="completion_window",
                           code="invalid_value")
        metadata = _metadata(body.get("metadata"), worker.settings.sets)
        if store.file(input_file_id)["purpose"] != "batch":
            raise APIError(400, f"input_file_id: {input_file_id} was not uploaded with purpose 'batch'",
                           param="input_file_id", code="invalid_value")
        created = now()
        batch = {"id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "model": model, "errors": None,
                 "input_file_id": input_file_id, "completion_window": COMPLETION_WINDOW, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": created, "in_progress_at": None,
                 "expires_at": created + WINDOW_S, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "usage": None, "metadata": metadata}
        stage_input(store, batch["id"], input_file_id)
        store.add_batch(batch)
        worker.wake()
        return batch

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str):
        return store.batch(batch_id)

    @app.get("/v1/batches")
    def list_batches(limit: int = 20, after: str | None = None):
        if not 1 <= limit <= 100:
            raise APIError(400, "limit: must be between 1 and 100", param="limit", code="invalid_value")
        items, has_more = store.list_batches(limit, after)
        return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None, "has_more": has_more}

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str):
        batch = store.update_batch(batch_id, only_from=("validating", "in_progress", "finalizing"), status="cancelling")
        if batch is None:
            batch = store.batch(batch_id)
            if batch["status"] not in ("cancelling", "cancelled"):
                raise APIError(409, f"Cannot cancel a batch with status {batch['status']!r}.", param="batch_id",
                               code="batch_not_cancellable")
        worker.wake()
        return batch

    return app


class EncodableJSON(JSONResponse):
    """A JSON answer that can always be sent: UTF-8 where its text allows, else ASCII escapes (a
    lone UTF-16 surrogate a client sent and a message echoes has no UTF-8)."""

    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def _error(exc: APIError) -> JSONResponse:
    return EncodableJSON(exc.body(), status_code=exc.status)


def _at_most(receive, most: int, limits: Limits):
    """`receive` that refuses (413) a request body past `most` bytes as it arrives."""
    seen = 0

    async def counted():
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > most:
            raise _too_large(limits)
        return message

    return counted


def _too_large(limits: Limits) -> APIError:
    return APIError(413, f"file: larger than this server's limit of {limits.max_file_bytes:,} bytes",
                    param="file", code="file_too_large")


async def _json_object(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    field = lone_surrogate_field(body)  # JSON can escape one; no store, file or answer can hold it
    if field is not None:
        raise APIError(400, f"{field}: {SURROGATE}", param=re.split(r"[.\[ ]", field)[0], code="invalid_value")
    return body


def _required_text(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{name}: missing or not a string", param=name, code="missing_required_parameter")
    return value


def _metadata(metadata, sets: list[str]) -> dict | None:
    """As the API: up to 16 pairs, keys up to 64 characters, values strings up to 512; the keys
    batchscore reads (`labels`, `calibrate`) checked now, not when the batch runs."""
    if metadata is None:
        return None
    if (not isinstance(metadata, dict) or len(metadata) > 16
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in metadata.items())):
        raise APIError(400, "metadata: up to 16 pairs of string keys (at most 64 characters) and string values "
                            "(at most 512)", param="metadata", code="invalid_value")
    try:
        metadata_labels(metadata)
        metadata_calibration(metadata, sets)
    except ValueError as exc:
        raise APIError(400, str(exc), param="metadata", code="invalid_value") from None
    return metadata
