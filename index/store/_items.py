"""Item metadata and vectors in SQLite: the store's source of truth besides FAISS.

The working copy lives in memory (loaded from the verified snapshot bytes with
``deserialize``); ``snapshot_to`` writes a consistent copy with SQLite's backup API.
Vectors are kept here as float32 blobs so that any FAISS index can be rebuilt,
retrained or compacted from SQLite alone, and ``get`` returns the exact vector.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import _field_index as fx
from . import _filter_plans as filtering
from ._columns import NO_COLUMNS
from .errors import StoreError
from .filters import Match, Range

# key is unique among live rows only: a tombstoned row (deleted = 1, kept for index
# types that cannot remove vectors) still holds its key while a replacement is added.
SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL,
    label TEXT,
    path TEXT,
    metadata TEXT NOT NULL DEFAULT '{}',
    vector BLOB NOT NULL,
    deleted INTEGER NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX IF NOT EXISTS items_live_key ON items(key) WHERE deleted = 0;
CREATE INDEX IF NOT EXISTS items_live_label ON items(label) WHERE deleted = 0;
"""
COLUMNS = ("id", "key", "label", "path", "metadata", "vector", "deleted")
VECTOR_DTYPE = np.dtype("<f4")  # explicit little-endian: the file is portable
IN_CHUNK = 500  # ids per "IN (...)" query, far below SQLite's variable limit


@dataclass(frozen=True, slots=True)  # slots: a search makes one per hit
class Hit:
    """One search result: the item's key, its inner-product score and its metadata."""

    key: str
    score: float
    label: str | None
    path: str | None
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ItemRecord:
    """One stored item; `vector` is the exact float32 (dim,) vector that was added."""

    key: str
    label: str | None
    path: str | None
    metadata: dict
    vector: np.ndarray


@dataclass(frozen=True)
class ListedItem:
    """One item as `scroll` lists it: its columns, not its vector."""

    key: str
    label: str | None
    path: str | None
    metadata: dict


@dataclass(frozen=True)
class ScrollPage:
    """One call of `scroll`: up to `limit` items in ascending key order, and `next`,
    the key to pass as `after` for the rest (None: this was the last page)."""

    items: list[ListedItem]
    next: str | None


@dataclass(frozen=True)
class Row:
    """A row to insert: `vector` is a float32 (dim,) array, `metadata` already JSON text."""

    id: int
    key: str
    label: str | None
    path: str | None
    metadata: str
    vector: np.ndarray


def chunks(values: Sequence[Any], size: int = IN_CHUNK) -> Iterator[Sequence[Any]]:
    """`values` in slices of at most `size`: one `IN (...)` statement each."""
    for start in range(0, len(values), size):
        yield values[start : start + size]


def placeholders(n: int) -> str:
    """The `?, ?, ...` of an `IN (...)` of n values."""
    return ",".join("?" * n)


@functools.lru_cache(maxsize=1024)
def in_list(sql: str, n: int) -> str:
    """`sql` with its `{marks}` filled for an `IN (...)` of n values: made once per
    statement and length, as a search describes its hits with the same one each time
    (formatting it anew is a few µs of every search once FAISS's scan has left the CPU
    caches cold)."""
    return sql.format(marks=placeholders(n))


class ItemTable:
    """The `items` table of one store, on an in-memory SQLite connection.

    Not thread-safe by itself: IndexStore serialises all calls with its lock.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.fields = fx.read_selection(conn)

    @classmethod
    def new(cls, fields: fx.FieldSelection) -> ItemTable:
        """An empty table whose field index covers `fields` (_field_index.py)."""
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        conn.executescript(SCHEMA)
        fx.create_tables(conn, fields)
        conn.execute(fx.FIELDS_INDEX)
        return cls(conn)

    @classmethod
    def from_bytes(cls, data: bytes, source: Path) -> ItemTable:
        """Load a verified snapshot (the bytes of items.<g>.sqlite) into memory."""
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        try:
            conn.deserialize(data)
            found = [row[1] for row in conn.execute("PRAGMA table_info(items)")]
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise StoreError(f"{source} is not a readable item database: {exc}") from None
        if tuple(found) != COLUMNS:
            conn.close()
            raise StoreError(f"{source} has no vitrieval items table (columns {found})")
        return cls(conn)

    def snapshot_to(self, path: Path) -> None:
        """Write a consistent copy to `path` (an empty or new file) with the backup API.

        The copy uses SQLite's default rollback journal (not WAL), so the snapshot is a
        single self-contained file once the connection is closed.
        """
        target = sqlite3.connect(path)
        try:
            target.execute("PRAGMA journal_mode=DELETE")
            self.conn.backup(target)
        finally:
            target.close()

    def close(self) -> None:
        self.conn.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Commit on success, roll back on any exception (FAISS failures included)."""
        with self.conn:
            yield

    # -- counts and ids ---------------------------------------------------------------

    def count(self, deleted: bool) -> int:
        sql = "SELECT COUNT(*) FROM items WHERE deleted = ?"
        (n,) = self.conn.execute(sql, (int(deleted),)).fetchone()
        return int(n)

    def max_id(self) -> int:
        (value,) = self.conn.execute("SELECT MAX(id) FROM items").fetchone()
        return -1 if value is None else int(value)

    def deleted_ids(self) -> set[int]:
        return {row[0] for row in self.conn.execute("SELECT id FROM items WHERE deleted = 1")}

    def live_ids(self, keys: Sequence[str]) -> dict[str, int]:
        """key -> id for those of `keys` that are live."""
        found: dict[str, int] = {}
        for chunk in chunks(keys):
            marks = placeholders(len(chunk))
            sql = f"SELECT key, id FROM items WHERE deleted = 0 AND key IN ({marks})"
            found.update(self.conn.execute(sql, tuple(chunk)))
        return found

    def label_ids(self, label: str) -> np.ndarray:
        """int64 (n,) ids of live items with `label`, ascending."""
        rows = self.conn.execute(
            "SELECT id FROM items WHERE deleted = 0 AND label = ? ORDER BY id", (label,)
        )
        return np.fromiter((row[0] for row in rows), dtype=np.int64)

    def keys(self) -> list[str]:
        rows = self.conn.execute("SELECT key FROM items WHERE deleted = 0 ORDER BY id")
        return [row[0] for row in rows]

    # -- mutations --------------------------------------------------------------------

    def insert(self, rows: Sequence[Row]) -> None:
        self.conn.executemany(
            "INSERT INTO items (id, key, label, path, metadata, vector) VALUES (?, ?, ?, ?, ?, ?)",
            (
                (r.id, r.key, r.label, r.path, r.metadata, r.vector.astype(VECTOR_DTYPE).tobytes())
                for r in rows
            ),
        )
        if self.fields is not fx.NOTHING:
            fx.insert_fields(self.conn, ((r.id, r.metadata) for r in rows), self.fields)

    def delete_rows(self, ids: Sequence[int]) -> None:
        for chunk in chunks(ids):
            marks = placeholders(len(chunk))
            self.conn.execute(f"DELETE FROM items WHERE id IN ({marks})", tuple(chunk))
            if self.fields is not fx.NOTHING:
                self.conn.execute(f"DELETE FROM fields WHERE id IN ({marks})", tuple(chunk))

    def mark_deleted(self, ids: Sequence[int]) -> None:
        for chunk in chunks(ids):
            sql = f"UPDATE items SET deleted = 1 WHERE id IN ({placeholders(len(chunk))})"
            self.conn.execute(sql, tuple(chunk))

    def purge_deleted(self) -> None:
        if self.fields is not fx.NOTHING:
            self.conn.execute(
                "DELETE FROM fields WHERE id IN (SELECT id FROM items WHERE deleted = 1)"
            )
        self.conn.execute("DELETE FROM items WHERE deleted = 1")

    # -- reads ------------------------------------------------------------------------

    def get(self, key: str) -> ItemRecord | None:
        row = self.conn.execute(
            "SELECT key, label, path, metadata, vector FROM items WHERE deleted = 0 AND key = ?",
            (key,),
        ).fetchone()
        if row is None:
            return None
        key, label, path, metadata, blob = row
        vector = np.frombuffer(blob, dtype=VECTOR_DTYPE).astype(np.float32)
        return ItemRecord(key, label, path, json.loads(metadata), vector)

    def keys_after(self, after: str | None, limit: int) -> list[tuple[str, int]]:
        """(key, id) of the first `limit` live rows whose key sorts after `after` (all
        when None), in key order (the live-key index: no sort)."""
        where, values = ("AND key > ?", (after, limit)) if after is not None else ("", (limit,))
        sql = f"SELECT key, id FROM items WHERE deleted = 0 {where} ORDER BY key LIMIT ?"
        return list(self.conn.execute(sql, values))

    def describe(self, ids: Sequence[int]) -> dict[int, tuple[str, str | None, str | None, str]]:
        """id -> (key, label, path, metadata JSON) for `ids` (any order, duplicates fine)."""
        unique = sorted(set(ids))
        found: dict[int, tuple[str, str | None, str | None, str]] = {}
        for chunk in chunks(unique):
            sql = (
                "SELECT id, key, label, path, metadata FROM items "
                f"WHERE id IN ({placeholders(len(chunk))})"
            )
            for item_id, key, label, path, metadata in self.conn.execute(sql, tuple(chunk)):
                found[item_id] = (key, label, path, metadata)
        return found

    def filter_ids(self, leaf: Match | Range) -> np.ndarray:
        """Sorted ids of the items (deleted ones too) where `leaf` holds (_field_index.py)."""
        return filtering.leaf_ids(leaf, NO_COLUMNS, self.conn, self.fields, "the growing segment")

    def vectors_of(self, ids: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, float32 (m, dim) vectors) of the items among `ids`, in id order."""
        found: list[tuple[int, bytes]] = []
        for chunk in chunks(ids.tolist()):
            sql = f"SELECT id, vector FROM items WHERE id IN ({placeholders(len(chunk))})"
            found.extend(self.conn.execute(sql, tuple(chunk)))
        found.sort()
        blob = b"".join(row[1] for row in found)
        vectors = np.frombuffer(blob, dtype=VECTOR_DTYPE).astype(np.float32).reshape(-1, dim)
        return np.fromiter((r[0] for r in found), dtype=np.int64, count=len(found)), vectors

    def live_vectors(self, dim: int, batch: int = 8192) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (ids int64 (b,), vectors float32 (b, dim)) of live items in id order.

        Batched so that rebuilding a large index never holds two copies of all vectors.
        """
        cursor = self.conn.execute("SELECT id, vector FROM items WHERE deleted = 0 ORDER BY id")
        while rows := cursor.fetchmany(batch):
            ids = np.fromiter((row[0] for row in rows), dtype=np.int64, count=len(rows))
            blob = b"".join(row[1] for row in rows)
            vectors = np.frombuffer(blob, dtype=VECTOR_DTYPE).astype(np.float32)
            yield ids, vectors.reshape(len(rows), dim)

    def labelled(self, dim: int) -> tuple[list[str], list[str], np.ndarray]:
        """(keys, labels, float32 (n, dim) vectors) of the live items that have a label,
        in id (insertion) order."""
        rows = self.conn.execute(
            "SELECT key, label, vector FROM items WHERE deleted = 0 AND label IS NOT NULL "
            "ORDER BY id"
        ).fetchall()
        blob = b"".join(row[2] for row in rows)
        vectors = np.frombuffer(blob, dtype=VECTOR_DTYPE).astype(np.float32)
        return [r[0] for r in rows], [r[1] for r in rows], vectors.reshape(len(rows), dim)

    def count_labelled(self) -> int:
        (n,) = self.conn.execute(
            "SELECT COUNT(*) FROM items WHERE deleted = 0 AND label IS NOT NULL"
        ).fetchone()
        return int(n)
