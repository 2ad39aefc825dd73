"""OpenAI's Batches routes: create a batch from an uploaded file, read it, list them, cancel
one. The batch runs through the queue (`batch_runner`): its lines become bulk-lane jobs, its
state lives in Redis, and any gateway may drive it."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Path, Query, Request

from wicore.gateway.auth import require_key
from wicore.gateway.batch_shapes import CHAT_ENDPOINT, WINDOW, Batch, BatchList, BatchStatus, CreateBatch, RequestCounts
from wicore.gateway.batch_state import new_id
from wicore.gateway.errors import ApiError
from wicore.gateway.files import service
from wicore.gateway.service_batches import BatchService

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], tags=["batches"])

BATCH_ID = Path(pattern=r"^batch-[A-Za-z0-9]{1,64}$", description="The id POST /v1/batches returned.")
CANCELABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


@router.post("/batches", response_model=Batch)
def create_batch(request: Request, body: CreateBatch) -> Batch:
    """Run every line of an uploaded `purpose=batch` file through the queue."""
    batches = service(request)
    check_create(batches, body)
    now = int(time.time())
    batch = Batch(
        id=new_id("batch"),
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        status=BatchStatus.VALIDATING,
        created_at=now,
        expires_at=now + max(1, round(batches.window_s)),
        request_counts=RequestCounts(),
        metadata=body.metadata,
    )
    batches.batches.create(batch, batches.store.name)
    return batch


def check_create(batches: BatchService, body: CreateBatch) -> None:
    if body.endpoint != CHAT_ENDPOINT:
        raise ApiError(400, f"endpoint: only {CHAT_ENDPOINT} is served, not {body.endpoint}", param="endpoint")
    if body.completion_window != WINDOW:
        raise ApiError(400, f"completion_window: only {WINDOW!r} is supported", param="completion_window")
    found = batches.files.get(body.input_file_id)
    if found is None:
        raise ApiError(404, f"input_file_id: no file {body.input_file_id}", param="input_file_id")
    if found.purpose != "batch":
        raise ApiError(400, f"input_file_id: {found.id} has purpose {found.purpose}, not batch", param="input_file_id")


@router.get("/batches/{batch_id}", response_model=Batch)
def get_batch(request: Request, batch_id: str = BATCH_ID) -> Batch:
    return known_batch(service(request), batch_id)


def known_batch(batches: BatchService, batch_id: str) -> Batch:
    record = batches.batches.get(batch_id)
    if record is None:
        raise ApiError(404, f"no batch {batch_id}", param="batch_id")
    return record.batch


@router.post("/batches/{batch_id}/cancel", response_model=Batch)
def cancel_batch(request: Request, batch_id: str = BATCH_ID) -> Batch:
    """Queued lines are cancelled, running ones finish; the batch reads cancelling, then cancelled."""
    batches = service(request)
    batch = known_batch(batches, batch_id)
    if batch.status in CANCELABLE:
        batches.batches.request_cancel(batch_id)
    elif batch.status != BatchStatus.CANCELLING:
        raise ApiError(409, f"batch {batch_id} is {batch.status.value}; only a running batch can be cancelled")
    return known_batch(batches, batch_id)


@router.get("/batches", response_model=BatchList)
def list_batches(
    request: Request,
    limit: int = Query(20, ge=1, le=10_000),
    after: str | None = Query(None, description="The last id of the previous page."),
) -> BatchList:
    found = service(request).batches.newest(limit + 1, after)
    data = found[:limit]
    first, last = (data[0].id, data[-1].id) if data else (None, None)
    return BatchList(data=data, first_id=first, last_id=last, has_more=len(found) > limit)
