"""`create_app()`: the FastAPI application of the search service.

The lifespan handler loads the model and the index once (or adopts a state the CLI
already loaded, so start-up errors are reported before the server binds), starts the
dynamic batcher and the index's upkeep (checkpoints, merges, scrub: maintenance.py;
read-only, following a writer's commits: index/follow.py),
and on shutdown saves what the journal holds and closes the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI

from . import __version__
from .errors import install_error_handlers
from .maintenance import checkpoint_loop, final_save, scrub_loop
from .memory import return_large_buffers_to_the_os
from .metrics import ServiceMetrics
from .middleware import LimitsMiddleware, MetricsMiddleware
from .openapi import finish_openapi
from .routers import (
    docs,
    duplicates,
    evaluate,
    health,
    items,
    recommend,
    scroll,
    search,
    web,
)
from .settings import Settings, get_settings
from .state import ServiceState

logger = logging.getLogger("vitrieval.service")

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


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
        upkeep = [
            asyncio.create_task(checkpoint_loop(loaded), name="vitrieval-checkpoint"),
            asyncio.create_task(scrub_loop(loaded), name="vitrieval-scrub"),
        ]
        if loaded.follower is not None:  # read-only: answer from each new commit
            upkeep.append(asyncio.create_task(loaded.follower.follow(), name="vitrieval-follow"))
        logger.info(
            "serving %d items of %s with %s", len(loaded.store), settings.index, settings.model
        )
        try:
            yield
        finally:
            loaded.ready = False
            metrics.ready.set(0)
            for task in upkeep:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await loaded.batcher.stop()
            await asyncio.to_thread(final_save, loaded)
            loaded.close()

    return build_app(settings, metrics, lifespan)


def build_app(settings: Settings, metrics: ServiceMetrics, lifespan: Lifespan) -> FastAPI:
    """The service's routes, error handlers and request edge (middleware) around
    `lifespan`, which puts the served state in `app.state.service` and sets `ready`:
    `create_app`'s for a model and index loaded in this process, the Ray Serve
    ingress's (distributed.serve) for deployments elsewhere."""

    @contextlib.asynccontextmanager
    async def serving(app: FastAPI) -> AsyncIterator[None]:
        async with lifespan(app):
            try:
                yield
            finally:  # before the index closes: a job reads it to its last call
                await app.state.service.duplicate_jobs.stop()

    app = FastAPI(
        title="vitrieval",
        version=__version__,
        summary="Find similar images: search, embed, manage items and evaluate retrieval.",
        lifespan=serving,
        # served by routers/docs.py from local assets: FastAPI's pages load a CDN
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    install_error_handlers(app)
    finish_openapi(app)
    # duplicates before items: /v1/items/{key}/duplicates is not the item `{key}/duplicates`
    routers = (search, recommend, duplicates, items, scroll, evaluate, health, web, docs)
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
