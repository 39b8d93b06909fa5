"""Recommendation from positive and negative examples, as Qdrant's `recommend` defines it.

The examples are unit vectors (an indexed item's stored vector, an embedded image or a
raw vector). Two strategies:

- `average_vector`: one query, q = 2 avg(P) - avg(N) (avg(P) alone without negatives),
  normalised, searched as any query: the items near the positives and away from the
  negatives in one direction.
- `best_score`: every item x scores against every example, with p = max over the
  positives of <x, p> and n = max over the negatives of <x, n> (n = -inf without
  negatives): its score is p when p > n, else -n^2 (an item closer to a negative than
  to every positive ranks below every item that is not, the nearer that negative the
  lower). The candidates are the union of each positive's own ranking, read to the
  page's depth and then deeper while an item outside them could still rank on the
  page (it scores at most max(b, 0), b the highest of the scores the positives'
  rankings were read down to); a ranking that ends has every item. So on an exact
  (Flat) index it is brute force; on an approximate one it ranks the union of the
  positives' candidates.

Equal scores go by ascending item id; `offset` and `score_threshold` cut the ranking
as they cut a search's (index/store/request.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

import numpy as np

from .contract import Index, Query, Where
from .query import search
from .store import Hit
from .store.errors import StoreError
from .store.request import MAX_DEPTH

Strategy = Literal["average_vector", "best_score"]
STRATEGIES: tuple[Strategy, ...] = ("average_vector", "best_score")
DEFAULT_STRATEGY: Strategy = "average_vector"
MAX_EXAMPLES = 64
"""The most examples one recommendation takes, positive and negative together."""

Ranking = list[tuple[int, Hit]]


def check_examples(positive: np.ndarray, negative: np.ndarray, strategy: Any) -> None:
    """StoreError unless there is a positive, at most MAX_EXAMPLES in all, and the
    strategy is one of STRATEGIES."""
    if strategy not in STRATEGIES:
        raise StoreError(f"strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    if len(positive) == 0:
        raise StoreError("a recommendation needs at least one positive example")
    given = len(positive) + len(negative)
    if given > MAX_EXAMPLES:
        raise StoreError(f"at most {MAX_EXAMPLES} examples in all, got {given}")


def average_query(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """float32 (d,): 2 avg(P) - avg(N) (avg(P) without negatives), normalised; a
    StoreError when that is zero (opposite examples cancel out)."""
    mean = positive.astype(np.float64).mean(axis=0)
    q = 2 * mean - negative.astype(np.float64).mean(axis=0) if len(negative) else mean
    norm = np.linalg.norm(q)
    if norm < 1e-6:
        raise StoreError("the examples cancel out: their average_vector query is zero")
    return (q / norm).astype(np.float32)


def best_scores(x: np.ndarray, positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """float32 (m,) best_score of float32 (m, d) items `x` (module docstring)."""
    best_pos = (x @ positive.T).max(axis=1)
    if len(negative) == 0:
        return best_pos.astype(np.float32)
    best_neg = (x @ negative.T).max(axis=1)
    return np.where(best_pos > best_neg, best_pos, -(best_neg * best_neg)).astype(np.float32)


async def recommend(
    index: Index,
    positive: np.ndarray,
    negative: np.ndarray,
    k: int,
    *,
    strategy: Strategy = DEFAULT_STRATEGY,
    where: Where | None = None,
    **shaping: Any,
) -> Ranking:
    """The page (offset + 1 to offset + k) of the items recommended by float32 (p, d)
    `positive` and (n, d) `negative` examples under `strategy`, as `where` allows;
    `shaping` as `vitrieval.index.query.search` takes it."""
    return await ranking(index, positive, negative, strategy, where, shaping)(k)


def ranking(
    index: Index,
    positive: np.ndarray,
    negative: np.ndarray,
    strategy: Strategy,
    where: Where | None,
    shaping: dict[str, Any],
) -> Callable[[int], Awaitable[Ranking]]:
    """`page(k)`: the recommendation's page of k (a ranking function grouping reads)."""
    positive = np.asarray(positive, dtype=np.float32).reshape(-1, index.dim)
    negative = np.asarray(negative, dtype=np.float32).reshape(-1, index.dim)
    check_examples(positive, negative, strategy)

    async def page(k: int) -> Ranking:
        if strategy == "average_vector":
            query = average_query(positive, negative)[None, :]
            return (await search(index, query, k, where=where, **shaping))[0]
        cut = Query(positive, k, where or Where(), **shaping)  # checked; cuts the page
        ranked = await _best_score_ranking(index, positive, negative, cut, where, shaping)
        return cut.page([ranked])[0]

    return page


async def _best_score_ranking(
    index: Index,
    positive: np.ndarray,
    negative: np.ndarray,
    cut: Query,
    where: Where | None,
    shaping: dict[str, Any],
) -> Ranking:
    """The top `cut.depth` items by best_score (no threshold yet: `cut.page` applies
    it), from each positive's ranking read deeper until settled."""
    whole = {**shaping, "offset": 0, "score_threshold": None}
    depth = min(MAX_DEPTH, cut.depth)
    while True:
        rows = await search(index, positive, depth, where=where, **whole)
        found: dict[str, tuple[int, Hit]] = {}
        for row in rows:
            for item, hit in row:
                found.setdefault(hit.key, (item, hit))
        keys = list(found)
        stored = await index.vectors(keys) if keys else []
        kept = [(found[key], v) for key, v in zip(keys, stored, strict=True) if v is not None]
        scores = best_scores(np.stack([v for _, v in kept]), positive, negative) if kept else []
        ranked = sorted(
            ((item, hit, float(s)) for ((item, hit), _), s in zip(kept, scores, strict=True)),
            key=lambda entry: (-entry[2], entry[0]),
        )
        # every positive searched the same items: one ranking that ended saw them all
        ended = any(len(row) < depth for row in rows)
        # an item outside every ranking scores below each one's last: at most the
        # highest of those against a positive, and at most 0 against a negative
        bound = max(0.0, max(row[-1][1].score for row in rows)) if not ended else 0.0
        settled = len(ranked) >= cut.depth and ranked[cut.depth - 1][2] > bound
        if ended or settled or depth == MAX_DEPTH:
            top = ranked[: cut.depth]
            return [(item, _rescored(hit, s)) for item, hit, s in top]
        depth = min(MAX_DEPTH, depth * 4)


def _rescored(hit: Hit, score: float) -> Hit:
    return Hit(hit.key, score, hit.label, hit.path, hit.metadata)
