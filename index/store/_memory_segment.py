"""The growing segment: the items added since the last save, held in memory.

A FAISS index of the store's factory (cloned from the trained quantizer for IVF/PQ)
plus an in-memory SQLite item table that keeps each exact vector, so the segment can
be written out (sealed) or rebuilt without touching the sealed segments. New adds
always land here; the write-ahead journal (_journal.py) makes them durable until the
next save seals the segment. The upgrade of a format-1 index loads it into one of
these (_upgrade_format1.py).

Removal: layouts that can remove vectors remove them; others (HNSW) keep tombstones
(rows marked deleted) that searches skip and sealing leaves out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import numpy as np

from ._filter_plans import positions
from ._items import Hit, ItemRecord, ItemTable, Row
from ._vectors import VectorIndex
from .filters import Match, Range

SegmentRow = tuple[int, str, str | None, str | None, str]
"""(id, key, label, path, metadata JSON) of one item."""


class MemorySegment:
    """Items in memory: `vectors` (FAISS, ids = item ids) and `items` (SQLite)."""

    def __init__(self, vectors: VectorIndex, items: ItemTable) -> None:
        self.vectors = vectors
        self.items = items
        self.tombstones: set[int] = items.deleted_ids()
        self.live_count = items.count(deleted=False)
        self.frozen = False  # being sealed: its FAISS index and rows no longer change
        self.frozen_dead: set[int] = set()  # tombstones when frozen (the writer skips them)
        self.frozen_rows = 0  # live rows when frozen (what the sealed segment holds)
        self.number = None  # not a sealed segment

    def freeze(self) -> set[int]:
        """Stop changing the index and rows (a save is writing them); later removals
        become tombstones. Returns the tombstones as of now (what the writer skips)."""
        self.frozen = True
        return set(self.tombstones)

    @property
    def ntotal(self) -> int:
        return self.vectors.ntotal

    def max_id(self) -> int:
        return self.items.max_id()

    # -- mutations -------------------------------------------------------------------

    def insert(self, rows: Sequence[Row], x: np.ndarray, ids: np.ndarray) -> None:
        """Add rows (inside the caller's `items.transaction()`), vectors float32 (n, dim)."""
        self.items.insert(rows)
        self.vectors.add(x, ids)
        self.live_count += len(rows)

    def retire_rows(self, ids: np.ndarray) -> None:
        """SQLite side of a removal (before an insert may reuse the keys)."""
        if ids.size == 0:
            return
        if self.vectors.removable:
            self.items.delete_rows(ids.tolist())
        else:
            self.items.mark_deleted(ids.tolist())

    def retire_vectors(self, ids: np.ndarray) -> None:
        """FAISS side of a removal: remove_ids, or tombstones searches skip."""
        if ids.size == 0:
            return
        if self.vectors.removable:
            self.vectors.remove(ids)
        else:
            self.tombstones.update(ids.tolist())
        self.live_count -= int(ids.size)

    def retire(self, ids: np.ndarray) -> None:
        if self.frozen:
            fresh = set(ids.tolist()) - self.tombstones
            self.tombstones.update(fresh)
            self.live_count -= len(fresh)
            return
        with self.items.transaction():
            self.retire_rows(ids)
            self.retire_vectors(ids)

    # -- reads -----------------------------------------------------------------------

    def live_ids(self, keys: Sequence[str]) -> dict[str, int]:
        found = self.items.live_ids(keys)
        if self.frozen and self.tombstones:
            return {k: i for k, i in found.items() if i not in self.tombstones}
        return found

    def get(self, key: str) -> ItemRecord | None:
        if self.frozen and not self.live_ids([key]):
            return None
        return self.items.get(key)

    def label_ids(self, label: str) -> np.ndarray:
        ids = self.items.label_ids(label)
        if self.frozen and self.tombstones:
            dead = np.fromiter(self.tombstones, dtype=np.int64, count=len(self.tombstones))
            return ids[~np.isin(ids, dead)]
        return ids

    def describe(self, ids: Sequence[int]) -> dict[int, tuple[str, str | None, str | None, str]]:
        return self.items.describe(ids)

    def keys_after(self, after: str | None, limit: int) -> list[tuple[str, int]]:
        return self.items.keys_after(after, limit)

    def filter_ids(self, leaf: Match | Range) -> np.ndarray:
        """Sorted ids of the segment's items (tombstoned ones too) where `leaf` holds."""
        return self.items.filter_ids(leaf)

    def exact_vectors(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, float32 (m, dim) stored vectors) of the segment's items among `ids`."""
        return self.items.vectors_of(ids, self.vectors.cpu.d)

    def exact_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(float32 (m, dim) vectors of the held items among `ids`, read from the item
        table, int64 rows shaped as `ids`: each id's row in them, -1 where not held)."""
        found, vectors = self.exact_vectors(np.unique(ids[ids >= 0]))
        return vectors, positions(found, ids)

    def dead_ids(self) -> np.ndarray:
        return np.fromiter(sorted(self.tombstones), dtype=np.int64, count=len(self.tombstones))

    def searched(self) -> VectorIndex:
        """The FAISS index a search ranks with."""
        return self.vectors

    def keys_by_id(self) -> list[tuple[int, str]]:
        rows = self.items.conn.execute("SELECT id, key FROM items WHERE deleted = 0 ORDER BY id")
        return [(int(i), k) for i, k in rows if i not in self.tombstones]

    def labelled(self, dim: int) -> tuple[np.ndarray, list[str], list[str], np.ndarray]:
        """(ids, keys, labels, float32 vectors) of the live labelled items, id order."""
        rows = [
            row
            for row in self.items.conn.execute(
                "SELECT id, key, label, vector FROM items WHERE deleted = 0 "
                "AND label IS NOT NULL ORDER BY id"
            )
            if row[0] not in self.tombstones
        ]
        blob = b"".join(row[3] for row in rows)
        vectors = np.frombuffer(blob, dtype="<f4").astype(np.float32).reshape(len(rows), dim)
        ids = np.fromiter((row[0] for row in rows), dtype=np.int64, count=len(rows))
        return ids, [r[1] for r in rows], [r[2] for r in rows], vectors

    def labelled_ids(self) -> np.ndarray:
        """Sorted ids of the live labelled items."""
        rows = self.items.conn.execute(
            "SELECT id FROM items WHERE deleted = 0 AND label IS NOT NULL ORDER BY id"
        )
        return np.fromiter((i for (i,) in rows if i not in self.tombstones), dtype=np.int64)

    def count_labelled(self) -> int:
        if self.frozen and self.tombstones:
            return len(self.labelled(self.vectors.cpu.d)[0])
        return self.items.count_labelled()

    def live_rows(
        self, batch: int = 8192, dead: set[int] | None = None
    ) -> Iterator[tuple[list[SegmentRow], np.ndarray]]:
        """(rows, float32 (b, dim) vectors) of the live items in id order, in batches;
        `dead`: the tombstones to skip (default: the current ones)."""
        dead = self.tombstones if dead is None else dead
        dim = self.vectors.cpu.d
        cursor = self.items.conn.execute(
            "SELECT id, key, label, path, metadata, vector FROM items WHERE deleted = 0 ORDER BY id"
        )
        while chunk := cursor.fetchmany(batch):
            live = [row for row in chunk if row[0] not in dead]
            if not live:
                continue
            blob = b"".join(row[5] for row in live)
            vectors = np.frombuffer(blob, dtype="<f4").astype(np.float32)
            yield [row[:5] for row in live], vectors.reshape(len(live), dim)

    def all_rows(self, batch: int = 8192) -> Iterator[tuple[list[SegmentRow], np.ndarray]]:
        """Like `live_rows`, with the tombstoned rows too: every vector FAISS holds."""
        dim = self.vectors.cpu.d
        cursor = self.items.conn.execute(
            "SELECT id, key, label, path, metadata, vector FROM items ORDER BY id"
        )
        while chunk := cursor.fetchmany(batch):
            blob = b"".join(row[5] for row in chunk)
            vectors = np.frombuffer(blob, dtype="<f4").astype(np.float32)
            yield [row[:5] for row in chunk], vectors.reshape(len(chunk), dim)

    def close(self) -> None:
        self.items.close()


def hit(row: tuple[str, str | None, str | None, str], score: float) -> Hit:
    """A search result from a described row (key, label, path, metadata JSON)."""
    key, label, path, metadata = row
    # most catalogues' items carry no metadata: skip the JSON parser for those
    return Hit(key, score, label, path, {} if metadata == "{}" else json.loads(metadata))
