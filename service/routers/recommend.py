"""POST /v1/recommend: items like some examples and unlike others.

The examples (keys, vectors, images; index/recommend.py defines the strategies) become
unit vectors here: a key reads its item's stored vector and leaves the item out of
the hits, an image is embedded as a search's is. What follows is a ranking answered
as a search's (service/ranking.py): filters, re-scoring, pages, thresholds, groups.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from vitrieval.index.query import Where
from vitrieval.index.recommend import ranking
from vitrieval.index.store import Hit

from ..answers import SearchResponse
from ..deps import ReadAccess, ServiceDep
from ..errors import ApiError, error_responses
from ..inputs import RequestBody, decode_base64
from ..ranking import check_depth, ranked_answer
from ..schemas import Example, RecommendRequest
from ..state import ServiceState, Timings

router = APIRouter(prefix="/v1", tags=["search"], dependencies=[ReadAccess])
RECOMMEND_BODY = RequestBody(RecommendRequest, image_field=None)
"""JSON, or a form with the examples as JSON text."""


@RECOMMEND_BODY.post(router, "/recommend", error_responses(400, 401, 404, 413, 415, 422))
async def recommend(request: Request, state: ServiceDep) -> SearchResponse:
    """Find the items most like the positive examples and unlike the negative ones."""
    body, _ = await RECOMMEND_BODY.read(request)
    check_depth(state, body.k)
    timings = Timings()
    positive = await _vectors(state, body.positive, timings)
    negative = await _vectors(state, body.negative, timings)
    keys = [e.key for e in (*body.positive, *body.negative) if e.key is not None]
    where = Where(label=body.label, filter=body.filter, exclude_keys=keys)

    async def ranked(k: int, shaping: dict[str, Any]) -> list[tuple[int, Hit]]:
        return await ranking(state.index, positive, negative, body.strategy, where, shaping)(k)

    hits, groups = await ranked_answer(state, body, ranked, timings)
    return SearchResponse(
        hits=hits, groups=groups, k=body.k, query="recommend", timings_ms=timings.as_dict()
    )


async def _vectors(state: ServiceState, examples: list[Example], timings: Timings) -> np.ndarray:
    """float32 (n, D) unit vectors of the examples: stored, given or embedded."""
    keys = [e.key for e in examples if e.key is not None]
    stored = dict(zip(keys, await state.index.vectors(keys) if keys else [], strict=True))
    missing = [key for key, vector in stored.items() if vector is None]
    if missing:
        raise ApiError(404, "unknown_key", f"no item with key {missing[0]!r}")

    async def one(example: Example) -> np.ndarray:
        if example.key is not None:
            return np.asarray(stored[example.key], dtype=np.float32)
        if example.vector is not None:
            return state.check_vector(example.vector)
        data = decode_base64(example.image_base64 or "", "image_base64")
        return await state.embed_bytes(data, timings)

    rows = await asyncio.gather(*(one(e) for e in examples))
    return np.stack(rows) if rows else np.empty((0, state.index.dim), dtype=np.float32)
