"""The index contract: `Index`, what every caller may ask of an index, as awaitables.

One declaration for every caller: the HTTP routes (service/routers), fusion and
re-ranking (`vitrieval.index.query`), `vitrieval-index search`. Implemented by

- `LocalIndex`: an `IndexStore` or `ShardedStore` opened in this process (the stores'
  calls block on their locks and on FAISS, so each runs in a worker thread: the one
  sync/async boundary, crossed here); with a `CommitFollower`, over whichever commit
  a read-only server answers from at the time of each call;
- `vitrieval.distributed.serve.ingress.RemoteIndex`: the shard deployments of a Ray cluster.

A search is one `Query` (index/store/request.py: the vectors, k and a `Where`, its
filter parsed once), answered as `Ranked` hits: per query, (item id, `Hit`) best
first, equal scores by ascending item id.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from .follow import CommitFollower
from .shards import ShardedStore
from .store import IndexStore, ItemRecord, ScrollPage
from .store.filters import Filter
from .store.request import Query, Ranked, Where

__all__ = ["Index", "LocalIndex", "Query", "Ranked", "Where", "stored_vectors"]

Store = IndexStore | ShardedStore
T = TypeVar("T")


class Index(Protocol):
    """What callers may ask of an index (the meaning of `IndexStore`'s methods)."""

    dim: int

    async def ranked_search(self, query: Query) -> Ranked:
        """Each row of `query.vectors` (float32 (q, dim)) -> its top `query.k` items
        that `query.where` allows, with their item ids; `where.augmented` ranks
        against the index's DBA vectors (a StoreError where it has none)."""
        ...

    async def vectors(self, keys: Sequence[str]) -> list[np.ndarray | None]:
        """The stored float32 (dim,) vectors of `keys` (None: no such item), in one call."""
        ...

    async def get(self, key: str) -> ItemRecord | None: ...

    async def contains(self, key: str) -> bool: ...

    async def add(
        self,
        keys: Sequence[str],
        vectors: np.ndarray,
        *,
        labels: Sequence[str | None],
        paths: Sequence[str | None],
        metadata: Sequence[dict | None],
        replace: bool,
    ) -> None:
        """`IndexStore.add`: keys (n,), unit float32 (n, dim) vectors and their columns."""
        ...

    async def remove(self, keys: Sequence[str]) -> int:
        """How many of `keys` were present (and are now removed)."""
        ...

    async def labelled_items(
        self, limit: int | None, filter: Filter | None = None
    ) -> tuple[list[str], list[str], np.ndarray]:
        """(keys, labels, float32 (n, dim) vectors) of the labelled items `filter`
        allows, in insertion order; more than `limit` is a StoreError."""
        ...

    async def scroll(self, filter: Filter | None, limit: int, after: str | None) -> ScrollPage:
        """`IndexStore.scroll`: up to `limit` items `filter` allows with keys after
        `after`, in key order, and the next cursor."""
        ...

    async def info(self) -> dict[str, Any]: ...

    async def damaged_segments(self) -> list[tuple[Any, str]]: ...


class LocalIndex:
    """`Index` over a store opened in this process; with a `follower` (a read-only
    server), over whichever commit it answers from at the time of each call."""

    def __init__(self, store: Store, follower: CommitFollower | None = None) -> None:
        self._store = store
        self._follower = follower
        self.dim = store.dim

    @property
    def store(self) -> Store:
        return self._follower.store if self._follower is not None else self._store

    async def _call(self, call: Callable[[Store], T]) -> T:
        """`call(store)` in a worker thread (the store's calls block on its locks and on
        FAISS); a followed store stays open until the call ends."""
        if self._follower is None:
            return await asyncio.to_thread(call, self._store)
        return await asyncio.to_thread(self._follower.read, call)

    async def ranked_search(self, query: Query) -> Ranked:
        return await self._call(lambda store: store.ranked_search(query))

    async def vectors(self, keys: Sequence[str]) -> list[np.ndarray | None]:
        return await self._call(lambda store: stored_vectors(store, keys))

    async def get(self, key: str) -> ItemRecord | None:
        return await self._call(lambda store: store.get(key))

    async def contains(self, key: str) -> bool:
        return await self._call(lambda store: key in store)

    async def add(self, keys: Sequence[str], vectors: np.ndarray, **columns: Any) -> None:
        await self._call(lambda store: store.add(keys, vectors, **columns))

    async def remove(self, keys: Sequence[str]) -> int:
        return await self._call(lambda store: store.remove(keys))

    async def labelled_items(
        self, limit: int | None, filter: Filter | None = None
    ) -> tuple[list[str], list[str], np.ndarray]:
        return await self._call(lambda store: store.labelled_items(limit, filter))

    async def scroll(self, filter: Filter | None, limit: int, after: str | None) -> ScrollPage:
        return await self._call(lambda store: store.scroll(filter, limit, after))

    async def info(self) -> dict[str, Any]:
        return await self._call(lambda store: store.info())  # waits out a running save

    async def damaged_segments(self) -> list[tuple[Any, str]]:
        return list(self.store.damaged_segments())  # lock-free: no thread needed


def stored_vectors(store: Any, keys: Sequence[str]) -> list[np.ndarray | None]:
    """The stored vectors of `keys` in one store (None: not there)."""
    records = [store.get(key) for key in keys]
    return [None if r is None else r.vector for r in records]
