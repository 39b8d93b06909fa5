"""Which sealed segments to merge: a tiered policy, in the manner of Lucene's.

Every save seals a new segment, so a store that is saved often (a server's
checkpoints, `vitrieval-index add`) accumulates small segments, and every search
fans out over all of them. A merge folds segments into one, dropping their
tombstones. The policy:

- a segment whose tombstones exceed `TOMBSTONE_FRACTION` of its rows is rewritten;
- segments fall into tiers by size: tier t holds segments of `FLOOR_ROWS` x
  `MERGE_FACTOR`^t live rows or so (everything under `FLOOR_ROWS` is tier 0); when a
  tier holds `MERGE_FACTOR` segments, the smallest of them are merged into one of the
  next tier. Only segments of similar size are merged, so a vector is copied about
  once per tier over the index's life (log_MERGE_FACTOR of the index size over the
  floor), and a small new segment never drags a large one into a rewrite;
- segments over `MAX_MERGED_ROWS` live rows are only rewritten for tombstones, never
  merged with others, so one merge never copies the whole catalogue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

TOMBSTONE_FRACTION = 0.2
"""A segment whose tombstones exceed this share of its rows is rewritten."""
MERGE_FACTOR = 4
FLOOR_ROWS = 10_000
MAX_MERGED_ROWS = 5_000_000


class _Segment(Protocol):
    live_count: int

    @property
    def ntotal(self) -> int: ...

    @property
    def tombstones(self) -> set[int]: ...


def tier(live: int) -> int:
    """The size tier of a segment of `live` rows (0 below FLOOR_ROWS x MERGE_FACTOR)."""
    return int(math.log(max(live, FLOOR_ROWS) / FLOOR_ROWS, MERGE_FACTOR))


def pick_merge(
    segments: Sequence[_Segment],
    tombstone_fraction: float = TOMBSTONE_FRACTION,
    *,
    everything: bool = False,
) -> list[int]:
    """Positions in `segments` to merge into one new segment (empty: none is due)."""
    if everything:
        return list(range(len(segments))) if segments else []
    worn = [
        i
        for i, s in enumerate(segments)
        if s.ntotal and len(s.tombstones) > tombstone_fraction * s.ntotal
    ]
    if worn:
        return worn[:1]
    tiers: dict[int, list[int]] = {}
    for i, s in enumerate(segments):
        if s.live_count <= MAX_MERGED_ROWS:
            tiers.setdefault(tier(s.live_count), []).append(i)
    for level in sorted(tiers):
        members = tiers[level]
        if len(members) >= MERGE_FACTOR:
            smallest = sorted(members, key=lambda i: (segments[i].live_count, i))
            return sorted(smallest[:MERGE_FACTOR])
    return []
