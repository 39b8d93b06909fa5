"""POST /v1/search and POST /v1/embed: the query path (decode, embed, search)."""

from __future__ import annotations

import time

import numpy as np
from fastapi import APIRouter, Request

from index.store import StoreError

from ..deps import ReadAccess, ServiceDep
from ..errors import ApiError, error_responses
from ..inputs import IMAGE_PART, openapi_body, read_body
from ..schemas import EmbedRequest, EmbedResponse, HitOut, SearchRequest, SearchResponse
from ..state import ServiceState, Timings

router = APIRouter(prefix="/v1", tags=["search"], dependencies=[ReadAccess])

_SEARCH_FORM = {
    "image": IMAGE_PART,
    "k": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 10},
    "label": {"type": "string"},
    "key": {"type": "string"},
}


@router.post(
    "/search",
    response_model=SearchResponse,
    summary="Find the indexed items most similar to an image, a key or a vector",
    openapi_extra=openapi_body(SearchRequest, _SEARCH_FORM),
    responses=error_responses(400, 401, 404, 413, 415, 422),
)
async def search(request: Request, state: ServiceDep) -> SearchResponse:
    query, image = await read_body(request, SearchRequest)
    if query.k > state.settings.max_k:
        raise ApiError(422, "invalid_request", f"k must be <= {state.settings.max_k}")
    given = [image is not None, query.key is not None, query.vector is not None]
    if sum(given) != 1:
        raise ApiError(422, "invalid_request", "give exactly one of: an image, a key, or a vector")
    timings = Timings()
    exclude: list[str] = []
    if image is not None:
        kind = "image"
        vector = await state.embed_upload(image, timings)
    elif query.key is not None:
        kind = "key"
        record = await state.index.get(query.key)
        if record is None:
            raise ApiError(404, "unknown_key", f"no item with key {query.key!r}")
        vector = record.vector
        exclude = [query.key] if query.exclude_self else []
    else:
        kind = "vector"
        vector = state.check_vector(query.vector)
    hits = await _search(state, vector, query.k, query.label, exclude, timings)
    return SearchResponse(hits=hits, k=query.k, query=kind, timings_ms=timings.as_dict())


async def _search(
    state: ServiceState,
    vector: np.ndarray,
    k: int,
    label: str | None,
    exclude: list[str],
    timings: Timings,
) -> list[HitOut]:
    started = time.perf_counter()
    try:
        rows = await state.index.search(vector[None, :], k, label=label, exclude_keys=exclude)
    except StoreError as exc:
        raise ApiError(422, "invalid_request", str(exc)) from None
    timings.search = (time.perf_counter() - started) * 1000
    state.metrics.observe_stage("search", timings.search / 1000)
    return [
        HitOut(key=h.key, score=float(h.score), label=h.label, metadata=h.metadata) for h in rows[0]
    ]


@router.post(
    "/embed",
    response_model=EmbedResponse,
    summary="Embed one image with the served model",
    openapi_extra=openapi_body(EmbedRequest, {"image": IMAGE_PART}),
    responses=error_responses(400, 401, 413, 415, 422),
)
async def embed(request: Request, state: ServiceDep) -> EmbedResponse:
    _, image = await read_body(request, EmbedRequest)
    if image is None:
        raise ApiError(
            422,
            "invalid_request",
            "send the image as the multipart field 'image' or as 'image_base64' in JSON",
        )
    timings = Timings()
    vector = await state.embed_upload(image, timings)
    return EmbedResponse(
        embedding=vector.astype(float).tolist(),
        dim=int(vector.shape[0]),
        fingerprint=state.embedder.fingerprint,
        timings_ms=timings.as_dict(),
    )
