"""POST /v1/evaluate: retrieval quality of the served model and index.

leave-one-out: every labelled item queries all other labelled items with the vectors
stored in the index, ranked exactly by `vitrieval.index.evaluation.metrics.retrieval_metrics`: the
same
computation, on the same vectors, as `vitrieval-index bench` on the images the index
was built from. queries: uploaded labelled images (or vectors) are embedded and
ranked against the labelled items. With a metadata `filter`, only the labelled items
it allows take part (as queries and as the ranked gallery).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from vitrieval.index.evaluation.metrics import retrieval_metrics
from vitrieval.index.store import StoreError
from vitrieval.index.store.filters import FilterError

from ..answers import EvaluateResponse
from ..deps import ReadAccess, ServiceDep
from ..errors import ApiError, error_responses, store_error
from ..inputs import RequestBody, decode_base64
from ..schemas import EvaluateRequest, LabelledQuery
from ..state import ServiceState, Timings

router = APIRouter(prefix="/v1", tags=["evaluate"], dependencies=[ReadAccess])
_EMBED_WINDOW = 64
EVALUATE_BODY = RequestBody(EvaluateRequest, image_field=None)


@router.post(
    "/evaluate",
    operation_id="evaluate",
    summary="Recall@K, mAP, MAP@R and R-Precision over the labelled items",
    openapi_extra=EVALUATE_BODY.openapi(),
    responses=error_responses(400, 401, 413, 415, 422, 429),
)
async def evaluate(request: Request, state: ServiceDep) -> EvaluateResponse:
    body, _ = await EVALUATE_BODY.read(request)
    return await evaluate_state(state, body)


async def evaluate_state(state: ServiceState, body: EvaluateRequest) -> EvaluateResponse:
    """`body`'s evaluation of the served index, one at a time per index (a 429 while
    another runs: exact ranking is O(n^2) CPU)."""
    if state.evaluating.locked():
        raise ApiError(
            429,
            "busy",
            "an evaluation is running; retry when it ends",
            headers={"Retry-After": "5"},
        )
    async with state.evaluating:
        return await _evaluate(state, body)


async def _evaluate(state: ServiceState, body: EvaluateRequest) -> EvaluateResponse:
    try:
        _, labels, vectors = await state.index.labelled_items(
            state.settings.max_evaluate_items, body.filter
        )
    except FilterError as exc:  # the request model checked it: a field the index lacks
        raise store_error(exc, 422, "invalid_request") from None
    except StoreError as exc:  # more labelled items than max_evaluate_items
        error = store_error(exc, 413, "too_many_items")
        if error.status == 413:
            error.detail = f"{error.detail}; evaluate offline with vitrieval-index bench"
        raise error from None
    if len(labels) < 2:
        which = " matching the filter" if body.filter is not None else ""
        raise ApiError(
            422, "not_enough_items", f"the index holds fewer than 2 labelled items{which}"
        )
    if body.mode == "leave-one-out":
        metrics = await asyncio.to_thread(retrieval_metrics, vectors, labels, body.ks)
    else:
        queries = await _query_vectors(state, body.queries)
        metrics = await asyncio.to_thread(
            retrieval_metrics,
            queries,
            [q.label for q in body.queries],
            body.ks,
            gallery_embeddings=vectors,
            gallery_labels=labels,
        )
    return EvaluateResponse.model_validate(
        {"mode": body.mode, "n_items": len(labels), **_finite(metrics)}
    )


async def _query_vectors(state: ServiceState, queries: list[LabelledQuery]) -> np.ndarray:
    """float32 (Q, D): vectors as given (normalised), images embedded through the batcher
    a window at a time, so they share model calls without flooding the queue."""

    async def one(query: LabelledQuery) -> np.ndarray:
        if query.vector is not None:
            return state.check_vector(query.vector)
        data = decode_base64(query.image_base64, "image_base64")
        return await state.embed_bytes(data, Timings())

    rows: list[np.ndarray] = []
    for start in range(0, len(queries), _EMBED_WINDOW):
        window = queries[start : start + _EMBED_WINDOW]
        rows.extend(await asyncio.gather(*(one(q) for q in window)))
    return np.stack(rows)


def _finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """NaN (no query had a relevant item) is not JSON: report null instead."""
    return {
        k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in metrics.items()
    }
