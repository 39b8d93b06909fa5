"""`create_app()`: the FastAPI application of the search service.

The lifespan handler loads the model and the index once (or adopts a state the CLI
already loaded, so start-up errors are reported before the server binds), starts the
dynamic batcher and the checkpoint task, and on shutdown saves what the journal holds
and closes the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI

from . import __version__
from .errors import document_error_body, install_error_handlers
from .memory import return_large_buffers_to_the_os
from .metrics import ServiceMetrics
from .middleware import LimitsMiddleware, MetricsMiddleware
from .routers import docs, evaluate, health, items, search, web
from .settings import Settings, get_settings
from .state import ServiceState

logger = logging.getLogger("vitrieval.service")

CHECKPOINT_POLL_S = 0.5


def create_app(settings: Settings | None = None, state: ServiceState | None = None) -> FastAPI:
    """The app for `settings` (default: from the environment, `get_settings()`).

    `state`: an already loaded model and index (the CLI loads them first to fail fast);
    without it the lifespan handler loads them.
    """
    settings = settings or get_settings()
    metrics = state.metrics if state is not None else ServiceMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        return_large_buffers_to_the_os()
        loaded = state or await asyncio.to_thread(ServiceState.load, settings, metrics)
        await loaded.batcher.start()
        loaded.ready = True
        metrics.ready.set(1)
        app.state.service = loaded
        checkpointer = asyncio.create_task(_checkpoint_loop(loaded), name="vitrieval-checkpoint")
        logger.info(
            "serving %d items of %s with %s", len(loaded.store), settings.index, settings.model
        )
        try:
            yield
        finally:
            loaded.ready = False
            metrics.ready.set(0)
            checkpointer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checkpointer
            await loaded.batcher.stop()
            await asyncio.to_thread(_final_save, loaded)
            loaded.close()

    app = FastAPI(
        title="vitrieval",
        version=__version__,
        summary="Find similar images: search, embed, manage items and evaluate retrieval.",
        lifespan=lifespan,
        # served by routers/docs.py from local assets: FastAPI's pages load a CDN
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    install_error_handlers(app)
    document_error_body(app)
    routers = (search, items, evaluate, health, web, docs)
    for router in (module.router for module in routers):
        app.include_router(router)
    # outermost last: metrics see every response, 413s and timeouts included
    app.add_middleware(
        LimitsMiddleware,
        max_body_bytes=settings.max_body_bytes,
        timeout_s=settings.request_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        upload_slots=settings.upload_slots,
        max_concurrency=settings.max_concurrency,
        max_body_memory_bytes=settings.max_body_memory_bytes,
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


async def _checkpoint_loop(state: ServiceState) -> None:
    """Save a generation when the journal holds `checkpoint_every` mutations, or holds
    any for `checkpoint_interval_s`: keeps replay at start short and the journal small."""
    settings = state.settings
    if settings.read_only:
        return
    pending_since: float | None = None  # when the oldest unsaved mutation was seen
    while True:
        await asyncio.sleep(CHECKPOINT_POLL_S)
        pending = state.store.journal_pending
        if not pending:
            pending_since = None
            continue
        pending_since = pending_since or time.monotonic()
        due = time.monotonic() - pending_since >= settings.checkpoint_interval_s
        if pending >= settings.checkpoint_every or due:
            try:
                await asyncio.to_thread(state.store.save)
                pending_since = None
            except Exception:  # the journal still holds everything: retry later
                logger.exception("saving the index failed; mutations stay in the journal")
                pending_since = time.monotonic()


def _final_save(state: ServiceState) -> None:
    if state.settings.read_only or not state.store.journal_pending:
        return
    try:
        state.store.save()
    except Exception:
        logger.exception("final save failed; the journal keeps the mutations for next start")
