"""POST /v1/evaluate: retrieval quality of the served model and index.

leave-one-out: every labelled item queries all other labelled items with the vectors
stored in the index, ranked exactly by `index.metrics.retrieval_metrics`: the same
computation, on the same vectors, as `vitrieval-index bench` on the images the index
was built from. queries: uploaded labelled images (or vectors) are embedded and
ranked against the labelled items.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from index.metrics import retrieval_metrics
from index.store import StoreError

from ..deps import ReadAccess, ServiceDep
from ..errors import ApiError, error_responses
from ..inputs import openapi_body, read_body
from ..schemas import EvaluateRequest
from ..state import Timings

router = APIRouter(prefix="/v1", tags=["evaluate"], dependencies=[ReadAccess])


@router.post(
    "/evaluate",
    summary="Recall@K, mAP, MAP@R and R-Precision over the labelled items",
    openapi_extra=openapi_body(EvaluateRequest, None),
    response_model=dict[str, Any],
    responses=error_responses(400, 401, 413, 415, 422),
)
async def evaluate(request: Request, state: ServiceDep) -> dict[str, Any]:
    body, _ = await read_body(request, EvaluateRequest, image_field=None)
    try:
        _, labels, vectors = await asyncio.to_thread(
            state.store.labelled_items, state.settings.max_evaluate_items
        )
    except StoreError as exc:
        raise ApiError(
            413, "too_many_items", f"{exc}; evaluate offline with vitrieval-index bench"
        ) from None
    if len(labels) < 2:
        raise ApiError(422, "not_enough_items", "the index holds fewer than 2 labelled items")
    if body.mode == "leave-one-out":
        job = lambda: retrieval_metrics(vectors, labels, body.ks)  # noqa: E731
    else:
        queries = np.stack(
            [
                state.check_vector(q.vector)
                if q.vector is not None
                else await _embed_base64(state, q.image_base64)
                for q in body.queries
            ]
        )
        query_labels = [q.label for q in body.queries]
        job = lambda: retrieval_metrics(  # noqa: E731
            queries, query_labels, body.ks, gallery_embeddings=vectors, gallery_labels=labels
        )
    metrics = await asyncio.to_thread(job)
    return {"mode": body.mode, "n_items": len(labels), **_finite(metrics)}


async def _embed_base64(state, encoded: str) -> np.ndarray:
    from ..inputs import decode_base64

    return await state.embed_bytes(decode_base64(encoded, "image_base64"), Timings())


def _finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """NaN (no query had a relevant item) is not JSON: report null instead."""
    return {
        k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in metrics.items()
    }
