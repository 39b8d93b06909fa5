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
from .catalogue import Catalogue, data_folder
from .errors import install_error_handlers
from .keys import KeyRing
from .maintenance import maintained
from .memory import return_large_buffers_to_the_os
from .metrics import ServiceMetrics
from .middleware import LimitsMiddleware, MetricsMiddleware
from .openapi import finish_openapi
from .routers import (
    aliases,
    collections,
    docs,
    duplicates,
    evaluate,
    health,
    items,
    recommend,
    reembed,
    scroll,
    search,
    snapshots,
    web,
)
from .routers.collections import in_collection
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
        logger.info(
            "serving %d items of %s with %s", len(loaded.store), settings.index, settings.model
        )
        try:
            async with maintained(loaded):
                try:
                    yield
                finally:
                    loaded.ready = False
                    metrics.ready.set(0)
        finally:
            await loaded.batcher.stop()

    return build_app(settings, metrics, lifespan)


def create_data_app(settings: Settings, catalogue: Catalogue | None = None) -> FastAPI:
    """The app serving every collection of the data folder `settings.data`
    (service/catalogue.py); `catalogue`: one the CLI made already (to fail fast)."""
    metrics = catalogue.metrics if catalogue is not None else ServiceMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        return_large_buffers_to_the_os()
        assert settings.data is not None  # Settings checks --data or --model/--index
        served = catalogue or Catalogue(settings, metrics, data_folder(settings.data))
        app.state.catalogue = served
        metrics.track_collections(served.items, served.damaged)
        await served.start()
        metrics.ready.set(1)
        logger.info("serving the collections of %s", settings.data)
        try:
            yield
        finally:
            metrics.ready.set(0)
            await served.stop()

    return build_app(settings, metrics, lifespan)


def build_app(settings: Settings, metrics: ServiceMetrics, lifespan: Lifespan) -> FastAPI:
    """The service's routes, error handlers and request edge (middleware) around
    `lifespan`, which puts the served state in `app.state.service` and sets `ready`:
    `create_app`'s for a model and index loaded in this process (`create_data_app`'s
    for a data folder), the Ray Serve ingress's (distributed.serve) for deployments
    elsewhere. Each stops the duplicates jobs of what it serves before closing it."""
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
    app.state.keys = KeyRing.read(settings.keys_file) if settings.keys_file else None
    install_error_handlers(app)
    finish_openapi(app)
    # duplicates before items: /v1/items/{key}/duplicates is not the item `{key}/duplicates`
    routers = (search, recommend, duplicates, items, scroll, evaluate, health)
    for router in (module.router for module in routers):
        app.include_router(router)
    for router in (module.router for module in routers):
        app.include_router(in_collection(router))
    others = (collections, snapshots, reembed, aliases, web, docs)
    for router in (module.router for module in others):
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
