"""`Segment`: the one contract every kind of segment keeps, sealed (_sealed_segment.py) or in
memory (_memory_segment.py).

A store reads its segments only through these members: search fans out over them,
lookups, filters, evaluation and merges call them without knowing which kind they
hold. Item ids are global int64 (the store numbers items across segments); a
tombstoned item stays in a segment's files or memory until a merge or save drops it,
and every read below leaves it out unless it says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from ._items import ItemRecord
from ._memory_segment import SegmentRow
from ._vectors import VectorIndex
from .filters import Match, Range

Described = tuple[str, str | None, str | None, str]
"""An item as search results need it: (key, label, path, metadata JSON)."""


@runtime_checkable
class Segment(Protocol):
    """A set of items with their vectors, searched as one FAISS index."""

    vectors: VectorIndex
    """The FAISS index searched (ids = item ids)."""
    live_count: int
    """Items present and not tombstoned."""

    @property
    def tombstones(self) -> set[int]:
        """Ids of the removed items the segment still holds."""
        ...

    @property
    def ntotal(self) -> int:
        """Vectors in the FAISS index, tombstoned ones included."""
        ...

    def retire(self, ids: np.ndarray) -> None:
        """Tombstone the items of int64 (n,) `ids` (those it holds and are live)."""
        ...

    def live_ids(self, keys: Sequence[str]) -> dict[str, int]:
        """key -> item id of the live items among `keys`."""
        ...

    def get(self, key: str) -> ItemRecord | None:
        """The live item `key`, its vector float32 (dim,) included; None when absent."""
        ...

    def label_ids(self, label: str) -> np.ndarray:
        """Sorted int64 (m,) ids of the live items labelled `label`."""
        ...

    def keys_after(self, after: str | None, limit: int) -> list[tuple[str, int]]:
        """(key, item id) of its first `limit` items whose key sorts after `after` (every
        key when None), in ascending key order (Unicode code points, which SQLite's byte
        order of UTF-8 text is), tombstoned ones too."""
        ...

    def describe(self, ids: Sequence[int]) -> dict[int, Described]:
        """item id -> (key, label, path, metadata JSON) for the `ids` it holds."""
        ...

    def filter_ids(self, leaf: Match | Range) -> np.ndarray:
        """Sorted int64 (m,) ids of the items (tombstoned ones too) where `leaf` holds."""
        ...

    def exact_vectors(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int64 (m,) ids, float32 (m, dim) stored vectors) of the items among `ids` it
        holds."""
        ...

    def exact_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(float32 (r, dim) stored vectors, int64 rows shaped as int64 `ids`: each id's
        row in them, -1 for an id it does not hold). Sealed: the mapped file itself,
        nothing copied, so a re-scoring reads only the rows it scores."""
        ...

    def dead_ids(self) -> np.ndarray:
        """Sorted int64 (t,) tombstoned ids."""
        ...

    def searched(self) -> VectorIndex:
        """The FAISS index a search ranks with."""
        ...

    def keys_by_id(self) -> list[tuple[int, str]]:
        """(id, key) of the live items, in id order."""
        ...

    def labelled(self, dim: int) -> tuple[np.ndarray, list[str], list[str], np.ndarray]:
        """The live labelled items in id order: int64 (m,) ids, keys, labels and
        float32 (m, dim) vectors."""
        ...

    def labelled_ids(self) -> np.ndarray:
        """Sorted int64 (m,) ids of the live labelled items."""
        ...

    def count_labelled(self) -> int:
        """How many live items have a label."""
        ...

    def live_rows(
        self, batch: int = 8192, dead: set[int] | None = None
    ) -> Iterator[tuple[list[SegmentRow], np.ndarray]]:
        """(rows, float32 (b, dim) vectors) of the live items in id order, in batches of
        at most `batch`; `dead`: the tombstones to skip (default: the current ones)."""
        ...

    def close(self) -> None:
        """Release its files or memory; it is not read again."""
        ...
