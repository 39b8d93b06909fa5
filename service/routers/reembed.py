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
from ..deps import AddressedDep, AdminAccess
from ..errors import ApiError, error_responses
from ..inputs import RequestBody
from ..operations import operation
from ..reembed_jobs import ReembedJob
from ..schemas import ReembedRequest
from .collections import COLLECTION_PREFIX

router = APIRouter(
    prefix=f"{COLLECTION_PREFIX}/reembed", tags=["collections"], dependencies=[AdminAccess]
)
REEMBED_BODY = RequestBody(ReembedRequest, image_field=None)
JobPath = Annotated[str, PathParam(max_length=64, description="the job's id")]
ERRORS = error_responses(400, 401, 403, 404)


def _answer(job: ReembedJob) -> ReembedJobOut:
    return ReembedJobOut.model_validate(job, from_attributes=True)


def _job(target: AddressedDep, job: str) -> ReembedJob:
    found = target.jobs.get(job)
    if found is None or found.source != target.collection:
        raise ApiError(404, "unknown_job", f"no re-embedding job {job!r} of {target.collection!r}")
    return found


@REEMBED_BODY.post(router, "", ERRORS | error_responses(409, 413, 415, 422), 202)
async def start_reembed(target: AddressedDep, request: Request) -> ReembedJobOut:
    """Start building a collection of these items embedded by another model."""
    body, _ = await REEMBED_BODY.read(request)
    started = target.jobs.start(target.folder, target.collection, body.collection, body.model)
    return _answer(started)


@operation(router, "GET", "/{job}", ERRORS)
async def get_reembed(target: AddressedDep, job: JobPath) -> ReembedJobOut:
    """A re-embedding job: its progress and outcome."""
    return _answer(_job(target, job))


@operation(router, "DELETE", "/{job}", ERRORS)
async def cancel_reembed(target: AddressedDep, job: JobPath) -> ReembedJobOut:
    """Cancel a re-embedding job (what is embedded is kept for the next one)."""
    found = _job(target, job)
    found.cancel.set()
    return _answer(found)
