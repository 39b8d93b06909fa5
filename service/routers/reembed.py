"""/v1/collections/{collection}/reembed: a new collection of a collection's items,
embedded again by another model, as a background job (service/reembed_jobs.py;
docs/collections.md, "Switching a model").

- POST starts it (the admin key: it creates a collection) and answers 202 with the job;
- GET .../{job} reads its progress; DELETE .../{job} cancels it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi import Path as PathParam

from ..answers import ReembedJobOut
from ..deps import AdminAccess, CatalogueDep, collection_of
from ..errors import ApiError, error_responses
from ..inputs import RequestBody
from ..reembed_jobs import ReembedJob
from ..schemas import ReembedRequest
from .collections import COLLECTION_PREFIX, CollectionPath

router = APIRouter(
    prefix=f"{COLLECTION_PREFIX}/reembed", tags=["collections"], dependencies=[AdminAccess]
)
REEMBED_BODY = RequestBody(ReembedRequest, image_field=None)
JobPath = Annotated[str, PathParam(max_length=64, description="the job's id")]


def _answer(job: ReembedJob) -> ReembedJobOut:
    return ReembedJobOut.model_validate(job, from_attributes=True)


@REEMBED_BODY.post(router, "", error_responses(400, 401, 403, 404, 409, 413, 415, 422), 202)
async def start_reembed(
    collection: CollectionPath, request: Request, catalogue: CatalogueDep
) -> ReembedJobOut:
    """Start building a collection of these items embedded by another model."""
    body, _ = await REEMBED_BODY.read(request)
    jobs, source = catalogue.reembed_jobs, collection_of(request)
    return _answer(jobs.start(catalogue.folder, source, body.collection, body.model))


def _job(catalogue: CatalogueDep, source: str, job: str) -> ReembedJob:
    found = catalogue.reembed_jobs.get(job)
    if found is None or found.source != source:
        raise ApiError(404, "unknown_job", f"no re-embedding job {job!r} of {source!r}")
    return found


@router.get(
    "/{job}",
    operation_id="get_reembed",
    summary="A re-embedding job: its progress and outcome",
    responses=error_responses(400, 401, 403, 404),
)
async def get_reembed(
    collection: CollectionPath, job: JobPath, request: Request, catalogue: CatalogueDep
) -> ReembedJobOut:
    return _answer(_job(catalogue, collection_of(request), job))


@router.delete(
    "/{job}",
    operation_id="cancel_reembed",
    summary="Cancel a re-embedding job (what is embedded is kept for the next one)",
    responses=error_responses(400, 401, 403, 404),
)
async def cancel_reembed(
    collection: CollectionPath, job: JobPath, request: Request, catalogue: CatalogueDep
) -> ReembedJobOut:
    found = _job(catalogue, collection_of(request), job)
    found.cancel.set()
    return _answer(found)
