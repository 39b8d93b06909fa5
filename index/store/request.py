"""One search of an index as one immutable value: `Query` (the vectors and k) with its
`Where` (which items it may find, and which of their vectors it ranks against).

Every index (`IndexStore`, `ShardedStore`, the Ray `RemoteIndex`; the contract is
index/contract.py) takes a search as a `Query`, so a search parameter is declared
and checked here once: k, the label, the parsed filter, the keys left out, the DBA
flag, how compressed segments re-score (`rescore`, `oversample`, _rescore.py), and
which part of the ranking comes back (`offset`, `score_threshold`). A
later parameter is a new field here, not a new argument in every
implementation. The filter is parsed when the `Where` is made (from decoded JSON, or
given parsed) and travels parsed: to the store, to every shard, and pickled as it is
to a shard replica on a Ray cluster (its frozen dataclasses keep `True`, `1`, `1.0`
and 64-bit integers apart exactly).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._filter_plans import with_label
from ._items import Hit
from .errors import StoreError
from .filters import Filter, parse_filter

DEFAULT_OVERSAMPLE = 32
"""Candidates a compressed segment re-scores per query, as a multiple of k, when the
index has no setting of its own (`vitrieval-index configure --oversample`, or `tune`).
From bench/compressed_search.py at 1M x 384 (docs/benchmarks.md): IVF4096,PQ48 at its
default nprobe gives recall@10 0.405 unre-scored, 0.771 at 4, 0.968 at 16 and 0.993
at 32, at a warm p50 within the run's noise of each other (the probed lists cost more
than re-scoring k x 32 vectors; the cost shows at 64); IVF4096,SQ8 reaches 1.0 from 2
on. 32 is the smallest value that takes PQ codes past 0.98."""
MAX_OVERSAMPLE = 64
"""The most a query may oversample: 64 x k candidates per segment; past that an IVF
search's own nprobe, not the candidate count, limits recall."""

MAX_DEPTH = 10_000
"""The deepest a search reads into the ranking: k + offset at most. Every segment (and
shard) returns its own top k + offset before they are merged, so the depth costs each
of them; past it, `scroll` lists a filtered selection in key order."""

MAX_SCROLL_LIMIT = 10_000
"""The most items one `scroll` call lists (its page is held in memory at once)."""
SCROLL_LIMIT = 100
"""The items a `scroll` call lists when it is not told how many."""

Ranked = list[list[tuple[int, Hit]]]
"""Per query, its hits best first, each with its item id (what orders equal scores)."""


@dataclass(frozen=True)
class Where:
    """Which items a query may find (a label, a metadata filter, keys left out), and
    which of their vectors it ranks against: `augmented`, the index's DBA vectors
    (index/store/_dba.py).

    `filter` may be given as decoded JSON (the language of filters.py): it is parsed
    here, once (FilterError names what is wrong), and kept as a `Filter`."""

    label: str | None = None
    exclude_keys: Sequence[str] = ()
    filter: Filter | Mapping[str, Any] | None = None
    augmented: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.exclude_keys, str):
            raise StoreError("exclude_keys must be a sequence of strings, not one string")
        object.__setattr__(self, "exclude_keys", tuple(self.exclude_keys))
        if self.filter is not None:
            object.__setattr__(self, "filter", parse_filter(self.filter))

    @property
    def allowed(self) -> Filter | None:
        """The filter and the label as one parsed filter (None: every item)."""
        return with_label(self.filter, self.label)  # type: ignore[arg-type]


@dataclass(frozen=True, eq=False)
class Query:
    """`vectors` float32 (q, d), each row searched for its top `k` among the items
    `where` allows. k is checked here (StoreError); the vectors' shape against the
    index's dimension by the index that runs it.

    `rescore`: whether a segment whose index scores from compressed codes (PQ, SQ, ...)
    ranks its candidates again by their exact stored vectors (_rescore.py); Flat,
    IVF-Flat and HNSW-Flat segments score exactly and ignore it. `oversample`: how many
    candidates it takes from its codes, as a multiple of k (1 to MAX_OVERSAMPLE; None:
    the index's own setting, else DEFAULT_OVERSAMPLE).

    `offset`: the hits before it are skipped, so the answer is ranks offset + 1 to
    offset + k of the whole ranking (pages of k; k + offset at most MAX_DEPTH).
    `score_threshold`: hits scoring below it are left out (an answer may then hold
    fewer than k). An index runs a paged query as `unpaged()` and cuts the merged
    ranking with `page`."""

    vectors: np.ndarray
    k: int
    where: Where = Where()
    rescore: bool = True
    oversample: int | None = None
    offset: int = 0
    score_threshold: float | None = None

    def __post_init__(self) -> None:
        k = self.k
        if not isinstance(k, int | np.integer) or isinstance(k, bool) or k < 1:
            raise StoreError(f"k must be an integer >= 1, got {k!r}")
        object.__setattr__(self, "k", int(k))
        if not isinstance(self.rescore, bool | np.bool_):
            raise StoreError(f"rescore must be true or false, got {self.rescore!r}")
        object.__setattr__(self, "rescore", bool(self.rescore))
        if self.oversample is not None:
            object.__setattr__(self, "oversample", checked_oversample(self.oversample))
        object.__setattr__(self, "offset", checked_offset(self.k, self.offset))
        if self.score_threshold is not None:
            object.__setattr__(self, "score_threshold", checked_threshold(self.score_threshold))

    @property
    def depth(self) -> int:
        """How far down the ranking the query reads: k + offset."""
        return self.k + self.offset

    def unpaged(self) -> Query:
        """The query each segment or shard runs: its top `depth`, no offset (the score
        threshold kept: a hit below it is below it everywhere)."""
        return self if not self.offset else self.replace(k=self.depth, offset=0)

    def page(self, ranked: Ranked) -> Ranked:
        """`ranked` (per query, the merged top `depth`, best first) cut to this query's
        page: ranks offset + 1 to offset + k, less the hits below the threshold."""
        low = self.score_threshold
        return [
            [pair for pair in row[self.offset : self.depth] if low is None or pair[1].score >= low]
            for row in ranked
        ]

    @classmethod
    def of(cls, query: Query | np.ndarray, k: int | None = None, **where: Any) -> Query:
        """`query` itself, or a Query of vectors, k, `rescore`, `oversample` and
        `Where`'s keyword arguments: the form `ranked_search(queries, k, label=...,
        filter=...)` callers use."""
        if isinstance(query, Query):
            if k is not None or where:
                raise TypeError("give a Query alone, or vectors, k and where's arguments")
            return query
        if k is None:
            raise TypeError("a search of vectors needs k")
        scoring = {name: where.pop(name) for name in SHAPING if name in where}
        return cls(query, k, Where(**where), **scoring)

    def replace(self, **changes: Any) -> Query:
        """A copy with `changes` (any field), checked as a new one is."""
        return dataclasses.replace(self, **changes)

    def excluding(self, keys: Sequence[str]) -> Query:
        """A copy whose left-out keys are `keys` (a shard's part of them)."""
        return self.replace(where=dataclasses.replace(self.where, exclude_keys=keys))


SHAPING = ("rescore", "oversample", "offset", "score_threshold")
"""Query's fields besides the vectors, k and Where: how hits are scored and cut."""


def checked_offset(k: int, offset: Any) -> int:
    """`offset` as a page's start: an integer >= 0 with k + offset at most MAX_DEPTH
    (k counts hits, or groups for a grouped search)."""
    if not isinstance(offset, int | np.integer) or isinstance(offset, bool) or offset < 0:
        raise StoreError(f"offset must be an integer >= 0, got {offset!r}")
    if k + offset > MAX_DEPTH:
        raise StoreError(
            f"k + offset must be at most {MAX_DEPTH}, got {k + offset}: "
            "page deeper with a filter, or list the items with scroll"
        )
    return int(offset)


def checked_threshold(value: Any) -> float:
    """`value` as a score threshold: a finite number."""
    if (
        not isinstance(value, int | float | np.integer | np.floating)
        or isinstance(value, bool)
        or not math.isfinite(value)
    ):
        raise StoreError(f"score_threshold must be a finite number, got {value!r}")
    return float(value)


def checked_oversample(value: Any) -> int:
    """`value` as an oversampling factor: an integer from 1 to MAX_OVERSAMPLE."""
    if (
        not isinstance(value, int | np.integer)
        or isinstance(value, bool)
        or not 1 <= value <= MAX_OVERSAMPLE
    ):
        raise StoreError(f"oversample must be an integer from 1 to {MAX_OVERSAMPLE}, got {value!r}")
    return int(value)
