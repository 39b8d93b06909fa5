"""One query after embedding: alpha-QE re-ranking and several query images as one.

The steps between the embeddings and the hits, written once for every caller: the HTTP
service awaits them over its `vitrieval.index.contract.Index` (in this process or across a Ray
cluster), `vitrieval-index search` over an opened store (`search_store`, through the
same `LocalIndex` the service uses): a ranked search and a batched read of stored
vectors.

- `search`: each query row its own query; with `AQE`, every query first searches its
  top n (with the same label, filter and exclusions), is replaced by its alpha-QE
  expansion (`vitrieval.index.rerank.expand_queries`) with the n hits' stored vectors, and the
  expansion is searched for the top k.
- `search_fused`: several query images as one query (`vitrieval.index.fusion`): `mean` searches
  the mean of their embeddings; `max` searches each image and merges by max score.

Every function takes the same shaping options, `Query`'s fields besides the vectors
and k (`vitrieval.index.store.request.SHAPING`: `rescore` and `oversample`, how a
compressed segment ranks its candidates; `offset` and `score_threshold`, which part of
the ranking comes back), and hands them to the one `Query` that `search` builds;
alpha-QE's first search is a copy of it without the page, so it re-scores as the final
search does and expands with the true top n.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .contract import Index, LocalIndex, Query, Ranked, Where
from .fusion import DEFAULT_FUSION, FUSIONS, Fusion, FusionError, fuse_mean, merge_max
from .grouping import Group, Grouping, grouped
from .rerank import DEFAULT_AQE_ALPHA, DEFAULT_AQE_NEIGHBOURS, expand_queries
from .store import Hit

__all__ = [
    "AQE",
    "Where",
    "search",
    "search_fused",
    "search_groups",
    "search_index",
    "search_store",
    "search_store_fused",
]

MAX_AQE_NEIGHBOURS = 100
"""The most neighbours alpha-QE may read per query (their vectors are fetched)."""
MAX_AQE_ALPHA = 64.0


@dataclass(frozen=True)
class AQE:
    """alpha query expansion with `neighbours` (n) hits weighted by score**alpha."""

    neighbours: int = DEFAULT_AQE_NEIGHBOURS
    alpha: float = DEFAULT_AQE_ALPHA

    def __post_init__(self) -> None:
        n = self.neighbours
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_AQE_NEIGHBOURS:
            raise ValueError(
                f"alpha-QE neighbours must be an integer from 1 to {MAX_AQE_NEIGHBOURS}, got {n!r}"
            )
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a):
            raise ValueError(f"alpha-QE alpha must be a finite number, got {a!r}")
        if not 0 <= a <= MAX_AQE_ALPHA:
            raise ValueError(f"alpha-QE alpha must be from 0 to {MAX_AQE_ALPHA:g}, got {a!r}")


async def search(
    index: Index,
    queries: np.ndarray,
    k: int,
    *,
    where: Where | None = None,
    rerank: AQE | None = None,
    **shaping: Any,
) -> Ranked:
    """Each row of float32 (q, d) `queries` searched for its top k, as ranked hits;
    with `rerank`, alpha-QE first (module docstring). `shaping`: `Query`'s `rescore`,
    `oversample` (how compressed segments rank their candidates), `offset` and
    `score_threshold` (which part of the ranking comes back); a StoreError when
    invalid."""
    query = Query(np.asarray(queries, dtype=np.float32), k, where or Where(), **shaping)
    if rerank is not None:
        query = query.replace(vectors=await expand(index, query, rerank))
    return await index.ranked_search(query)


async def expand(index: Index, query: Query, aqe: AQE) -> np.ndarray:
    """alpha-QE: each query's top n hits (as `query.where` allows) and their stored
    vectors -> the expanded float32 (q, d) queries. A query with fewer hits expands
    with those it has."""
    queries = query.vectors
    first = query.replace(k=aqe.neighbours, offset=0, score_threshold=None)
    rows = await index.ranked_search(first)
    keys = list(dict.fromkeys(hit.key for row in rows for _, hit in row))
    stored = dict(zip(keys, await index.vectors(keys) if keys else [], strict=True))
    n, d = aqe.neighbours, queries.shape[1]
    neighbours = np.zeros((len(queries), n, d), dtype=np.float32)
    scores = np.zeros((len(queries), n), dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (_, hit) in enumerate(row[:n]):
            vector = stored.get(hit.key)
            if vector is not None:  # removed since the search: it adds nothing
                neighbours[i, j] = vector
                scores[i, j] = hit.score
    return expand_queries(queries, neighbours, scores, aqe.alpha)


async def search_fused(
    index: Index,
    vectors: np.ndarray,
    k: int,
    *,
    fusion: Fusion = DEFAULT_FUSION,
    where: Where | None = None,
    rerank: AQE | None = None,
    **shaping: Any,
) -> list[tuple[int, Hit]]:
    """The float32 (m, d) embeddings of m query images as one query -> its ranked top k.
    `mean` searches their normalised mean; `max` each of them (each expanded on its
    own with `rerank`) to the page's depth, merged by max score (index.fusion), then
    cut to the page. `shaping` as for `search`."""
    if fusion not in FUSIONS:
        raise FusionError(f"fusion must be one of {', '.join(FUSIONS)}, not {fusion!r}")
    x = np.asarray(vectors, dtype=np.float32)
    if len(x) > 1 and fusion == "mean":
        x = fuse_mean(x)[None, :]
    if len(x) == 1:
        return (await search(index, x, k, where=where, rerank=rerank, **shaping))[0]
    page = Query(x, k, where or Where(), **shaping)  # checked once; cuts the merged page
    whole = {**shaping, "offset": 0}
    rows = await search(index, x, page.depth, where=where, rerank=rerank, **whole)
    return page.page([merge_max(rows, page.depth)])[0]


async def search_groups(
    index: Index,
    vectors: np.ndarray,
    k: int,
    grouping: Grouping,
    *,
    fusion: Fusion = DEFAULT_FUSION,
    where: Where | None = None,
    rerank: AQE | None = None,
    **shaping: Any,
) -> list[Group]:
    """The float32 (m, d) embeddings of one query (m images fused as `search_fused`
    fuses them) -> groups offset + 1 to offset + k of its ranking grouped by
    `grouping` (index.grouping): the groups by their best hits, each with its best
    `grouping.size` hits. `shaping` as for `search`; `offset` counts groups."""
    page = Query(np.asarray(vectors, dtype=np.float32), k, where or Where(), **shaping)
    whole = {**shaping, "offset": 0}

    async def rank(depth: int) -> list[tuple[int, Hit]]:
        options = {"fusion": fusion, "where": where, "rerank": rerank, **whole}
        return await search_fused(index, vectors, depth, **options)

    return await grouped(rank, page.k, grouping, page.offset)


def search_store(store: Any, queries: np.ndarray, k: int, **options: Any) -> Ranked:
    """`search` (its `where`, `rerank` and shaping options) on an opened store, for
    synchronous callers (the command line)."""
    return asyncio.run(search(LocalIndex(store), queries, k, **options))


def search_store_fused(
    store: Any, vectors: np.ndarray, k: int, **options: Any
) -> list[tuple[int, Hit]]:
    """`search_fused` (its `fusion`, `where`, `rerank` and shaping options) on an
    opened store, for synchronous callers."""
    return asyncio.run(search_fused(LocalIndex(store), vectors, k, **options))


def search_store_groups(
    store: Any, vectors: np.ndarray, k: int, grouping: Grouping, **options: Any
) -> list[Group]:
    """`search_groups` on an opened store, for synchronous callers."""
    return asyncio.run(search_groups(LocalIndex(store), vectors, k, grouping, **options))


def search_index(
    index: Any,
    queries: np.ndarray,
    k: int = 10,
    *,
    label: str | None = None,
    filter: Any = None,
    exclude_keys: Sequence[str] = (),
    rerank: AQE | None = None,
    fusion: Fusion | None = None,
    rescore: bool = True,
    oversample: int | None = None,
    offset: int = 0,
    score_threshold: float | None = None,
) -> list[list[Hit]]:
    """The Python API's search (`vitrieval.search`) on an opened index (`open_index`).

    `queries`: float32 (q, d) embeddings (an `Embedder`'s output), or one (d,) vector.
    Each row is its own query, answered by its own list of hits (best first), unless
    `fusion` ("mean" or "max") makes all rows one query, answered by one list. `label`,
    `filter` (the filter language, as a dict) and `exclude_keys` restrict the items;
    `rerank=AQE(...)` re-ranks with alpha query expansion. On an index that scores
    from compressed codes (PQ, SQ), each segment ranks its `oversample` x k best
    candidates again by their exact vectors (1 to MAX_OVERSAMPLE; None: the index's
    setting) unless `rescore=False`; Flat, IVF-Flat and HNSW-Flat indexes ignore both.
    `offset` skips the best hits (pages of k: ranks offset + 1 to offset + k; k +
    offset at most MAX_DEPTH); hits scoring below `score_threshold` are left out."""
    x = np.asarray(queries, dtype=np.float32)
    x = x[None, :] if x.ndim == 1 else x
    where = Where(label=label, filter=filter, exclude_keys=exclude_keys)
    options = {"where": where, "rerank": rerank, "rescore": rescore, "oversample": oversample,
               "offset": offset, "score_threshold": score_threshold}  # fmt: skip
    if fusion is not None:
        rows = [search_store_fused(index, x, k, fusion=fusion, **options)]
    else:
        rows = search_store(index, x, k, **options)
    return [[hit for _, hit in row] for row in rows]
