"""POST /v1/search and POST /v1/embed: the query path (decode, embed, search).

A search takes one query: an image, several images fused into one (`fusion`, see
index/fusion.py), an indexed item's key, or a vector; narrowed by a label and a
metadata filter, optionally re-ranked (alpha-QE); on a compressed index its
candidates re-scored by their exact vectors (`rescore`, `oversample`); one page of
the ranking (`offset`) above a score (`score_threshold`). What follows the embedding
runs in
`vitrieval.index.query`, as `vitrieval-index search` runs it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from vitrieval.index.query import AQE, Where, search_fused
from vitrieval.index.store import Hit

from ..answers import EmbedResponse, GroupOut, HitOut, SearchResponse
from ..deps import ReadAccess, ServiceDep
from ..errors import ApiError, error_responses
from ..inputs import ImageUpload, RequestBody
from ..ranking import check_depth, ranked_answer
from ..schemas import MAX_QUERY_IMAGES, EmbedRequest, SearchRequest
from ..state import ServiceState, Timings

router = APIRouter(prefix="/v1", tags=["search"], dependencies=[ReadAccess])

SEARCH_BODY = RequestBody(SearchRequest, max_images=MAX_QUERY_IMAGES)
EMBED_BODY = RequestBody(EmbedRequest, form_needs_image=True)


@SEARCH_BODY.post(router, "/search", error_responses(400, 401, 404, 413, 415, 422))
async def search(request: Request, state: ServiceDep) -> SearchResponse:
    """Find the indexed items most similar to an image (or images), a key or a vector."""
    query, images = await SEARCH_BODY.read(request)
    check_depth(state, query.k)
    given = [bool(images), query.key is not None, query.vector is not None]
    if sum(given) != 1:
        raise ApiError(
            422, "invalid_request", "give exactly one of: an image (or images), a key, or a vector"
        )
    timings = Timings()
    exclude: list[str] = []
    if images:
        kind = "image"
        vectors = await _embed_images(state, images, timings)
    elif query.key is not None:
        kind = "key"
        record = await state.index.get(query.key)
        if record is None:
            raise ApiError(404, "unknown_key", f"no item with key {query.key!r}")
        vectors = record.vector[None, :]
        exclude = [query.key] if query.exclude_self else []
    else:
        kind = "vector"
        vectors = state.check_vector(query.vector)[None, :]
    method = query.rerank.method if query.rerank else None
    where = Where(
        label=query.label, exclude_keys=exclude, filter=query.filter, augmented=method == "dba"
    )
    rerank = AQE(query.rerank.n, query.rerank.alpha) if method == "aqe" else None
    hits, groups = await _search(state, vectors, query, where, rerank, timings)
    return SearchResponse(
        hits=hits, groups=groups, k=query.k, query=kind, timings_ms=timings.as_dict()
    )


async def _embed_images(
    state: ServiceState, images: list[ImageUpload], timings: Timings
) -> np.ndarray:
    """float32 (m, D): the images embedded side by side (they share model calls when
    batching is on); the request's decode and embed times are the longest of each."""
    each = [Timings() for _ in images]
    vectors = await asyncio.gather(
        *(state.embed_upload(image, t) for image, t in zip(images, each, strict=True))
    )
    timings.decode = max(t.decode for t in each)
    timings.embed = max(t.embed for t in each)
    return np.stack(vectors)


async def _search(
    state: ServiceState,
    vectors: np.ndarray,
    query: SearchRequest,
    where: Where,
    rerank: AQE | None,
    timings: Timings,
) -> tuple[list[HitOut], list[GroupOut] | None]:
    """The hits of `vectors` (one query's embeddings) with the request's k, fusion,
    re-scoring and page, narrowed by `where` and re-ranked by `rerank`; with
    `group_by`, no hits but its groups (service/ranking.py)."""

    async def ranked(k: int, shaping: dict[str, Any]) -> list[tuple[int, Hit]]:
        options = {"fusion": query.fusion, "where": where, "rerank": rerank, **shaping}
        return await search_fused(state.index, vectors, k, **options)

    return await ranked_answer(state, query, ranked, timings)


@EMBED_BODY.post(router, "/embed", error_responses(400, 401, 413, 415, 422))
async def embed(request: Request, state: ServiceDep) -> EmbedResponse:
    """Embed one image with the served model."""
    _, image = await EMBED_BODY.read_one(request)
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
