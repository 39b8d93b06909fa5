"""Near-duplicates over HTTP (docs/duplicates.md):

- GET /v1/items/{key}/duplicates: the items scoring at least a threshold against one
  item, best first (a search, answered at once);
- POST /v1/duplicates and GET /v1/duplicates/{job}: every group of near-duplicates of
  the index, listed by a background job (service/duplicates.py) and read when done.

The threshold is the request's, else the index's calibrated one (`vitrieval-index
calibrate`; of the request's `precision` level when given).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam

from vitrieval.index.query import Where, search

from ..answers import DuplicateJobOut, ItemDuplicates
from ..deps import ReadAccess, ServiceDep
from ..duplicates import chosen_threshold
from ..errors import ApiError, error_responses
from ..inputs import RequestBody
from ..ranking import check_depth, hits_out
from ..schemas import DuplicatesRequest
from .items import KeyPath

router = APIRouter(prefix="/v1", tags=["duplicates"], dependencies=[ReadAccess])
DUPLICATES_BODY = RequestBody(DuplicatesRequest, image_field=None)
"""JSON, or a form (its filter as JSON text): no image."""
DEFAULT_LIMIT = 100
"""An item's duplicates listed when no `limit` is given (fewer if max_k is lower)."""


@DUPLICATES_BODY.post(router, "/duplicates", error_responses(400, 401, 409, 413, 415, 422), 202)
async def start_duplicates(request: Request, state: ServiceDep) -> DuplicateJobOut:
    """Start a job listing every group of near-duplicates (one job at a time)."""
    body, _ = await DUPLICATES_BODY.read(request)
    threshold = await chosen_threshold(state.index, body.threshold, body.precision)
    allowed = Where(label=body.label, filter=body.filter).allowed
    job = state.duplicate_jobs.start(state.index, threshold, allowed, body.keep)
    return DuplicateJobOut(**asdict(job))


@router.get(
    "/duplicates/{job}",
    operation_id="get_duplicates",
    summary="A duplicates job: its progress, and its groups once done",
    responses=error_responses(401, 404),
)
async def get_duplicates(
    job: Annotated[str, PathParam(max_length=64, description="the job's id")], state: ServiceDep
) -> DuplicateJobOut:
    found = state.duplicate_jobs.get(job)
    if found is None:
        raise ApiError(404, "unknown_job", f"no duplicates job {job!r} (a restart forgets jobs)")
    return DuplicateJobOut(**asdict(found))


@router.get(
    "/items/{key:path}/duplicates",
    operation_id="get_item_duplicates",
    summary="The items scoring at least a threshold against one item",
    responses=error_responses(401, 404, 422),
)
async def item_duplicates(
    key: KeyPath,
    state: ServiceDep,
    threshold: Annotated[
        float | None,
        Query(ge=-1, le=1, allow_inf_nan=False, description="left out: the calibrated one"),
    ] = None,
    precision: Annotated[
        float | None, Query(gt=0, lt=1, description="the calibrated level to use")
    ] = None,
    limit: Annotated[
        int | None, Query(ge=1, description=f"at most this many (default {DEFAULT_LIMIT} or max_k)")
    ] = None,
) -> ItemDuplicates:
    if threshold is not None and precision is not None:
        raise ApiError(422, "invalid_request", "give threshold or precision, not both")
    if limit is None:
        limit = min(DEFAULT_LIMIT, state.settings.max_k)
    check_depth(state, limit, "limit")
    (vector,) = await state.index.vectors([key])
    if vector is None:
        raise ApiError(404, "unknown_key", f"no item with key {key!r}")
    chosen = await chosen_threshold(state.index, threshold, precision)
    where = Where(exclude_keys=[key])
    found = await search(state.index, vector[None, :], limit, where=where, score_threshold=chosen)
    return ItemDuplicates(key=key, threshold=chosen, duplicates=hits_out(found[0]))
