"""Which sealed segments to merge: a small tiered policy, in the manner of Lucene's.

Every save seals a new segment, so a store that is saved often (a server's
checkpoints, `vitrieval-index add`) accumulates small segments, and every search
fans out over all of them. A merge folds segments into one, dropping their
tombstones. The policy:

- a segment whose tombstones exceed `TOMBSTONE_FRACTION` of its rows is rewritten;
- beyond `MAX_SEGMENTS` segments, the smallest are merged, at least `MIN_MERGE` at a
  time, so that sizes grow geometrically (like a binary counter) and each vector is
  copied O(log n) times over the index's life;
- segments over `MAX_MERGED_ROWS` live rows are only rewritten for tombstones, never
  merged with others, so one merge never copies the whole catalogue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

TOMBSTONE_FRACTION = 0.2
"""A segment whose tombstones exceed this share of its rows is rewritten."""
MAX_SEGMENTS = 8
MIN_MERGE = 2
MAX_MERGED_ROWS = 5_000_000


class _Segment(Protocol):
    live_count: int

    @property
    def ntotal(self) -> int: ...

    @property
    def tombstones(self) -> set[int]: ...


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
    mergeable = [i for i, s in enumerate(segments) if s.live_count <= MAX_MERGED_ROWS]
    excess = len(segments) - MAX_SEGMENTS
    if excess <= 0 or len(mergeable) < MIN_MERGE:
        return []
    smallest = sorted(mergeable, key=lambda i: (segments[i].live_count, i))
    return sorted(smallest[: max(MIN_MERGE, excess + 1)])
