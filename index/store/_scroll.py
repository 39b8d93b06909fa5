"""`IndexStore.scroll`: a whole filtered selection listed in key order, page by page.

A search answers the items nearest a query, at most `MAX_DEPTH` deep; an export or an
admin tool wants every item a filter allows, each once. Each segment lists its keys in
order from its own key index (`Segment.keys_after`), skipping its tombstoned items and
those the filter does not allow; the segments' lists are merged by key (a live key is
in one segment only) and cut at `limit`. The page's last key is the cursor of the next
call (`after`): items added or removed between calls are seen or not by where their
key falls, and no item is listed twice.
"""

from __future__ import annotations

import heapq
import json
from typing import Any

import numpy as np

from . import _filter_plans as filtering
from ._items import ListedItem, ScrollPage
from ._state import StoreState
from .errors import StoreError
from .filters import Filter
from .request import MAX_SCROLL_LIMIT
from .segment_contract import Segment

_CHUNK = 1024  # keys read from a segment's key index at a time


def checked_limit(limit: Any) -> int:
    """`limit` as a page size: an integer from 1 to MAX_SCROLL_LIMIT."""
    if (
        not isinstance(limit, int | np.integer)
        or isinstance(limit, bool)
        or not (1 <= limit <= MAX_SCROLL_LIMIT)
    ):
        raise StoreError(f"limit must be an integer from 1 to {MAX_SCROLL_LIMIT}, got {limit!r}")
    return int(limit)


def scroll(state: StoreState, flt: Filter | None, limit: int, after: str | None) -> ScrollPage:
    """Up to `limit` live items that `flt` allows whose keys sort after `after`, in
    ascending key order, and the cursor for the rest (module docstring)."""
    limit = checked_limit(limit)
    if after is not None and not isinstance(after, str):
        raise StoreError(f"after must be a key (a string) or None, got {after!r}")
    with state.lock:
        segments = [s for s in state.serving() if s.live_count]
        # one more than the page: whether anything follows it
        listed = [
            [(key, i, n) for key, i in _listed(s, flt, limit + 1, after)]
            for n, s in enumerate(segments)
        ]
        merged = list(heapq.merge(*listed, key=lambda entry: entry[0]))[: limit + 1]
        page = merged[:limit]
        described: dict[tuple[int, int], Any] = {}
        for n, segment in enumerate(segments):
            ids = [i for _, i, owner in page if owner == n]
            if ids:
                described.update({(n, i): row for i, row in segment.describe(ids).items()})
    items = []
    for _, i, owner in page:
        key, label, path, metadata = described[(owner, i)]
        items.append(ListedItem(key, label, path, json.loads(metadata)))
    more = len(merged) > limit
    return ScrollPage(items, page[-1][0] if more else None)


def _listed(
    segment: Segment, flt: Filter | None, limit: int, after: str | None
) -> list[tuple[str, int]]:
    """(key, id) of the segment's first `limit` live items `flt` allows with keys after
    `after`, in key order."""
    allowed = filtering.evaluate(flt, segment.filter_ids) if flt is not None else None
    dead = segment.tombstones
    found: list[tuple[str, int]] = []
    cursor = after
    while len(found) < limit:
        rows = segment.keys_after(cursor, _CHUNK)
        if not rows:
            break
        ids = np.fromiter((i for _, i in rows), dtype=np.int64, count=len(rows))
        keep = np.ones(len(rows), dtype=bool)
        if allowed is not None:
            inside = filtering.contains(allowed.ids, ids)
            keep = ~inside if allowed.negated else inside
        kept = zip(rows, keep.tolist(), strict=True)
        found += [row for row, allowed_row in kept if allowed_row and row[1] not in dead]
        if len(rows) < _CHUNK:
            break
        cursor = rows[-1][0]
    return found[:limit]
