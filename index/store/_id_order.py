"""Rows in id order: what a sealed segment's rows must be (write_segment checks it),
and the merge of several segments' live rows that keeps it.

A sealed segment's rows are its items in ascending id order, so an item's row is found
from its id alone (its id less the first, when the ids run unbroken). A merge copies
the live rows of several segments into one; their id ranges can interleave (a merge may
join segments that are not neighbours, leaving a segment whose ids straddle another's),
so their rows are merged by id, not written one segment after another.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from ._memory_segment import SegmentRow
from .errors import StoreError

Batches = Iterable[tuple[list[SegmentRow], np.ndarray]]
"""(rows, float32 (b, dim) vectors) batches, each row's first field its item id."""

MERGE_BATCH = 8192
"""Rows per batch a k-way merge hands on."""


def merged_by_id(streams: Sequence[Batches], bounds: Sequence[tuple[int, int] | None]) -> Batches:
    """The rows of `streams` (each in ascending id order, over ids no other holds) as
    one stream in ascending id order. `bounds`: each stream's (smallest, largest) id,
    None when it is empty. Streams whose ranges do not overlap are chained, in order
    of their ranges (no row is touched); otherwise their rows are merged one by one."""
    spans = sorted((b, i) for i, b in enumerate(bounds) if b is not None)
    ordered = [streams[i] for _, i in spans]
    if all(a[1] < b[0] for (a, _), (b, _) in itertools.pairwise(spans)):
        return itertools.chain.from_iterable(ordered)
    return _rebatched(heapq.merge(*(_rows(s) for s in ordered), key=lambda pair: pair[0][0]))


def _rows(batches: Batches) -> Iterator[tuple[SegmentRow, np.ndarray]]:
    for rows, vectors in batches:
        yield from zip(rows, vectors, strict=True)


def _rebatched(
    pairs: Iterator[tuple[SegmentRow, np.ndarray]],
) -> Iterator[tuple[list[SegmentRow], np.ndarray]]:
    while chunk := list(itertools.islice(pairs, MERGE_BATCH)):
        yield [row for row, _ in chunk], np.stack([vector for _, vector in chunk])


def check_ascending(ids: np.ndarray, after: int | None) -> None:
    """StoreError unless int64 `ids` ascend strictly, from above `after` (the last id
    of the rows before them; None: none)."""
    if ids.size == 0:
        return
    if (after is not None and ids[0] <= after) or not bool(np.all(ids[1:] > ids[:-1])):
        raise StoreError("a segment's rows must be written in ascending id order")
