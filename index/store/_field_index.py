"""The field index: the metadata values filters read, indexed in each segment's SQLite.

Every item table (a sealed segment's file, the growing segment's in-memory database)
has, beside `items`, a table `fields(path, value, id)` holding one row per scalar of
the item's metadata that the index's field selection covers, and `field_set(paths)`
recording that selection (JSON: null = every field, or a list of dot paths). A
metadata `{"colour": "red", "sizes": [38, 39], "shop": {"city": "Oslo"}}` gives the
rows (colour, 'red'), (sizes, 38), (sizes, 39), (shop.city, 'Oslo'). An index on
(path, value, id) answers a match or a range condition without reading any item's
JSON. Booleans are stored as one-byte blobs, so `true` never equals 1 and a range
(numbers only) never meets them: SQLite orders numbers < text < blobs. Integers are
stored as SQLite integers and compared exactly, with integer and float bounds alike
(SQLite compares an integer with a real by value, without rounding either).

A condition on a field the segment did not index (a selection that leaves it out,
or a segment written before the field index existed) is answered by reading the
segment's metadata column: correct, and logged once as slower. Which of these, or a
sealed segment's columns (_columns.py), answers a condition is decided in one place:
`filtering.leaf_ids`.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from .filters import FieldRef, Match, Range, field_values, is_scalar

logger = logging.getLogger(__name__)

FIELDS_SCHEMA = """
CREATE TABLE IF NOT EXISTS fields (path TEXT NOT NULL, value NOT NULL, id INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS field_set (paths TEXT);
"""
FIELDS_INDEX = "CREATE INDEX IF NOT EXISTS fields_path_value ON fields(path, value, id)"
ALL_FIELDS: frozenset[str] | None = None
"""The default selection: every scalar field of the metadata (at any depth)."""
_TRUE, _FALSE = b"\x01", b"\x00"
LEAF_CACHE_IDS = 16 * 1024 * 1024
"""Ids a sealed segment remembers for recent filter conditions (128 MB at most)."""


class FieldSelection:
    """Which metadata paths a segment indexes: every one (None) or those listed."""

    def __init__(self, paths: Iterable[str] | None) -> None:
        self.paths = None if paths is None else frozenset(paths)

    def covers(self, path: str) -> bool:
        return self.paths is None or path in self.paths

    def to_json(self) -> list[str] | None:
        return None if self.paths is None else sorted(self.paths)

    def paths_tuple(self) -> tuple[str, ...] | None:
        """The selection as the manifest records it."""
        return None if self.paths is None else tuple(sorted(self.paths))


NOTHING = FieldSelection(())
"""The selection of a table without a field index (written before it existed)."""


def check_field_paths(paths: Iterable[str] | None) -> list[str] | None:
    """The `filter_fields` option checked: None (every field) or non-empty dot paths."""
    from .errors import StoreError

    if paths is None:
        return None
    if isinstance(paths, str):
        raise StoreError("filter_fields must be a list of dot paths, not one string")
    checked = []
    for path in paths:
        if not isinstance(path, str) or not path or any(not p for p in path.split(".")):
            raise StoreError(f"filter_fields: {path!r} is not a dot path such as 'shop.city'")
        checked.append(path)
    return sorted(set(checked))


def flatten(metadata: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dot path, scalar) for every scalar of `metadata`, list elements one by one.

    Keys containing a dot are left out: the filter language cannot address them.
    Lists of objects are not descended (the language reads scalars and lists of them).
    """
    for key, value in metadata.items():
        if "." in key:
            continue
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten(value, f"{path}.")
        elif isinstance(value, list):
            for element in value:
                if is_scalar(element):
                    yield path, _encode(element)
        elif is_scalar(value):
            yield path, _encode(value)


def _encode(value: Any) -> Any:
    if isinstance(value, bool):
        return _TRUE if value else _FALSE
    return value


def field_rows(
    rows: Iterable[tuple[int, str]], selection: FieldSelection
) -> Iterator[tuple[str, Any, int]]:
    """(path, value, id) rows of the field index for (id, metadata JSON) items."""
    for item_id, metadata in rows:
        if metadata in ("{}", ""):
            continue
        for path, value in flatten(json.loads(metadata)):
            if selection.covers(path):
                yield path, value, item_id


def create_tables(db: sqlite3.Connection, selection: FieldSelection) -> None:
    db.executescript(FIELDS_SCHEMA)
    db.execute("DELETE FROM field_set")
    db.execute("INSERT INTO field_set VALUES (?)", (json.dumps(selection.to_json()),))


def insert_fields(
    db: sqlite3.Connection, rows: Iterable[tuple[int, str]], selection: FieldSelection
) -> None:
    """Index the (id, metadata JSON) items' fields."""
    db.executemany("INSERT INTO fields VALUES (?, ?, ?)", field_rows(rows, selection))


def read_selection(db: sqlite3.Connection) -> FieldSelection:
    """The selection a table was written with (NOTHING when it has no field index)."""
    try:
        row = db.execute("SELECT paths FROM field_set").fetchone()
    except sqlite3.OperationalError:  # no such table: written before field indexes
        return NOTHING
    return FieldSelection(None if row is None else json.loads(row[0]))


def index_ids(db: sqlite3.Connection, leaf: Match | Range) -> np.ndarray:
    """Sorted unique int64 ids of the items of `db` (live or not) where `leaf` holds,
    from the field index (the label from the item table's label index). The path
    must be one the table indexes (`FieldSelection.covers`)."""
    field = leaf.field
    if field.label:
        return _label_ids(db, leaf)
    if isinstance(leaf, Match):
        values = [_encode(v) for v in leaf.values]
        sql = f"SELECT id FROM fields WHERE path = ? AND value IN ({_marks(len(values))})"
        return _ids(db.execute(sql, (field.name, *values)))
    clauses, args = _range_sql(leaf)
    sql = f"SELECT id FROM fields WHERE path = ? AND {' AND '.join(clauses)}"
    return _ids(db.execute(sql, (field.name, *args)))


def _range_sql(leaf: Range) -> tuple[list[str], list[int | float]]:
    # numbers sort before text and blobs: `value < ''` keeps an open range on numbers
    clauses, args = ["typeof(value) IN ('integer', 'real')"], []
    for op, bound in ((">", leaf.gt), (">=", leaf.gte), ("<", leaf.lt), ("<=", leaf.lte)):
        if bound is not None:
            clauses.append(f"value {op} ?")
            args.append(bound)
    if leaf.lt is None and leaf.lte is None:
        clauses.append("value < ''")
    return clauses, args


def _label_ids(db: sqlite3.Connection, leaf: Match | Range) -> np.ndarray:
    if isinstance(leaf, Range):
        return np.empty(0, dtype=np.int64)  # labels are text: no number is in range
    labels = [v for v in leaf.values if isinstance(v, str)]
    if not labels:
        return np.empty(0, dtype=np.int64)
    sql = f"SELECT id FROM items WHERE label IN ({_marks(len(labels))})"
    return _ids(db.execute(sql, labels))


_warned: set[tuple[str, str]] = set()


def scan_ids(db: sqlite3.Connection, leaf: Match | Range, where: str) -> np.ndarray:
    """Sorted unique int64 ids of the items of `db` where `leaf` holds, by reading
    every item's metadata (a path the table does not index); `where`: what the log
    line, once per path, names (the segment)."""
    if (where, leaf.field.name) not in _warned:
        _warned.add((where, leaf.field.name))
        logger.warning(
            "%s has no field index for %r: filtering on it reads every item's metadata "
            "(index it with the index's filter_fields, or merge the segment)",
            where,
            leaf.field.name,
        )
    found = [
        item_id
        for item_id, label, metadata in db.execute("SELECT id, label, metadata FROM items")
        if leaf.holds(field_values(leaf.field, label, json.loads(metadata)))
    ]
    return _sorted_unique(np.asarray(found, dtype=np.int64))


class LeafCache:
    """The ids of recently used conditions, for a segment whose items never change
    (sealed): a catalogue's filters repeat (a category, a price band), and even a
    column's answer costs a pass over the path's items, far more than a look-up.
    Every answer is kept; least recently used first out, beyond `max_ids` ids in all
    (8 bytes each). A condition that comes once (a slider's range) may push out one
    that repeats: it is answered again from its source, a column for most paths."""

    def __init__(self, max_ids: int = LEAF_CACHE_IDS) -> None:
        self.max_ids = max_ids
        self._entries: dict[Match | Range, np.ndarray] = {}
        self._size = 0
        self._lock = threading.Lock()  # searches of one segment run in several threads

    def get(self, leaf: Match | Range) -> np.ndarray | None:
        with self._lock:
            found = self._entries.pop(leaf, None)
            if found is not None:
                self._entries[leaf] = found  # most recently used last
            return found

    def put(self, leaf: Match | Range, ids: np.ndarray) -> None:
        """Remember `leaf`'s ids (not when they alone exceed the budget)."""
        if ids.size > self.max_ids:
            return
        with self._lock:
            old = self._entries.pop(leaf, None)
            self._size += ids.size - (0 if old is None else old.size)
            self._entries[leaf] = ids
            while self._size > self.max_ids:
                dropped = self._entries.pop(next(iter(self._entries)))
                self._size -= dropped.size


def _ids(cursor: sqlite3.Cursor) -> np.ndarray:
    return _sorted_unique(np.fromiter((row[0] for row in cursor), dtype=np.int64))


def _sorted_unique(ids: np.ndarray) -> np.ndarray:
    """np.unique by sorting (numpy's unique hashes, slower on large id arrays); one
    value's rows arrive sorted already, which the sort finds at once."""
    if ids.size < 2:
        return ids
    ids.sort(kind="stable")
    keep = np.empty(ids.size, dtype=bool)
    keep[0] = True
    np.not_equal(ids[1:], ids[:-1], out=keep[1:])
    return ids[keep]


def _marks(n: int) -> str:
    return ",".join("?" * n)


__all__ = [
    "ALL_FIELDS",
    "NOTHING",
    "FieldRef",
    "FieldSelection",
    "check_field_paths",
    "create_tables",
    "field_rows",
    "index_ids",
    "insert_fields",
    "read_selection",
    "scan_ids",
]
