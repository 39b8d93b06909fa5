"""Filtered search: which items of a segment a filter allows, and how to search them.

A filter (filters.py) is evaluated per segment, each condition from one of three
sources that `leaf_ids` chooses (a sealed segment's columns, the field index, the
metadata scan), into an `IdSet`: sorted item ids, possibly negated ("every item
but these"), so that both a rare value (`match: "purple"`) and the absence of one
(`must_not purple`) stay small sets. `must` intersects, `should` unites, `must_not` negates.

Then, per segment, the search is planned from the number of items the filter
allows (counted exactly from the index, which is cheap beside the search):

- few (at most `EXACT_SEARCH_MAX` items): score exactly those items' stored vectors
  (brute force over the subset; exact whatever the factory);
- many: the segment's FAISS search with the filter as an ID selector, widened by the
  inverse of the selectivity (IVF probes nprobe / s lists, capped at nlist; HNSW
  explores efSearch / s), so that about as many allowed candidates are met as an
  unfiltered search meets; or wider when the queries' allowed neighbours lie deeper
  than that (`neighbourhood_widening`: a filter that follows the vectors). At s = 1,
  with the allowed items spread evenly, this is the plain search.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import _field_index as fx
from ._columns import SegmentColumns
from .filters import FieldRef, Filter, Match, Range

EXACT_SEARCH_MAX = 20_000
"""Filters allowing at most this many items of a segment are searched exactly..."""
EXACT_SEARCH_MAX_FLAT = 1_000
"""...or this many in a "Flat" segment, whose ID-selector search is exact already and
faster than gathering more vectors (bench/filtered_search.py)."""
_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class IdSet:
    """`ids` (sorted, unique int64) or, negated, every item except `ids`."""

    ids: np.ndarray
    negated: bool

    def __and__(self, other: IdSet) -> IdSet:
        a, b = self.ids, other.ids
        if not self.negated and not other.negated:
            return IdSet(np.intersect1d(a, b, assume_unique=True), False)
        if self.negated and other.negated:
            return IdSet(union(a, b), True)
        kept, dropped = (a, b) if not self.negated else (b, a)
        return IdSet(difference(kept, dropped), False)

    def __or__(self, other: IdSet) -> IdSet:
        return ~(~self & ~other)

    def __invert__(self) -> IdSet:
        return IdSet(self.ids, not self.negated)


def contains(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Boolean mask over `values`: which are in sorted `ids` (binary search: numpy's
    isin hashes, which costs far more on the large sorted arrays filters make)."""
    if ids.size == 0:
        return np.zeros(values.shape, dtype=bool)
    at = np.minimum(np.searchsorted(ids, values), ids.size - 1)
    return ids[at] == values


def positions(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """int64 array shaped as `values`: each value's index in sorted `ids`, -1 where it
    is not there."""
    if ids.size == 0:
        return np.full(values.shape, -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(ids, values), ids.size - 1)
    return np.where(ids[at] == values, at, -1)


def union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted unique union of two sorted unique id arrays."""
    if a.size == 0 or b.size == 0:
        return b if a.size == 0 else a
    merged = np.concatenate((a, b))
    merged.sort(kind="stable")  # two sorted runs: a merge
    keep = np.empty(merged.size, dtype=bool)
    keep[0] = True
    np.not_equal(merged[1:], merged[:-1], out=keep[1:])
    return merged[keep]


def difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The ids of sorted `a` that are not in sorted `b`."""
    if a.size == 0 or b.size == 0:
        return a
    return a[~contains(b, a)]


EVERYTHING = IdSet(_EMPTY, True)
NOTHING = IdSet(_EMPTY, False)


def leaf_ids(
    leaf: Match | Range,
    columns: SegmentColumns,
    db: sqlite3.Connection,
    selection: fx.FieldSelection,
    where: str,
) -> np.ndarray:
    """Sorted unique int64 ids of a segment's items (tombstoned ones too) where `leaf`
    holds, from the first of three sources that answers it:

    1. the segment's columns (_columns.py: sealed segments of format 3): a range on a
       path with a number column whose bounds float64 holds exactly; a match of
       strings or booleans on a path with a text column;
    2. the SQLite field index (_field_index.py), for the label and every other condition on
       a path the segment indexes: paths with several values an item, integers beyond
       2**53, matches on numbers, the growing segment, segments of format 2;
    3. the metadata scan, for a path the segment does not index (logged once).

    `db`, `selection`: the segment's item table and the paths it indexes; `where`:
    what the scan's log line names. Sealed segments remember the answers
    (fields.LeafCache), whatever the source.
    """
    found = columns.ids_in(leaf)
    if found is not None:
        return found
    if leaf.field.label or selection.covers(leaf.field.name):
        return fx.index_ids(db, leaf)
    return fx.scan_ids(db, leaf, where)


def evaluate(flt: Filter, leaf_ids: Callable[[Match | Range], np.ndarray]) -> IdSet:
    """The items `flt` allows, from `leaf_ids` (sorted ids where one condition holds)."""
    result = EVERYTHING
    for condition in flt.must:
        result &= _condition(condition, leaf_ids)
    if flt.should:
        either = NOTHING
        for condition in flt.should:
            either |= _condition(condition, leaf_ids)
        result &= either
    for condition in flt.must_not:
        result &= ~_condition(condition, leaf_ids)
    return result


def _condition(condition: Filter | Match | Range, leaf_ids: Callable) -> IdSet:
    if isinstance(condition, Filter):
        return evaluate(condition, leaf_ids)
    return IdSet(leaf_ids(condition), False)


def with_label(flt: Filter | None, label: str | None) -> Filter | None:
    """`flt` and "the item's label is `label`" (the search's older label argument)."""
    if label is None:
        return None if flt is None or flt.empty else flt
    by_label = Match(FieldRef(label=True, path=()), (str(label),))
    return Filter(must=(by_label,) if flt is None or flt.empty else (by_label, flt))


NEIGHBOURHOOD = 100
"""Unfiltered neighbours per query whose allowed ones set a filtered search's width."""


def neighbourhood_widening(neighbours: np.ndarray, allowed: IdSet, k: int) -> float:
    """How much deeper than its top k a filtered query's top k lie in its unfiltered
    neighbours (int64 (q, n) ids, -1 for none), the largest over the queries.

    A query whose k-th allowed neighbour is its p-th neighbour needs an ANN search
    about p / k times as wide to meet it (p / k = 1 / s for a filter independent of
    the vectors, with share s). With c < k allowed among the n, the depth is
    extrapolated as n k / c, so the widening is n / c (n when none is allowed).
    A filter that excludes a query's whole cluster passes few of its nearest
    neighbours while passing most of the segment: the global share says 1, this says
    how far past the cluster the hits lie.
    """
    if neighbours.size == 0:
        return 1.0
    valid = neighbours >= 0
    inside = contains(allowed.ids, neighbours)
    passing = (~inside if allowed.negated else inside) & valid
    n = valid.sum(axis=1)
    count = passing.sum(axis=1)
    kth = np.argmax(np.cumsum(passing, axis=1) >= k, axis=1)  # meaningful where count >= k
    depth = np.where(count >= k, (kth + 1) / k, n / np.maximum(count, 1))
    depth = depth[n > 0]  # a query with no neighbours at all says nothing
    return max(1.0, float(depth.max())) if depth.size else 1.0


def widening(allowed: int, live: int) -> float:
    """How much wider than an unfiltered search a filtered ANN search looks: 1 / s."""
    return max(1.0, live / max(allowed, 1))
