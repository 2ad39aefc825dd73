"""OpenAI's Files routes for batches: upload a JSONL of requests (`purpose=batch`), list, read,
download and delete files; a batch's output and error files are listed here too. The bytes go
to the file store in pieces as they arrive, never held whole."""

from __future__ import annotations

import logging
import time
from itertools import chain

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from wicore.errors import FileStoreUnavailable
from wicore.gateway.auth import require_key
from wicore.gateway.batch_shapes import FileDeleted, FileList, FileObject
from wicore.gateway.batch_state import new_id
from wicore.gateway.errors import ApiError
from wicore.gateway.file_store import FileStore
from wicore.gateway.limits import form_body
from wicore.gateway.service_batches import BatchService

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], tags=["files"])

FILE_ID = Path(pattern=r"^file-[A-Za-z0-9]{1,64}$", description="The id POST /v1/files returned.")
UPLOAD_PIECE = 1 << 20  # bytes read from an upload at a time


def service(request: Request) -> BatchService:
    return request.app.state.batches


@router.post("/files", response_model=FileObject)
async def upload_file(request: Request) -> FileObject:
    """Upload a batch input file: multipart with `file` (JSONL) and `purpose` (`batch`)."""
    batches = service(request)
    form = await form_body(request, request.app.state.gateway.config.max_request_bytes)
    if form.get("purpose") != "batch":
        raise ApiError(400, "purpose: only 'batch' files are taken here", param="purpose")
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise ApiError(400, "file: attach the JSONL as a file part", param="file")
    file_id = new_id("file")
    size = await store_upload(batches, file_id, upload)
    record = FileObject(
        id=file_id, bytes=size, created_at=int(time.time()), filename=upload.filename or "upload.jsonl", purpose="batch"
    )
    await run_in_threadpool(batches.files.save, record)
    return record


async def store_upload(batches: BatchService, file_id: str, upload: UploadFile) -> int:
    """The upload into the store piece by piece; refused past the store's size limit. An upload
    that fails part-way (over the limit, the store down) leaves none of its pieces behind."""
    try:
        return await copy_upload(batches.store, file_id, upload)
    except (ApiError, FileStoreUnavailable):
        await run_in_threadpool(discard, batches.store, file_id)
        raise


async def copy_upload(store: FileStore, file_id: str, upload: UploadFile) -> int:
    size, limit = 0, store.max_bytes
    while piece := await upload.read(UPLOAD_PIECE):
        size += len(piece)
        if size > limit:
            raise ApiError(
                413, f"file: over the {limit}-byte limit of the file store; raise max_file_bytes", param="file"
            )
        await run_in_threadpool(store.append, file_id, piece)
    if not size:
        raise ApiError(400, "file: the uploaded file is empty", param="file")
    return size


def discard(store: FileStore, file_id: str) -> None:
    try:
        store.delete(file_id)
    except FileStoreUnavailable as exc:
        log.warning("the pieces of the failed upload %s stay in the file store: %s", file_id, exc)


@router.get("/files", response_model=FileList)
def list_files(
    request: Request,
    purpose: str | None = Query(None),
    limit: int = Query(100, ge=1, le=10_000),
    after: str | None = Query(None, description="The last id of the previous page."),
) -> FileList:
    found = service(request).files.newest(limit + 1, after, purpose)
    data = found[:limit]
    return FileList(data=data, first_id=ends(data, 0), last_id=ends(data, -1), has_more=len(found) > limit)


def ends(data: list, at: int) -> str | None:
    return data[at].id if data else None


@router.get("/files/{file_id}", response_model=FileObject)
def get_file(request: Request, file_id: str = FILE_ID) -> FileObject:
    return known_file(service(request), file_id)


def known_file(batches: BatchService, file_id: str) -> FileObject:
    record = batches.files.get(file_id)
    if record is None:
        raise ApiError(404, f"no file {file_id}", param="file_id")
    return record


@router.get("/files/{file_id}/content", response_class=StreamingResponse)
def file_content(request: Request, file_id: str = FILE_ID) -> StreamingResponse:
    """The file's bytes, streamed from the store (503 when the store cannot be read)."""
    batches = service(request)
    known_file(batches, file_id)
    pieces = batches.store.chunks(file_id)
    first = next(pieces, b"")  # read before the response starts: a store that is down is a 503
    return StreamingResponse(chain([first], pieces), media_type="application/jsonl")


@router.delete("/files/{file_id}", response_model=FileDeleted)
def delete_file(request: Request, file_id: str = FILE_ID) -> FileDeleted:
    batches = service(request)
    known_file(batches, file_id)
    batches.store.delete(file_id)  # first: a store that is down (503) leaves the file listed, to delete again
    batches.files.delete(file_id)
    return FileDeleted(id=file_id, deleted=True)
