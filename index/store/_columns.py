"""A sealed segment's columns: its indexed paths' values, one array per path, written
with the segment and memory-mapped like its vectors.

The field index (_field_index.py) answers any condition, with an index range scan whose
cost grows with the items it allows (0.3-0.5 µs an item). A column answers the
conditions it covers with one vectorised comparison over the path's items (about
5 ns an item) and gives the ids already sorted. Columns are built when a segment is
written (sealed or merged), from the field index just written, so they hold exactly
what it holds; a segment's items never change, and neither do its columns.

Two kinds, each for a path the segment's field index covers:

- number: the path's numbers (not booleans), when every item holds at most one and
  every integer lies within ±2**53 (`EXACT_FLOAT_INTEGERS`). The values are float64,
  each exactly the number stored, so a range whose bounds float64 holds exactly is
  compared exactly, as `filters.Range.holds` compares; a path with a larger integer
  (an int64 id, a nanosecond timestamp) has no number column, and a bound float64
  would round goes to the field index, which compares integers exactly.
- text: the path's strings and booleans, dictionary-encoded (int32 codes into a
  list of the distinct values), when every item holds at most one of them. It
  answers a match on strings and booleans only (a match on a number goes to the
  field index); `true` and `"true"` are different entries, as the filter language
  has them.

The file, `seg.<n>.columns` (index format 3), all little-endian::

    b"VTRCOLS1"  uint64 header length H  header (H bytes of JSON, space-padded so
    that the arrays start at a multiple of 8)  arrays

with the header `{"columns": [{"path": p, "kind": "number", "rows": r, "ids": o,
"values": o}, {"path": p, "kind": "text", "rows": r, "ids": o, "codes": o,
"dictionary": [...]}, ...]}`: per column, int64 ids (sorted, unique) of the r items
holding a value, and aligned with them float64 values or int32 codes; o is an
array's byte offset in the file. A segment with no such path still has the file
(an empty list). Its sha256 and size are in the manifest like every segment file.
"""

from __future__ import annotations

import json
import sqlite3
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import StoreError
from .filters import Match, Range, typed

MAGIC = b"VTRCOLS1"
EXACT_FLOAT_INTEGERS = 2**53
"""Integers of at most this magnitude are float64 values exactly."""
_PATHS = "SELECT DISTINCT path FROM fields"
_NUMBERS = "SELECT id, value FROM fields WHERE path = ? AND typeof(value) IN ('integer', 'real')"
_TEXTS = "SELECT id, value FROM fields WHERE path = ? AND typeof(value) IN ('text', 'blob')"
_LARGE_INTEGERS = (
    "SELECT 1 FROM fields WHERE path = ? AND typeof(value) = 'integer' "
    "AND (value > ? OR value < ?) LIMIT 1"
)
_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class NumberColumn:
    """A path's numbers: `ids` (sorted int64, (r,)) of the items holding one, `values`
    (float64, (r,)) aligned with them."""

    ids: np.ndarray
    values: np.ndarray

    def ids_in(self, leaf: Range) -> np.ndarray | None:
        """Sorted ids whose value lies within `leaf`'s bounds; None when a bound is an
        integer float64 would round (the field index compares it exactly)."""
        if not all(b is None or float(b) == b for b in leaf.bounds()):
            return None
        keep = np.ones(self.ids.size, dtype=bool)
        for bound, within in (
            (leaf.gt, np.greater),
            (leaf.gte, np.greater_equal),
            (leaf.lt, np.less),
            (leaf.lte, np.less_equal),
        ):
            if bound is not None:
                keep &= within(self.values, bound)
        return self.ids[keep]


@dataclass(frozen=True)
class TextColumn:
    """A path's strings and booleans: `ids` (sorted int64, (r,)), `codes` (int32, (r,))
    aligned with them, into `dictionary` (the distinct values, keyed by `typed` value:
    `True` and `1` are different keys)."""

    ids: np.ndarray
    codes: np.ndarray
    dictionary: dict[tuple[str, Any], int]

    def ids_in(self, leaf: Match) -> np.ndarray | None:
        """Sorted ids holding one of `leaf`'s values; None when it matches a number."""
        if any(not isinstance(v, str | bool) for v in leaf.values):
            return None
        wanted = [self.dictionary[typed(v)] for v in leaf.values if typed(v) in self.dictionary]
        if not wanted:
            return _EMPTY
        if len(wanted) == 1:
            return self.ids[self.codes == wanted[0]]
        return self.ids[np.isin(self.codes, np.asarray(wanted, dtype=np.int32))]


@dataclass(frozen=True)
class SegmentColumns:
    """The columns of one sealed segment, by path (none for a format-2 segment)."""

    numbers: dict[str, NumberColumn]
    texts: dict[str, TextColumn]

    def ids_in(self, leaf: Match | Range) -> np.ndarray | None:
        """Sorted ids where `leaf` holds, from the path's column; None when no column
        answers it (see the module docstring)."""
        if leaf.field.label:
            return None
        if isinstance(leaf, Range):
            number = self.numbers.get(leaf.field.name)
            return None if number is None else number.ids_in(leaf)
        text = self.texts.get(leaf.field.name)
        return None if text is None else text.ids_in(leaf)


NO_COLUMNS = SegmentColumns({}, {})
"""The columns of a segment written before format 3."""


# -- writing --------------------------------------------------------------------------


def _by_id(ids: np.ndarray, *aligned: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """`ids` sorted and `aligned` in the same order; None when an id repeats."""
    order = np.argsort(ids, kind="stable")
    ids = ids[order]
    if ids.size > 1 and bool((ids[1:] == ids[:-1]).any()):
        return None
    return (ids, *(a[order] for a in aligned))


def _number_column(db: sqlite3.Connection, path: str) -> tuple[np.ndarray, np.ndarray] | None:
    limit = EXACT_FLOAT_INTEGERS
    if db.execute(_LARGE_INTEGERS, (path, limit, -limit)).fetchone():
        return None
    pairs = np.fromiter(db.execute(_NUMBERS, (path,)), dtype=[("id", "<i8"), ("v", "<f8")])
    if pairs.size == 0:
        return None
    found = _by_id(pairs["id"], pairs["v"])
    return None if found is None else (found[0], found[1])


def _text_column(
    db: sqlite3.Connection, path: str
) -> tuple[np.ndarray, np.ndarray, list[str | bool]] | None:
    ids, values = [], []
    for item_id, value in db.execute(_TEXTS, (path,)):
        ids.append(item_id)
        values.append(value if isinstance(value, str) else value == b"\x01")
    if not ids:
        return None
    dictionary: dict[tuple[str, Any], int] = {}
    codes = np.fromiter(
        (dictionary.setdefault(typed(v), len(dictionary)) for v in values), dtype="<i4"
    )
    found = _by_id(np.asarray(ids, dtype="<i8"), codes)
    if found is None:
        return None
    return found[0], found[1], [value for _, value in dictionary]


def write_columns(db: sqlite3.Connection, target: Path) -> None:
    """Write the columns file of a segment (see the module docstring) to `target`, from
    the field index in `db` (a segment's item table, written or being written)."""
    arrays: list[np.ndarray] = []
    specs: list[dict[str, Any]] = []
    for (path,) in db.execute(_PATHS).fetchall():
        number = _number_column(db, path)
        if number is not None:
            specs.append({"path": path, "kind": "number", "rows": int(number[0].size)})
            arrays.extend(number)
        text = _text_column(db, path)
        if text is not None:
            specs.append(
                {"path": path, "kind": "text", "rows": int(text[0].size), "dictionary": text[2]}
            )
            arrays.extend(text[:2])
    # the header's offsets depend on its length: give it room, grow the room if short
    room = 0
    while True:
        offset = _aligned(len(MAGIC) + 8 + room)
        at = iter(arrays)
        for spec in specs:
            for name in ("ids", "values") if spec["kind"] == "number" else ("ids", "codes"):
                spec[name] = offset
                offset = _aligned(offset + next(at).nbytes)
        header = json.dumps({"columns": specs}).encode()
        if len(header) <= room:
            break
        room = len(header) + 64
    header = header.ljust(_aligned(len(MAGIC) + 8 + room) - len(MAGIC) - 8)
    with open(target, "wb") as fh:
        fh.write(MAGIC + struct.pack("<Q", len(header)) + header)
        for array in arrays:
            fh.write(np.ascontiguousarray(array).tobytes())
            fh.write(b"\0" * (-fh.tell() % 8))


def _aligned(offset: int) -> int:
    return offset + (-offset % 8)


# -- reading --------------------------------------------------------------------------


def read_columns(path: Path) -> SegmentColumns:
    """The columns file at `path`, memory-mapped (StoreError when it is malformed; its
    checksum is checked by the segment's verification, not here)."""
    try:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        if bytes(raw[: len(MAGIC)]) != MAGIC:
            raise ValueError("not a columns file (damaged header)")
        (length,) = struct.unpack("<Q", bytes(raw[len(MAGIC) : len(MAGIC) + 8]))
        start = len(MAGIC) + 8
        specs = json.loads(bytes(raw[start : start + length]))["columns"]
        numbers: dict[str, NumberColumn] = {}
        texts: dict[str, TextColumn] = {}
        for spec in specs:
            rows, name = int(spec["rows"]), str(spec["path"])
            ids = _array(raw, int(spec["ids"]), rows, "<i8")
            if spec["kind"] == "number":
                numbers[name] = NumberColumn(ids, _array(raw, int(spec["values"]), rows, "<f8"))
            elif spec["kind"] == "text":
                dictionary = {typed(v): code for code, v in enumerate(spec["dictionary"])}
                codes = _array(raw, int(spec["codes"]), rows, "<i4")
                texts[name] = TextColumn(ids, codes, dictionary)
            else:
                raise ValueError(f"unknown column kind {spec['kind']!r}")
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise StoreError(f"{path} is not a readable columns file: {exc}") from None
    return SegmentColumns(numbers, texts)


def _array(raw: np.ndarray, offset: int, rows: int, dtype: str) -> np.ndarray:
    """`rows` values of `dtype` at byte `offset` of the mapped file (a view, (rows,))."""
    end = offset + rows * np.dtype(dtype).itemsize
    if offset < 0 or offset % 8 or end > raw.size:
        raise ValueError(f"an array at bytes {offset}-{end} lies outside the file")
    # a plain ndarray over the mapping: numpy's memmap subclass would follow every
    # array computed from it (answers, their intersections) with overhead of its own
    return np.asarray(raw[offset:end].view(dtype))
