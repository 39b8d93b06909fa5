"""The store's reads across segments: search (fan out, filter, merge the per-segment
top k) and the labelled items an evaluation ranks.

Every segment answers its own top k for the queries (a compressed one re-scores its
codes' top oversample x k by the exact vectors first: _rescore.py); the lists are merged by
descending score, ties by ascending item id (insertion order), exactly as one index
holding every item would rank them. A filter (filters.py) is evaluated per segment
and searched as _filter_plans.py plans it (exactly over a small allowed subset, else by
a widened FAISS search with the filter as an ID selector).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _filter_plans as filtering
from ._memory_segment import hit
from ._rescore import rescored
from ._state import StoreState
from ._vectors import NO_HITS, NO_IDS, TopK, exact_top_k, merge_top_k
from .errors import StoreError
from .filters import Filter, parse_filter
from .request import DEFAULT_OVERSAMPLE, Query, Ranked
from .segment_contract import Segment
from .validation import as_matrix


def as_filter(raw: Filter | Mapping[str, Any] | None, label: str | None) -> Filter | None:
    """A search's filter and label argument as one parsed filter (None: no filter)."""
    parsed = None if raw is None else parse_filter(raw)
    return filtering.with_label(parsed, label)


def ranked_search(state: StoreState, query: Query) -> Ranked:
    """`IndexStore.search`, each hit with its item id (what orders equal scores); k,
    the label and the filter were checked when `query` was made (request.py). Every
    segment gives its top k + offset; the merged ranking is cut to the query's page."""
    k, exclude_keys, augmented = query.depth, query.where.exclude_keys, query.where.augmented
    if augmented and state.dba is None:
        how = "compute them with `vitrieval-index configure {} --dba`"
        raise StoreError(
            f"{state.directory} has no DBA vectors: {how.format(state.directory)}",
            public=f"this index has no DBA vectors: {how.format('INDEX')}",
        )
    q = as_matrix(query.vectors, state.dim, "queries")
    flt = query.where.allowed
    if augmented:
        return query.page(_augmented_search(state, q, int(k), flt, exclude_keys))
    oversample = query.oversample or state.oversample or DEFAULT_OVERSAMPLE
    found: list[tuple[Segment, TopK]] = []
    with state.lock:
        excluded = state.locate(list(exclude_keys)) if exclude_keys else []
        for segment in state.serving():
            if segment.live_count == 0:
                continue
            blocked_ids = _excluded_in(segment, excluded) if excluded else NO_IDS
            rescoring = query.rescore and not segment.vectors.scores_exact
            top = _segment_top_k(
                segment, q, int(k), flt, blocked_ids, oversample if rescoring else None
            )
            found.append((segment, top))
        merged = [merge_top_k([top[row] for _, top in found], int(k)) for row in range(len(q))]
        described = _described(found, merged)
    return query.page(_hits(merged, described))


def _excluded_in(segment: Segment, excluded: list[tuple[Segment, dict[str, int]]]) -> np.ndarray:
    """Sorted int64 ids of the left-out items `segment` holds (`state.locate`'s answer)."""
    ids = [i for holder, found in excluded if holder is segment for i in found.values()]
    return np.asarray(sorted(ids), np.int64) if ids else NO_IDS


def _hits(merged: TopK, described: dict[int, Any]) -> Ranked:
    """Per query, its (item id, Hit) pairs best first."""
    return [
        [(i, hit(described[i], score)) for i, score in zip(ids.tolist(), top.tolist(), strict=True)]
        for ids, top in merged
    ]


def _described(found: list[tuple[Segment, TopK]], merged: TopK) -> dict[int, Any]:
    """item id -> its described row, for every id in the `merged` answers: one read per
    segment that holds any of them (`found`: per segment, answers holding at least the
    merged ids it holds: its own, or the merged ones themselves)."""
    if not merged:
        return {}
    if len(found) == 1:  # every hit is its own
        return found[0][0].describe([i for ids, _ in merged for i in ids.tolist()])
    top = np.concatenate([ids for ids, _ in merged])
    described: dict[int, Any] = {}
    for segment, answers in found:
        own = np.concatenate([ids for ids, _ in answers]) if answers else NO_IDS
        held = own[np.isin(own, top)]
        if held.size:
            described.update(segment.describe(held.tolist()))
    return described


def _augmented_search(
    state: StoreState, q: np.ndarray, k: int, flt: Filter | None, exclude_keys: Any
) -> Ranked:
    """A search against the derived DBA index (_dba.py), which holds the committed
    items: refused when it is missing, of other settings, or the items changed since
    the commit, rather than answering from vectors that are not those items' DBA."""
    with state.lock:
        dba = state.dba_index
        where = state.directory
        if dba is None or dba.settings != state.dba:
            fix = (
                "save the index to compute them"
                if state.writable
                else f"convert it with `vitrieval-index upgrade {where}`, which computes them"
            )
            raise StoreError(
                f"{where} has no DBA vectors for its settings yet: {fix}",
                public="this index has no DBA vectors for its settings yet",
            )
        if state.items_uncommitted():
            raise StoreError(
                f"{where} has unsaved adds or removes its DBA vectors do not cover yet: "
                "save the index to compute them again",
                public="this index has unsaved adds or removes its DBA vectors do not "
                "cover yet: save it first",
            )
        segments = state.serving()
        damaged = state.damaged_segments()
        if damaged:
            # the DBA vectors hold those items, which no segment can describe now
            raise StoreError(
                f"{where}: segment {damaged[0][0]} is out of service ({damaged[0][1]}), so "
                "its items' DBA vectors are not searched: restore the index or search "
                "without augmented",
                public="part of this index is out of service: search without augmented",
            )
        excluded = state.locate(list(exclude_keys)) if exclude_keys else []
        blocked = np.asarray(sorted(i for _, ids in excluded for i in ids.values()), np.int64)
        allowed = None
        if flt is not None:
            # the filter over the whole index: each condition's ids from every segment
            found = filtering.evaluate(
                flt, lambda leaf: _union([s.filter_ids(leaf) for s in segments])
            )
            if found.negated:
                blocked = filtering.union(blocked, found.ids)
            else:
                allowed = found.ids
        merged = dba.top_k(q, k, allowed, blocked)
        described = _described([(s, merged) for s in segments], merged)
    return _hits(merged, described)


def _union(parts: list[np.ndarray]) -> np.ndarray:
    found = np.empty(0, np.int64)
    for part in parts:
        found = filtering.union(found, part)
    return found


def allowed_in(segment: Segment, flt: Filter) -> filtering.IdSet:
    """The items of `segment` (tombstoned ones aside) that `flt` allows."""
    allowed = filtering.evaluate(flt, segment.filter_ids)
    dead = segment.dead_ids()
    return allowed & filtering.IdSet(dead, True) if dead.size else allowed


def _segment_top_k(
    segment: Segment,
    q: np.ndarray,
    k: int,
    flt: Filter | None,
    blocked: np.ndarray,
    oversample: int | None = None,
) -> TopK:
    """One segment's top k for each query. `oversample`: its FAISS search takes the
    codes' top oversample x k and those are re-scored by the exact vectors
    (_rescore.py); a small filtered subset is searched exactly either way."""
    index = segment.searched()
    if segment.live_count < segment.ntotal:  # some of its items are tombstoned
        blocked = filtering.union(blocked, segment.dead_ids())

    def searched(allowed: np.ndarray | None, blocked: np.ndarray, widen: float = 1.0) -> TopK:
        if oversample is None:
            return index.top_k_arrays(q, k, allowed=allowed, blocked=blocked, widen=widen)
        wide = index.top_k_arrays(
            q, k * oversample, allowed=allowed, blocked=blocked, widen=widen, ordered=False
        )
        return rescored(segment, q, wide, k)

    if flt is None:
        return searched(None, blocked)
    allowed = allowed_in(segment, flt)
    live = segment.live_count
    if allowed.negated:
        # "all but a few": the plain search with those few blocked
        blocked = filtering.union(blocked, allowed.ids)
        matches = max(live - allowed.ids.size, 0)
        return searched(None, blocked, _widening(segment, q, k, allowed, matches))
    ids = filtering.difference(allowed.ids, blocked)
    if ids.size == 0:
        return [NO_HITS] * len(q)
    exact_max = filtering.EXACT_SEARCH_MAX
    if segment.vectors.exact:
        exact_max = min(exact_max, filtering.EXACT_SEARCH_MAX_FLAT)
    if ids.size <= exact_max:  # exact scores already: nothing to re-score
        found, vectors = segment.exact_vectors(ids)
        return exact_top_k(q, found, vectors, k)
    widen = _widening(segment, q, k, filtering.IdSet(ids, False), ids.size)
    return searched(ids, blocked, widen)


def _widening(
    segment: Segment, q: np.ndarray, k: int, allowed: filtering.IdSet, matches: int
) -> float:
    """How much wider a filtered ANN search looks: 1 / the filter's share of the
    segment or, when larger, how much deeper than k the queries' k-th allowed
    unfiltered neighbour lies (a filter that follows the vectors allows few items near
    a query, however many elsewhere: `filtering.neighbourhood_widening`)."""
    widen = filtering.widening(matches, segment.live_count)
    if segment.vectors.exact or segment.live_count <= filtering.NEIGHBOURHOOD:
        return widen  # an exhaustive search: widening changes nothing
    settings = segment.vectors.search_settings()
    if "nlist" in settings and settings["nprobe"] * widen >= settings["nlist"]:
        return widen  # every list is probed already: no neighbourhood search needed
    _, near = segment.vectors.raw_search(q, filtering.NEIGHBOURHOOD, None)
    return max(widen, filtering.neighbourhood_widening(near, allowed, k))


def labelled_ids_allowed(segment: Segment, flt: Filter | None, ids: np.ndarray) -> np.ndarray:
    """A mask over a segment's labelled item `ids`: which ones `flt` allows."""
    if flt is None:
        return np.ones(ids.shape, dtype=bool)
    allowed = allowed_in(segment, flt)
    inside = filtering.contains(allowed.ids, ids)
    return ~inside if allowed.negated else inside


def labelled_items(
    state: StoreState, limit: int | None, filter: Filter | Mapping[str, Any] | None
) -> tuple[list[str], list[str], np.ndarray]:
    """`IndexStore.labelled_items`: the labelled items a filter allows, in id order."""
    flt = as_filter(filter, None)
    with state.lock:
        segments = state.serving()
        if flt is None:
            n = sum(s.count_labelled() for s in segments)
        else:
            n = sum(int(labelled_ids_allowed(s, flt, s.labelled_ids()).sum()) for s in segments)
        if limit is not None and n > limit:
            raise StoreError(f"the index holds {n} labelled items, more than the {limit} allowed")
        parts = [s.labelled(state.dim) for s in segments]
        if flt is not None:
            parts = [
                _masked(p, labelled_ids_allowed(s, flt, p[0]))
                for s, p in zip(segments, parts, strict=True)
            ]
    ids = np.concatenate([p[0] for p in parts])
    order = np.argsort(ids, kind="stable")
    keys = [k for p in parts for k in p[1]]
    labels = [label for p in parts for label in p[2]]
    vectors = np.concatenate([p[3] for p in parts]).reshape(-1, state.dim)
    return [keys[i] for i in order], [labels[i] for i in order], vectors[order]


def _masked(part: tuple, mask: np.ndarray) -> tuple:
    """One segment's labelled (ids, keys, labels, vectors), the rows of `mask` only."""
    ids, keys, labels, vectors = part
    chosen = np.flatnonzero(mask)
    return ids[chosen], [keys[i] for i in chosen], [labels[i] for i in chosen], vectors[chosen]
