"""Liveness, readiness, service information and Prometheus metrics."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from vitrieval.index.store import damage_code

from .. import __version__
from ..answers import InfoResponse, Status
from ..catalogue import Catalogue
from ..deps import ReadAccess, ServiceDep, served_catalogue
from ..errors import error_responses
from ..metrics import CONTENT_TYPE
from ..upkeep import CHECKPOINT_STALLED

router = APIRouter(tags=["health"])


@router.get(
    "/healthz", operation_id="healthz", response_model=Status, summary="The process is alive"
)
async def healthz() -> Status:
    return Status(status="ok")


@router.get(
    "/readyz",
    operation_id="readyz",
    response_model=Status,
    summary="The model and index are loaded and the self-check passed",
    responses={503: {"model": Status}},
)
async def readyz(request: Request) -> Any:
    """200 "ready"; 200 "degraded" (still serving, an operator should look: `reasons`
    says why); 503 "loading" or "failing". Status and reason codes only: the details,
    which name files, are in the log. A data folder server is ready once started, also
    with no collections; a damaged collection makes it "degraded" (the others serve)."""
    catalogue = served_catalogue(request)
    if catalogue is not None:
        return _catalogue_ready(catalogue)
    state = getattr(request.app.state, "service", None)
    if state is None or not state.ready:
        return JSONResponse({"status": "loading", "checks": {}}, status_code=503)
    damaged = await state.index.damaged_segments()
    checks: dict[str, Any] = {
        "model": True,
        "index": not damaged,
        "self_check": state.self_check,
        "batcher": state.batcher.alive,
    }
    reasons = []
    if damaged:
        # searches still answer, without the damaged segments' items: not ready
        checks["damaged_segments"] = [
            {"segment": number, "reason": damage_code(reason)} for number, reason in damaged
        ]
        reasons.append("damaged_segments")
    if not state.batcher.alive:
        reasons.append("batcher_stopped")
    if reasons:
        checks["reasons"] = reasons
        return JSONResponse({"status": "failing", "checks": checks}, status_code=503)
    checkpoints = getattr(state, "checkpoints", None)  # a Ray ingress has none
    if checkpoints is not None and checkpoints.stalled:
        # a single writer stays in its load balancer: the journal keeps every write
        checks["checkpoint"] = {
            "reason": checkpoints.failure,
            "journal_pending": state.current_store().journal_pending,
            "last_success": checkpoints.last_success,
        }
        checks["reasons"] = [CHECKPOINT_STALLED]
        return Status(status="degraded", checks=checks)
    return Status(status="ready", checks=checks)


def _catalogue_ready(catalogue: Catalogue) -> Any:
    if not catalogue.ready:
        return JSONResponse({"status": "loading", "checks": {}}, status_code=503)
    damaged = sorted(catalogue.damaged())
    checks: dict[str, Any] = {"collections_open": len(catalogue.items())}
    if damaged:
        checks |= {"damaged_collections": damaged, "reasons": ["damaged_collections"]}
        return Status(status="degraded", checks=checks)
    return Status(status="ready", checks=checks)


@router.get(
    "/v1/info",
    operation_id="get_info",
    summary="The served model, the index and the service settings",
    dependencies=[ReadAccess],
    responses=error_responses(401),
)
async def info(state: ServiceDep) -> InfoResponse:
    meta = state.embedder.metadata
    index = await state.index.info()
    settings = state.settings
    answer = {
        "version": __version__,
        "uptime_s": round(time.time() - state.started, 3),
        "model": {
            "file": str(state.embedder.model_path.name),
            "backbone": meta.backbone,
            "pooling": meta.pooling,
            "embedding_dim": meta.embedding_dim,
            "input_size": list(meta.input_size),
            "fingerprint": meta.fingerprint,
            "provider": state.embedder.provider,
        },
        "index": {
            key: index[key]
            for key in (
                "count",
                "deleted",
                "factory",
                "dim",
                "metric",
                "generation",
                "gpu",
                "search_params",
                "journal_pending",
            )
        }
        | {
            "tuning": index.get("tuning"),
            "calibration": index.get("calibration"),
            "segments": [_public_segment(segment) for segment in index["segments"]],
        },
        "service": {
            "batching": state.batcher.enabled,
            "model_calls_at_once": state.batcher.model_calls_at_once,
            "max_batch_size": settings.max_batch_size,
            "max_batch_wait_ms": settings.max_batch_wait_ms,
            "max_k": settings.max_k,
            "max_body_bytes": settings.max_body_bytes,
            "max_pixels": settings.max_pixels,
            "mutations": not settings.read_only,
            "read_key_required": settings.read_api_key is not None,
        },
    }
    return InfoResponse.model_validate(answer)


@router.get(
    "/metrics",
    operation_id="get_metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {
            "description": "the Prometheus text format",
            "content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
        }
    },
)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


def _public_segment(segment: dict[str, Any]) -> dict[str, Any]:
    """A segment as /v1/info shows it: a damaged one's reason as its code (the reason
    names files, which stay in the log)."""
    if "damaged" not in segment:
        return segment
    return {**segment, "damaged": damage_code(segment["damaged"])}
