"""Following a writer's commits from a read-only process: `CommitFollower`.

A reader (a `--read-only` server, a Ray read replica) opens the committed generation
and answers from it; every `FOLLOW_POLL_S` it looks at the index's manifest files
(mtime, size, inode: a stat each) and, when a writer has committed since, opens the
new generation and answers from that. Calls in flight finish on the store they
started on; the old store is closed when its last call ends. Each open store holds a
reader lease on its files (index/store/_leases.py), so the writer's commits and merges
never delete what a reader still answers from, however many there are meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .shards import ShardedStore
from .store import IndexStore
from .store import manifest as mf

logger = logging.getLogger(__name__)

FOLLOW_POLL_S = 2.0
"""How often a reader looks at the index's manifest and reopens the index when a
writer has committed a new generation (a `--read-only` server, a Ray read replica)."""

Store = IndexStore | ShardedStore
T = TypeVar("T")
Stamp = tuple[tuple[str, int, int, int], ...]


def manifest_stamp(directory: Path) -> Stamp | None:
    """(name, mtime, size, inode) of the index's manifest files: its own and, for a
    sharded index, each shard's; None when there is none (a commit being replaced)."""
    stamps = []
    for path in (directory / mf.MANIFEST, *sorted(directory.glob(f"*/{mf.MANIFEST}"))):
        try:
            st = path.stat()
        except OSError:
            continue
        stamps.append((str(path.relative_to(directory)), st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(stamps) or None


class CommitFollower:
    """A read-only index that moves to each generation a writer commits (see the
    module docstring). `opener` opens the index read-only (no journal)."""

    def __init__(self, directory: Path, opener: Callable[[], Store]) -> None:
        self.directory = Path(directory)
        self._opener = opener
        # stamped before opening: a commit landing meanwhile is picked up next poll
        self.stamp = manifest_stamp(self.directory)
        self.store = opener()
        self._lock = threading.Lock()
        self._in_flight: dict[int, int] = {}  # id(store) -> calls running on it
        self._closed = False

    @contextlib.contextmanager
    def using(self) -> Iterator[Store]:
        """The store open now, kept open until the block ends."""
        with self._lock:
            store = self.store
            self._in_flight[id(store)] = self._in_flight.get(id(store), 0) + 1
        try:
            yield store
        finally:
            with self._lock:
                left = self._in_flight.pop(id(store)) - 1
                if left:
                    self._in_flight[id(store)] = left
                retired = not left and store is not self.store
            if retired:
                _close_quietly(store)

    def read(self, call: Callable[[Store], T]) -> T:
        """`call(store)` on the store open now."""
        with self.using() as store:
            return call(store)

    def refresh(self) -> bool:
        """Open the newest commit if the manifest changed; True when it did. A failed
        open (a commit being replaced, a damaged file) keeps the current store."""
        stamp = manifest_stamp(self.directory)
        if stamp is None or stamp == self.stamp or self._closed:
            return False
        try:
            fresh = self._opener()
        except Exception as exc:  # StoreError, OSError: the next poll tries again
            logger.warning("reopening %s failed (%s); retrying", self.directory, exc)
            return False
        with self._lock:
            old, self.store, self.stamp = self.store, fresh, stamp
            idle = not self._in_flight.get(id(old))
        if idle:
            _close_quietly(old)
        logger.debug("%s: now answering from its latest commit", self.directory)
        return True

    async def follow(self, poll_s: float = FOLLOW_POLL_S) -> None:
        """Refresh every `poll_s` until cancelled."""
        while True:
            await asyncio.sleep(poll_s)
            await asyncio.to_thread(self.refresh)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store = self.store
        _close_quietly(store)


def _close_quietly(store: Any) -> None:
    """Close a store no call uses any more; a failure only leaves it to the collector."""
    with contextlib.suppress(Exception):
        store.close()
