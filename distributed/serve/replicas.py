"""The model and index deployments of the Ray Serve application: `EmbedderReplica` and
`ShardReplica` (wrapped by `serve.deployment` in `vitrieval.distributed.serve.run`, which sets
their replicas and resources).

Both answer plain values (arrays, dataclasses, tuples): what is wrong with a client's
image comes back as an `ErrorAnswer`, not an exception, so the ingress answers the
same JSON error as the single-process server without unpicking Ray's error wrapping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ray import serve

from vitrieval.index.contract import Query, Ranked, stored_vectors
from vitrieval.index.follow import FOLLOW_POLL_S, CommitFollower
from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.runtime.images import DecodeBudget
from vitrieval.index.runtime.model_metadata import ModelMetadata
from vitrieval.index.store import IndexStore, ItemRecord, ScrollPage, StoreError
from vitrieval.index.store.filters import Filter
from vitrieval.service.errors import ApiError
from vitrieval.service.maintenance import checkpoint_loop, final_save, scrub_loop
from vitrieval.service.metrics import ServiceMetrics
from vitrieval.service.settings import Settings
from vitrieval.service.state import prepare_image, self_check
from vitrieval.service.upkeep import CheckpointStatus

logger = logging.getLogger("vitrieval.serve")


@dataclass(frozen=True)
class ErrorAnswer:
    """An ApiError as data (an exception with its own constructor does not pickle)."""

    status: int
    code: str
    detail: str
    headers: dict[str, str] | None = None

    def error(self) -> ApiError:
        return ApiError(self.status, self.code, self.detail, self.headers)


@dataclass(frozen=True)
class Embedded:
    """One image embedded: the unit vector and the milliseconds of each stage.
    `batch_size`: the images of the model call it was part of, reported by that call's
    first image only (0 for the others), so the ingress counts each call once."""

    vector: np.ndarray
    decode_ms: float
    embed_ms: float
    batch_size: int = 0


@dataclass(frozen=True)
class ModelInfo:
    """What /v1/info and /v1/embed report about the served model."""

    metadata: ModelMetadata
    fingerprint: str
    dim: int
    model_path: Path
    provider: str
    self_check: dict[str, Any]


def serve_batching(settings: Settings) -> bool:
    """Whether the embedder replicas batch (Serve's `@serve.batch`): unless turned off."""
    return settings.batching is not False


class EmbedderReplica:
    """The model: decodes uploads in a thread pool (under the decode memory budget, as
    the single-process server does) and embeds concurrent requests in one model call
    (`@serve.batch`, sized from the settings)."""

    def __init__(self, settings: Settings, device: str, threads: int, dim: int) -> None:
        self.settings = settings
        self.embedder = Embedder(
            settings.model,
            device=device,
            batch_size=settings.max_batch_size,
            intra_op_threads=threads,
            max_pixels=settings.max_pixels,
            spin_wait=settings.ort_spin_wait,
        )
        self.info = ModelInfo(
            metadata=self.embedder.metadata,
            fingerprint=self.embedder.fingerprint,
            dim=self.embedder.dim,
            model_path=self.embedder.model_path,
            provider=self.embedder.provider,
            self_check=self_check(self.embedder, dim),
        )
        self.decode_pool = ThreadPoolExecutor(
            settings.decode_threads, thread_name_prefix="vitrieval-decode"
        )
        self.decode_budget = DecodeBudget(
            settings.decode_memory_bytes, wait_s=min(10.0, settings.request_timeout_s)
        )
        # one model call at a time, each on all of ONNX Runtime's threads
        self.model_pool = ThreadPoolExecutor(1, thread_name_prefix="vitrieval-model")
        batch_size = settings.max_batch_size if serve_batching(settings) else 1
        self._embed_batch.set_max_batch_size(batch_size)
        self._embed_batch.set_batch_wait_timeout_s(settings.max_batch_wait_ms / 1000)

    def describe(self) -> ModelInfo:
        return self.info

    async def embed_image(self, data: bytes, name: str) -> Embedded | ErrorAnswer:
        """Encoded image -> its embedding, or what is wrong with it."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            image = await loop.run_in_executor(
                self.decode_pool, prepare_image, self.embedder, data, self.decode_budget, name
            )
        except ApiError as exc:
            return ErrorAnswer(exc.status, exc.code, exc.detail, exc.headers)
        decoded = time.perf_counter()
        vector, batch_size = await self._embed_batch(image)
        return Embedded(
            vector,
            decode_ms=(decoded - started) * 1000,
            embed_ms=(time.perf_counter() - decoded) * 1000,
            batch_size=batch_size,
        )

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)
    async def _embed_batch(self, images: list[np.ndarray]) -> list[tuple[np.ndarray, int]]:
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(
            self.model_pool, self.embedder.embed_arrays, np.stack(images)
        )
        # the call's size goes back with its first image only (Embedded.batch_size)
        return [(vector, len(images) if i == 0 else 0) for i, vector in enumerate(out)]


@dataclass(frozen=True)
class StoreFailure:
    """A StoreError a mutation raised (KeyExistsError, JournalWriteError, ...), returned
    as a value: the ingress raises it again, so the routes answer as they always do."""

    error: StoreError


@dataclass
class _Upkeep:
    """What `vitrieval.service.maintenance`'s loops use of a service state: a writer's own."""

    settings: Settings
    store: IndexStore
    metrics: ServiceMetrics
    checkpoints: CheckpointStatus = field(default_factory=CheckpointStatus)


class ShardReplica:
    """One shard of the index (or the whole of a single store).

    A reader (`writer` None) answers from the last commit and follows a writer's
    commits (`vitrieval.index.follow.CommitFollower`: the manifest polled every FOLLOW_POLL_S,
    the files it reads held by a reader lease). The writer (`writer`: the service's
    settings, mutations on) is the shard's one replica: it opens the shard with its
    journal, as the single-process server does, and runs the same checkpoints, merges
    and scrub (`vitrieval.service.maintenance`), and a final save when Serve stops it."""

    def __init__(
        self, directory: str, fingerprint: str | None, dim: int, writer: Settings | None = None
    ) -> None:
        self.directory = Path(directory)
        self.follower: CommitFollower | None = None
        if writer is None:
            self.follower = CommitFollower(
                self.directory,
                lambda: IndexStore.open(self.directory, fingerprint=fingerprint, dim=dim),
            )
            self.store = self.follower.store
        else:
            self.store = IndexStore.open(
                self.directory, fingerprint=fingerprint, dim=dim, journal=True
            )
        self.upkeep = _Upkeep(writer, self.store, ServiceMetrics()) if writer else None
        self._background: list[asyncio.Task[None]] = []

    def _ensure_background(self) -> None:
        # the constructor runs outside the replica's event loop: started on first use
        # (a request or Serve's first health check)
        if self._background:
            return
        loop = asyncio.get_running_loop()
        if self.follower is not None:
            self._background = [loop.create_task(self.follower.follow(FOLLOW_POLL_S))]
        else:
            self._background = [
                loop.create_task(checkpoint_loop(self.upkeep)),  # type: ignore[arg-type]
                loop.create_task(scrub_loop(self.upkeep)),  # type: ignore[arg-type]
            ]

    async def check_health(self) -> None:
        self._ensure_background()

    def __del__(self) -> None:
        # Serve stops a replica by calling this: what the writer's journal holds is saved
        if getattr(self, "upkeep", None) is not None:
            for task in self._background:
                task.cancel()
            final_save(self.upkeep)  # type: ignore[arg-type]

    # -- reads --------------------------------------------------------------------------

    async def _read(self, call: Callable[[IndexStore], Any]) -> Any:
        """`call(store)` in a worker thread on the store open now; a reader's store
        replaced by a newer commit meanwhile is closed when its last call ends."""
        if self.follower is None:
            return await asyncio.to_thread(call, self.store)
        return await asyncio.to_thread(self.follower.read, call)

    async def ranked_search(self, query: Query) -> Ranked | StoreFailure:
        """`IndexStore.ranked_search` of the ingress's parsed query (its filter is not
        parsed again); a StoreError comes back as a StoreFailure."""
        self._ensure_background()

        def search(store: IndexStore) -> Ranked | StoreFailure:
            try:
                return store.ranked_search(query)
            except StoreError as exc:
                return StoreFailure(exc)

        return await self._read(search)

    async def vectors(self, keys: list[str]) -> list[np.ndarray | None]:
        """The stored vectors of `keys` (None: not in this shard)."""
        self._ensure_background()
        return await self._read(lambda store: stored_vectors(store, keys))

    async def get(self, key: str) -> ItemRecord | None:
        self._ensure_background()
        return await self._read(lambda store: store.get(key))

    async def contains(self, key: str) -> bool:
        return await self._read(lambda store: key in store)

    async def labelled_items(
        self, limit: int | None, filter: Filter | None = None
    ) -> tuple[tuple[list[str], list[str], np.ndarray], dict[str, int]] | StoreFailure:
        """`IndexStore.labelled_items` and the item ids of those keys (what orders the
        items of several shards, `vitrieval.index.shards.routing.merge_labelled`); a StoreError
        (more than `limit` items) comes back as a StoreFailure."""

        def read(store: IndexStore) -> tuple[tuple[list[str], list[str], np.ndarray], dict]:
            return store.labelled_items_and_ids(limit, filter)  # no delete between the two

        try:
            return await self._read(read)
        except StoreError as exc:
            return StoreFailure(exc)

    async def scroll(
        self, filter: Filter | None, limit: int, after: str | None
    ) -> ScrollPage | StoreFailure:
        """`IndexStore.scroll` of the ingress's parsed filter; a StoreError (a limit out
        of range) comes back as a StoreFailure."""
        try:
            return await self._read(lambda store: store.scroll(filter, limit, after))
        except StoreError as exc:
            return StoreFailure(exc)

    async def info(self) -> dict[str, Any]:
        self._ensure_background()
        return await self._read(lambda store: store.info())

    async def stats(self) -> tuple[int, list[tuple[int, str]], int]:
        """(live items, damaged segments, journal entries not yet saved): what /readyz
        and /metrics need, lock-free."""
        self._ensure_background()
        store = self.follower.store if self.follower is not None else self.store
        return len(store), store.damaged_segments(), store.journal_pending

    # -- mutations (the writer) ----------------------------------------------------------

    async def next_id(self) -> int:
        return self.store.next_id

    async def add(
        self, keys: list[str], vectors: np.ndarray, **columns: Any
    ) -> StoreFailure | None:
        """`IndexStore.add` (`columns`: its labels, paths, metadata, replace and ids),
        journalled before it returns."""
        self._ensure_background()
        try:
            await asyncio.to_thread(self.store.add, keys, vectors, **columns)
        except StoreError as exc:
            return StoreFailure(exc)
        return None

    async def remove(self, keys: list[str]) -> int | StoreFailure:
        self._ensure_background()
        try:
            return await asyncio.to_thread(self.store.remove, keys)
        except StoreError as exc:
            return StoreFailure(exc)
