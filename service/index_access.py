"""What the routes ask of the index, as awaitables: `IndexAccess`.

The routes never call the store directly: they await these methods, so the same
routes serve an index opened in this process (`LocalIndex`: each call in a worker
thread, as the store's calls block on its locks and on FAISS) or one held elsewhere
(the Ray Serve ingress of `distributed.serve`, whose calls go to the shard deployments).
An `IndexAccess` is also the `index.query.Searcher` that fusion and re-ranking run on.

`filter` is a metadata filter as decoded JSON (index/filters.py), checked by the
request models before it gets here, and handed on as it is (it pickles, for Ray).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from index.follow import CommitFollower
from index.query import stored_vectors
from index.shards import ShardedStore
from index.store import Hit, IndexStore, ItemRecord

Filter = Mapping[str, Any] | None
Store = IndexStore | ShardedStore
T = TypeVar("T")


class IndexAccess(Protocol):
    """The index operations of the HTTP API (the meaning of `IndexStore`'s methods)."""

    dim: int

    async def get(self, key: str) -> ItemRecord | None: ...

    async def contains(self, key: str) -> bool: ...

    async def ranked_search(
        self,
        queries: np.ndarray,
        k: int,
        *,
        label: str | None,
        exclude_keys: Sequence[str],
        filter: Filter = None,
        augmented: bool = False,
    ) -> list[list[tuple[int, Hit]]]:
        """The top-k items of each query with their item ids (what orders equal
        scores), as `IndexStore.ranked_search` gives them; `augmented` ranks against
        the index's DBA vectors."""
        ...

    async def vectors(self, keys: Sequence[str]) -> list[np.ndarray | None]:
        """The stored vectors of `keys` (None: no such item), in one call."""
        ...

    async def add(
        self,
        keys: Sequence[str],
        vectors: np.ndarray,
        *,
        labels: Sequence[str | None],
        paths: Sequence[str | None],
        metadata: Sequence[dict | None],
        replace: bool,
    ) -> None: ...

    async def remove(self, keys: Sequence[str]) -> int: ...

    async def labelled_items(
        self, limit: int | None, filter: Filter = None
    ) -> tuple[list[str], list[str], np.ndarray]: ...

    async def info(self) -> dict[str, Any]: ...

    async def damaged_segments(self) -> list[tuple[Any, str]]: ...


class LocalIndex:
    """`IndexAccess` over a store opened in this process; with a `follower` (a
    read-only server), over whichever commit it answers from at the time of each call."""

    def __init__(
        self, store: IndexStore | ShardedStore, follower: CommitFollower | None = None
    ) -> None:
        self._store = store
        self._follower = follower
        self.dim = store.dim

    @property
    def store(self) -> IndexStore | ShardedStore:
        return self._follower.store if self._follower is not None else self._store

    async def _call(self, call: Callable[[Store], T]) -> T:
        """`call(store)` in a worker thread (the store's calls block on its locks and on
        FAISS); a followed store stays open until the call ends."""
        if self._follower is None:
            return await asyncio.to_thread(call, self._store)
        return await asyncio.to_thread(self._follower.read, call)

    async def get(self, key: str) -> ItemRecord | None:
        return await self._call(lambda store: store.get(key))

    async def contains(self, key: str) -> bool:
        return await self._call(lambda store: key in store)

    async def ranked_search(
        self,
        queries: np.ndarray,
        k: int,
        *,
        label: str | None,
        exclude_keys: Sequence[str],
        filter: Filter = None,
        augmented: bool = False,
    ) -> list[list[tuple[int, Hit]]]:
        return await self._call(
            lambda store: store.ranked_search(
                queries,
                k,
                label=label,
                exclude_keys=exclude_keys,
                filter=filter,
                augmented=augmented,
            )
        )

    async def vectors(self, keys: Sequence[str]) -> list[np.ndarray | None]:
        return await self._call(lambda store: stored_vectors(store, keys))

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
        await self._call(
            lambda store: store.add(
                keys, vectors, labels=labels, paths=paths, metadata=metadata, replace=replace
            )
        )

    async def remove(self, keys: Sequence[str]) -> int:
        return await self._call(lambda store: store.remove(keys))

    async def labelled_items(
        self, limit: int | None, filter: Filter = None
    ) -> tuple[list[str], list[str], np.ndarray]:
        return await self._call(lambda store: store.labelled_items(limit, filter))

    async def info(self) -> dict[str, Any]:
        return await self._call(lambda store: store.info())  # waits out a running save

    async def damaged_segments(self) -> list[tuple[Any, str]]:
        return list(self.store.damaged_segments())  # lock-free: no thread needed
