"""Numeric fields of a sealed segment held as columns, for range filters that vary.

A catalogue's price slider sends a new range with every query: the field index
(fields.py) answers each with an index range scan whose cost grows with the items it
allows (0.3-0.5 µs an item: 33-44 ms for 100,000 on the machines measured), and the
leaf cache rarely meets the same range twice. A column, the field's value for every
item that has one (ids sorted, float64 values aligned), answers any range with one
vectorised comparison (about 5 ns an item) and gives the ids already sorted.

A path gets its column at its `COLUMN_AFTER_RANGES`-th distinct range in a segment
(one range, however often it repeats, stays with the field index and the leaf
cache), when it is in the segment's field index and holds at most one number per
item; otherwise (a list of numbers, such as sizes) it stays with the field index.
The column holds float64 values, so it answers only what float64 answers exactly,
as `filters.Range.holds` compares: a path holding an integer beyond 2**53 in
magnitude (an int64 id, a nanosecond timestamp) stays with the field index, which
compares integers exactly, and so does a range whose integer bound float64 cannot
hold; every other value and bound is a float64 exactly, and so is the comparison.

A segment keeps its columns for its life (its items never change; a merge makes a new
segment with columns of its own), within `COLUMN_BUDGET_ROWS` rows: a path whose
column does not fit in what is left (its read stops one row past the room) stays with
the field index for good, logged once. Evicting a column for another would re-read
both, each a full pass over the path's index rows, whenever queries alternate between
them; the first paths to vary keep theirs. A column is read outside the lock, so
searches on other paths go on meanwhile, and searches on the path being read use the
field index until it is there.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from dataclasses import dataclass

import numpy as np

from .fields import FieldSelection
from .filters import Range

logger = logging.getLogger(__name__)

COLUMN_AFTER_RANGES = 2
"""Distinct ranges on a path that read its column (the first one reads the index)."""
COLUMN_BUDGET_ROWS = 16 * 1024 * 1024
"""Rows of the columns a segment keeps (16 bytes each: 256 MB at most)."""
NUMBERS_OF_PATH = (
    "SELECT id, value FROM fields WHERE path = ? AND typeof(value) IN ('integer', 'real')"
)
"""The field index's numeric rows of one path (texts and booleans are not numbers)."""
EXACT_FLOAT_INTEGERS = 2**53
"""Integers of at most this magnitude are float64 values exactly."""
LARGE_INTEGERS_OF_PATH = (
    "SELECT 1 FROM fields WHERE path = ? AND typeof(value) = 'integer' "
    "AND (value > ? OR value < ?) LIMIT 1"
)


@dataclass(frozen=True)
class Column:
    """A numeric field: `ids` (sorted int64) of the items that have it, `values`
    (float64) aligned with them."""

    ids: np.ndarray
    values: np.ndarray

    def ids_in(self, leaf: Range) -> np.ndarray:
        """Sorted ids whose value lies within `leaf`'s bounds."""
        keep = np.ones(self.ids.size, dtype=bool)
        v = self.values
        for bound, within in (
            (leaf.gt, np.greater),
            (leaf.gte, np.greater_equal),
            (leaf.lt, np.less),
            (leaf.lte, np.less_equal),
        ):
            if bound is not None:
                keep &= within(v, bound)
        return self.ids[keep]


def read_column(db: sqlite3.Connection, path: str, max_rows: int) -> Column | None:
    """The numbers of `path` in the field index as a Column; None when an item has
    several (a list field), there are more than `max_rows` (the read stops there) or
    an integer float64 cannot hold. Rows stream from the cursor into the arrays,
    without a Python list of them all."""
    limit = EXACT_FLOAT_INTEGERS
    if db.execute(LARGE_INTEGERS_OF_PATH, (path, limit, -limit)).fetchone():
        return None
    rows = db.execute(f"{NUMBERS_OF_PATH} LIMIT ?", (path, max_rows + 1))
    pairs = np.fromiter(rows, dtype=[("id", np.int64), ("value", np.float64)])
    if pairs.size > max_rows:
        return None
    order = np.argsort(pairs["id"], kind="stable")
    ids, values = pairs["id"][order], pairs["value"][order]
    if ids.size > 1 and bool((ids[1:] == ids[:-1]).any()):
        return None
    return Column(ids, values)


class RangeColumns:
    """The columns of one sealed segment's item table (see the module docstring)."""

    def __init__(
        self,
        db: sqlite3.Connection,
        selection: FieldSelection,
        budget_rows: int = COLUMN_BUDGET_ROWS,
        name: str = "segment",
    ) -> None:
        self._db = db
        self._name = name  # for the log
        self._selection = selection
        self._budget = budget_rows
        self._ranges: dict[str, set[Range]] = {}  # path -> distinct ranges before its column
        self._columns: dict[str, Column] = {}
        self._index_only: set[str] = set()  # list fields and columns without room
        self._reading: set[str] = set()
        self._rows = 0
        self._lock = threading.Lock()  # searches of one segment run in several threads

    def ids_in(self, leaf: Range) -> np.ndarray | None:
        """Sorted ids of the items in `leaf`'s range from the path's column, or None:
        ask the field index (no column for this path, or not yet)."""
        path = leaf.field.name
        if leaf.field.label or not self._selection.covers(path):
            return None
        if not all(b is None or float(b) == b for b in leaf.bounds()):
            return None  # an integer bound float64 rounds: the field index is exact
        column = self._column(path, leaf)
        return None if column is None else column.ids_in(leaf)

    def _column(self, path: str, leaf: Range) -> Column | None:
        with self._lock:
            column = self._columns.get(path)
            if column is not None or path in self._index_only or path in self._reading:
                return column
            seen = self._ranges.setdefault(path, set())
            seen.add(leaf)
            if len(seen) < COLUMN_AFTER_RANGES:
                return None
            del self._ranges[path]
            self._reading.add(path)
            room = self._budget - self._rows
        try:
            column = read_column(self._db, path, room)
        except BaseException:
            with self._lock:
                self._reading.discard(path)
            raise
        with self._lock:  # one block: no search sees the path neither read nor kept
            self._reading.discard(path)
            if column is None or self._rows + column.ids.size > self._budget:
                self._index_only.add(path)
                logger.info(
                    "%s: ranges on %r stay with the field index (a list field, an integer beyond "
                    "2**53, or no room "
                    "left in the segment's %d column rows)",
                    self._name,
                    path,
                    self._budget,
                )
                return None
            self._columns[path] = column
            self._rows += column.ids.size
            return column
