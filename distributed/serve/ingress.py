"""The ingress deployment: the service's FastAPI app (`vitrieval.service.app.build_app`) whose
model and index are the embedder and shard deployments.

`IngressState` has the surface the routes use on `ServiceState` (settings, metrics,
`index`, `embed_upload`, `check_vector`, the model's description, readiness), so the
routes, middleware and error handlers are the single-process server's own. Its
`RemoteIndex` is the `vitrieval.index.contract.Index` over the shard deployments, routed as
`ShardedStore` routes (index/shards/routing.py): a search goes to every shard as a
`Query` (its filter parsed once, at the HTTP edge, and pickled parsed) and their top
k are merged; a lookup goes to the shard that owns the key. A mutation goes to the
owning shard's writer replica; the ingress (one replica) numbers the items of a
sharded index across its shards, so equal scores keep ordering as in one store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from vitrieval.index.contract import Query, Ranked
from vitrieval.index.shards import is_sharded, shard_of
from vitrieval.index.shards.layout import read_shards_manifest, split_by_shard
from vitrieval.index.shards.routing import (
    in_key_order,
    merge_labelled,
    merge_ranked,
    merge_scrolled,
    numbered,
    shard_queries,
)
from vitrieval.index.shards.store import combine_info
from vitrieval.index.store import ItemRecord, ScrollPage
from vitrieval.index.store.filters import Filter
from vitrieval.service.app import build_app
from vitrieval.service.duplicates import DuplicateJobs
from vitrieval.service.errors import ApiError
from vitrieval.service.inputs import ImageUpload
from vitrieval.service.metrics import ServiceMetrics
from vitrieval.service.settings import Settings
from vitrieval.service.state import Timings, check_vector, keep_upload

from .options import REMOTE_TIMEOUT_S, STATS_POLL_S
from .replicas import ErrorAnswer, ModelInfo, StoreFailure, serve_batching

logger = logging.getLogger("vitrieval.serve")

T = TypeVar("T")


async def remote(response: Awaitable[T], what: str) -> T:
    """The answer of one deployment call, or the service's JSON 503 when the deployment
    cannot answer: its queue full (Serve's back-pressure), no replica up, the replica
    dead mid-call (Serve does not retry a call that reached a replica) or no answer
    within REMOTE_TIMEOUT_S."""
    try:
        return await asyncio.wait_for(response, REMOTE_TIMEOUT_S)
    except BackPressureError:
        raise ApiError(
            503, "overloaded", f"the {what} is busy; retry shortly", {"Retry-After": "1"}
        ) from None
    except (RayActorError, DeploymentUnavailableError, TimeoutError) as exc:
        logger.warning("the %s did not answer: %s", what, type(exc).__name__)
        raise ApiError(
            503, "unavailable", f"the {what} is unavailable; retry shortly", {"Retry-After": "1"}
        ) from None


class RemoteIndex:
    """`vitrieval.index.contract.Index` over the shard deployments."""

    def __init__(self, shards: Sequence[DeploymentHandle], directory: Path, dim: int) -> None:
        self.shards = list(shards)
        self.directory = directory
        self.dim = dim
        # a sharded index has shards.json; a single store is served as one shard
        self.manifest = read_shards_manifest(directory) if is_sharded(directory) else None
        self._next_id: int | None = None  # a sharded index's next item id, once asked
        self._writing = asyncio.Lock()  # ids are taken in the order the adds happen

    def _owner(self, key: str) -> tuple[DeploymentHandle, str]:
        shard = shard_of(key, len(self.shards))
        return self.shards[shard], f"index shard {shard}"

    async def get(self, key: str) -> ItemRecord | None:
        handle, what = self._owner(key)
        return await remote(handle.get.remote(key), what)

    async def contains(self, key: str) -> bool:
        handle, what = self._owner(key)
        return await remote(handle.contains.remote(key), what)

    async def ranked_search(
        self, query: Query | np.ndarray, k: int | None = None, **where: Any
    ) -> Ranked:
        """Every shard's top k merged into one (the arguments as for
        `IndexStore.ranked_search`): the shards get the parsed query, pickled."""
        query = Query.of(query, k, **where)
        each = shard_queries(query, len(self.shards), self.directory, self.manifest is not None)
        calls = [
            remote(handle.ranked_search.remote(part), f"index shard {n}")
            for n, (handle, part) in enumerate(zip(self.shards, each, strict=True))
        ]
        return merge_ranked(_raise_failure(await asyncio.gather(*calls)), query)

    async def vectors(self, keys: Sequence[str]) -> list[np.ndarray | None]:
        keys = list(keys)
        owned = split_by_shard(keys, len(self.shards))
        answers = await asyncio.gather(
            *(
                remote(self.shards[n].vectors.remote([keys[i] for i in at]), f"index shard {n}")
                for n, at in owned.items()
            )
        )
        return in_key_order(len(keys), owned, answers)

    async def add(self, keys: Sequence[str], vectors: np.ndarray, **columns: Any) -> None:
        """`Index.add`: each item to the writer of the shard that owns its key, numbered
        across the shards (`columns`: labels, paths, metadata, replace)."""
        keys = list(keys)
        labels, paths, metadata = columns["labels"], columns["paths"], columns["metadata"]
        owned = split_by_shard(keys, len(self.shards))
        async with self._writing:
            ids = None
            if self.manifest is not None:
                if self._next_id is None:
                    self._next_id = max(
                        await asyncio.gather(
                            *(remote(h.next_id.remote(), "index") for h in self.shards)
                        )
                    )
                ids = numbered(self._next_id, len(keys))
            # until the shards answer, the next id is unknown: a shard may have stored
            # its part before a timeout or a failure elsewhere; re-read it from them then
            self._next_id = None
            answers = await asyncio.gather(
                *(
                    remote(
                        self.shards[n].add.remote(
                            [keys[i] for i in at],
                            vectors[at],
                            labels=[labels[i] for i in at],
                            paths=[paths[i] for i in at],
                            metadata=[metadata[i] for i in at],
                            replace=columns["replace"],
                            ids=None if ids is None else ids[at],
                        ),
                        f"index shard {n}",
                    )
                    for n, at in owned.items()
                )
            )
            failed = [a for a in answers if isinstance(a, StoreFailure)]
            if failed:
                raise failed[0].error
            if ids is not None:
                self._next_id = int(ids[-1]) + 1

    async def remove(self, keys: Sequence[str]) -> int:
        unique = list(dict.fromkeys(keys))
        owned = split_by_shard(unique, len(self.shards))
        async with self._writing:
            answers = await asyncio.gather(
                *(
                    remote(
                        self.shards[n].remove.remote([unique[i] for i in at]), f"index shard {n}"
                    )
                    for n, at in owned.items()
                )
            )
        failed = [a for a in answers if isinstance(a, StoreFailure)]
        if failed:
            raise failed[0].error
        return sum(answers)

    async def labelled_items(
        self, limit: int | None, filter: Filter | None = None
    ) -> tuple[list[str], list[str], np.ndarray]:
        answers = _raise_failure(
            await asyncio.gather(
                *(
                    remote(handle.labelled_items.remote(limit, filter), f"index shard {n}")
                    for n, handle in enumerate(self.shards)
                )
            )
        )
        return merge_labelled([a[0] for a in answers], [a[1] for a in answers], self.dim, limit)

    async def scroll(self, filter: Filter | None, limit: int, after: str | None) -> ScrollPage:
        """Every shard's first `limit` keys after `after`, merged by key."""
        pages = _raise_failure(
            await asyncio.gather(
                *(
                    remote(handle.scroll.remote(filter, limit, after), f"index shard {n}")
                    for n, handle in enumerate(self.shards)
                )
            )
        )
        return merge_scrolled(pages, limit)

    async def info(self) -> dict[str, Any]:
        parts = await asyncio.gather(
            *(remote(h.info.remote(), f"index shard {n}") for n, h in enumerate(self.shards))
        )
        if self.manifest is None:
            return parts[0]
        return await asyncio.to_thread(combine_info, self.directory, self.manifest, parts)

    async def stats(self) -> tuple[int, list[tuple[Any, str]], int]:
        """(live items, damaged segments named as the single-process server names them,
        journal entries not yet saved)."""
        answers = await asyncio.gather(
            *(remote(h.stats.remote(), f"index shard {n}") for n, h in enumerate(self.shards))
        )
        if self.manifest is None:
            return answers[0]
        damaged = [
            (f"{name}/{number}", reason)
            for name, (_, part, _) in zip(self.manifest.shards, answers, strict=True)
            for number, reason in part
        ]
        return sum(a[0] for a in answers), damaged, sum(a[2] for a in answers)

    async def damaged_segments(self) -> list[tuple[Any, str]]:
        return (await self.stats())[1]


def _raise_failure(answers: list[Any]) -> list[Any]:
    """The shards' answers, or the first StoreError one of them returned, raised."""
    for answer in answers:
        if isinstance(answer, StoreFailure):
            raise answer.error
    return answers


@dataclass
class ServeBatching:
    """What the routes read of the single-process `DynamicBatcher`, for the embedder
    deployment: each replica batches with Serve's `@serve.batch` (on unless turned off)
    and runs one model call at a time."""

    enabled: bool
    model_calls_at_once: int  # one per embedder replica
    alive: bool = True  # for /readyz: Serve restarts a dead embedder replica itself


@dataclass
class IngressState:
    """What the routes use of `vitrieval.service.state.ServiceState`, backed by deployments."""

    settings: Settings
    metrics: ServiceMetrics
    embedder: ModelInfo
    index: RemoteIndex
    model: DeploymentHandle
    batcher: ServeBatching
    ready: bool = False
    started: float = field(default_factory=time.time)
    evaluating: asyncio.Lock = field(default_factory=asyncio.Lock)
    duplicate_jobs: DuplicateJobs = field(default_factory=DuplicateJobs)

    @property
    def self_check(self) -> dict[str, Any]:
        return self.embedder.self_check

    async def embed_bytes(
        self, data: bytes, timings: Timings, name: str = "the image"
    ) -> np.ndarray:
        answer = await remote(self.model.embed_image.remote(data, name), "model")
        if isinstance(answer, ErrorAnswer):
            raise answer.error()
        timings.decode, timings.embed = answer.decode_ms, answer.embed_ms
        self.metrics.observe_stage("decode", answer.decode_ms / 1000)
        self.metrics.observe_stage("embed", answer.embed_ms / 1000)
        if answer.batch_size:  # the model call's first image: the call counted once
            self.metrics.batch_size.observe(answer.batch_size)
        return answer.vector

    async def embed_upload(self, upload: ImageUpload, timings: Timings) -> np.ndarray:
        return await self.embed_bytes(upload.data, timings, upload.name)

    def check_vector(self, values: list[float]) -> np.ndarray:
        return check_vector(values, self.index.dim)

    def save_upload(self, data: bytes) -> tuple[Path | None, bool]:
        """As the single-process server keeps uploads: INDEX/uploads (shared storage)."""
        if not self.settings.store_uploads or self.settings.index is None:
            return None, False
        return keep_upload(Path(self.settings.index), data)


@serve.ingress()
class Ingress:
    """The HTTP entry point: `build_app` around a lifespan that connects to the model and
    shard deployments (Serve passes their handles) instead of loading them."""

    def __init__(
        self,
        settings: Settings,
        model: DeploymentHandle,
        shards: list[DeploymentHandle],
        embed_replicas: int,
    ) -> None:
        self.settings = settings
        self.model = model
        self.shards = shards
        self.batching = ServeBatching(serve_batching(settings), model_calls_at_once=embed_replicas)
        self.metrics = ServiceMetrics()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self.settings, self.metrics, self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        settings, metrics = self.settings, self.metrics
        info: ModelInfo = await self.model.describe.remote()
        assert settings.index is not None
        index = RemoteIndex(self.shards, Path(settings.index), info.dim)
        state = IngressState(settings, metrics, info, index, self.model, self.batching)
        app.state.service = state
        state.ready = True
        metrics.ready.set(1)
        stats = asyncio.create_task(_refresh_stats(state), name="vitrieval-stats")
        try:
            yield
        finally:
            state.ready = False
            metrics.ready.set(0)
            await state.duplicate_jobs.stop()  # a job reads the index to its last call
            stats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stats


async def _refresh_stats(state: IngressState) -> None:
    """Keep the index gauges of /metrics current (they are read at scrape time, which
    cannot wait for the shards)."""
    while True:
        with contextlib.suppress(ApiError):
            items, damaged, pending = await state.index.stats()
            state.metrics.index_items.set(items)
            state.metrics.damaged_segments.set(len(damaged))
            state.metrics.journal_pending.set(pending)
        await asyncio.sleep(STATS_POLL_S)
