"""What the routes ask of the index, as awaitables: `IndexAccess`.

The routes never call the store directly: they await these methods, so the same
routes serve an index opened in this process (`LocalIndex`: each call in a worker
thread, as the store's calls block on its locks and on FAISS) or one held elsewhere
(the Ray Serve ingress of `distributed.serve`, whose calls go to the shard deployments).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from index.shards import ShardedStore
from index.store import Hit, IndexStore, ItemRecord


class IndexAccess(Protocol):
    """The index operations of the HTTP API (the meaning of `IndexStore`'s methods)."""

    dim: int

    async def get(self, key: str) -> ItemRecord | None: ...

    async def contains(self, key: str) -> bool: ...

    async def search(
        self, queries: np.ndarray, k: int, *, label: str | None, exclude_keys: Sequence[str]
    ) -> list[list[Hit]]: ...

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
        self, limit: int | None
    ) -> tuple[list[str], list[str], np.ndarray]: ...

    async def info(self) -> dict[str, Any]: ...

    async def damaged_segments(self) -> list[tuple[Any, str]]: ...


class LocalIndex:
    """`IndexAccess` over a store opened in this process."""

    def __init__(self, store: IndexStore | ShardedStore) -> None:
        self.store = store
        self.dim = store.dim

    async def get(self, key: str) -> ItemRecord | None:
        return await asyncio.to_thread(self.store.get, key)

    async def contains(self, key: str) -> bool:
        return await asyncio.to_thread(self.store.__contains__, key)

    async def search(
        self, queries: np.ndarray, k: int, *, label: str | None, exclude_keys: Sequence[str]
    ) -> list[list[Hit]]:
        return await asyncio.to_thread(
            self.store.search, queries, k, label=label, exclude_keys=exclude_keys
        )

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
        await asyncio.to_thread(
            self.store.add,
            keys,
            vectors,
            labels=labels,
            paths=paths,
            metadata=metadata,
            replace=replace,
        )

    async def remove(self, keys: Sequence[str]) -> int:
        return await asyncio.to_thread(self.store.remove, keys)

    async def labelled_items(self, limit: int | None) -> tuple[list[str], list[str], np.ndarray]:
        return await asyncio.to_thread(self.store.labelled_items, limit)

    async def info(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.store.info)  # waits out a running save

    async def damaged_segments(self) -> list[tuple[Any, str]]:
        return list(self.store.damaged_segments())  # lock-free: no thread needed
