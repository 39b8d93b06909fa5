"""Re-ranking after the first search: alpha query expansion (alpha-QE) and
database-side augmentation (DBA).

Radenović, Tolias and Chum (fine-tuning CNN image retrieval with no human annotation,
the GeM paper). Both replace a vector by the weighted mean of itself and
its top-n neighbours, each neighbour x_i weighted by its similarity s_i = <v, x_i>
raised to alpha, negative similarities clipped to 0:

    v' = normalise(v + sum_{i=1..n} max(s_i, 0)^alpha * x_i).

- alpha-QE applies it to a query q, with its top-n hits in the index, and searches
  the index again with q' (`expand_queries`, `aqe_vectors`);
- DBA applies it once to every database vector x, with its top-n neighbours in the
  database other than x itself, and ranks against the augmented vectors x'
  (`augment_database`, `dba_vectors`). Queries stay plain, or are also expanded
  against the augmented database (the paper's DBA + alpha-QE).

alpha = 0 weights every neighbour 1 (plain average query expansion; 0^0 = 1, so a
neighbour with a negative similarity counts too); a large alpha trusts the closest
neighbours most. A neighbour slot left empty (fewer than n neighbours) adds nothing.

Neighbours here are exact: inner products over the whole gallery, ranked by
descending score and, for exactly equal scores, ascending gallery index (the tie rule
of `vitrieval.index.evaluation.metrics`), a bounded number of query rows at a time
(`exact_neighbours`). The store (index/store/_dba.py) computes its DBA vector set
with its own search and `expand_queries`; `vitrieval-index bench --rerank` uses the
functions below (`rerank_vectors`, `leave_one_out_metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from .evaluation.metrics import QueryMetrics, query_metrics
from .unit_vectors import CANCELLED_NORM, unit_rows

DEFAULT_AQE_NEIGHBOURS = 2
DEFAULT_AQE_ALPHA = 3.0
DEFAULT_DBA_NEIGHBOURS = 2
DEFAULT_DBA_ALPHA = 3.0

METHODS = ("aqe", "dba", "dba+aqe")
"""Re-rankings `rerank_vectors` knows: alpha-QE on the plain gallery, DBA with plain
queries, and alpha-QE against the DBA gallery."""

SEARCH_METHODS = ("aqe", "dba")
"""Re-rankings one search asks for (HTTP `rerank`, `vitrieval-index search --rerank`):
alpha-QE, or ranking against the index's stored DBA vectors (index/store/_dba.py)."""

MAX_BLOCK_FLOATS = 1 << 24
"""float32 values one working block holds at most (scores in `exact_neighbours`, gathered
neighbour vectors in `augment_database`): 64 MB, whatever the chunk sizes left to None."""


def expand_queries(
    queries: np.ndarray, neighbours: np.ndarray, scores: np.ndarray, alpha: float
) -> np.ndarray:
    """alpha-QE: float32 (q, d) queries, their neighbours' vectors (q, n, d) and
    similarities (q, n) -> the expanded, L2-normalised queries (q, d),

        q' = normalise(q + sum_i max(s_i, 0)^alpha * x_i).

    A neighbour slot that is all zeros (fewer than n hits) adds nothing. A row whose
    sum has no direction is never searched with: where it cancels out (shorter than
    `CANCELLED_NORM`; with alpha 0 a hit of -q weighs 1, and q + (-q) = 0) or is not
    finite, the row is the query itself, normalised.
    """
    # the weighted sum in float32 (bounded values; a DBA block of neighbours is large),
    # its normalisation in float64 (unit_rows)
    q = np.asarray(queries, dtype=np.float32)
    x = np.asarray(neighbours, dtype=np.float32)
    s = np.asarray(scores, dtype=np.float32)
    if q.ndim != 2 or x.ndim != 3 or s.shape != x.shape[:2] or x.shape[0] != q.shape[0]:
        raise ValueError(
            f"expand_queries needs (q, d), (q, n, d), (q, n); got {q.shape}, {x.shape}, {s.shape}"
        )
    weights = np.power(np.clip(s, 0.0, None), np.float32(alpha))
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite rows fall back below
        expanded = q + np.einsum("qn,qnd->qd", weights, x)
        lengths = np.linalg.norm(expanded.astype(np.float64), axis=1)
    unit, ok = unit_rows(expanded)
    keep = ok & (lengths >= CANCELLED_NORM)
    if keep.all():
        return unit
    plain, _ = unit_rows(q[~keep])
    unit[~keep] = plain
    return unit


def augment_database(
    vectors: np.ndarray,
    neighbour_ids: np.ndarray,
    neighbour_scores: np.ndarray,
    alpha: float,
    *,
    pool: np.ndarray | None = None,
    chunk: int | None = None,
) -> np.ndarray:
    """DBA from known neighbours: float32 (N, d) vectors, (N, n) int neighbour ids
    (rows of `pool`, -1 = no neighbour) and their (N, n) similarities -> the augmented,
    L2-normalised vectors (N, d),

        x' = normalise(x + sum_j max(s_j, 0)^alpha * pool[id_j]).

    `pool` (M, d) is where the ids point (None: `vectors` itself, the usual case of a
    database augmented with its own neighbours). A -1 slot adds nothing whatever its
    score. The caller excludes each vector from its own neighbours (`dba_vectors`
    does). Rows are gathered `chunk` at a time (None: as many as keep the gathered
    block under MAX_BLOCK_FLOATS floats): peak extra memory about 8 * chunk * n * d
    bytes.
    """
    x = _matrix(vectors, "vectors")
    source = x if pool is None else _matrix(pool, "pool")
    ids = np.asarray(neighbour_ids)
    s = np.asarray(neighbour_scores, dtype=np.float32)
    if ids.ndim != 2 or ids.shape[0] != x.shape[0] or s.shape != ids.shape:
        raise ValueError(
            f"augment_database needs (N, d) vectors and (N, n) ids and scores; got "
            f"{x.shape}, {ids.shape}, {s.shape}"
        )
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"neighbour_ids must be integers, got {ids.dtype}")
    if source.shape[1] != x.shape[1]:
        raise ValueError(f"pool has dimension {source.shape[1]}, vectors {x.shape[1]}")
    if ids.size and (ids.min() < -1 or ids.max() >= len(source)):
        raise ValueError(f"neighbour_ids must lie in [-1, {len(source)}); got {ids.min()}..")
    out = np.empty_like(x)
    rows = _chunk_rows(ids.shape[1] * x.shape[1], chunk, most=4096)
    for start in range(0, len(x), rows):
        stop = min(start + rows, len(x))
        block = ids[start:stop]
        found = block >= 0
        gathered = source[np.where(found, block, 0)] * found[..., None]
        out[start:stop] = expand_queries(
            x[start:stop], gathered, np.where(found, s[start:stop], 0.0), alpha
        )
    return out


def exact_neighbours(
    queries: np.ndarray,
    gallery: np.ndarray,
    n: int,
    *,
    exclude_self: bool = False,
    chunk: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-n by inner product: (Q, d) queries, (N, d) gallery -> (Q, n) int64
    gallery ids, best first, and their (Q, n) float32 scores.

    Order: descending score, then ascending gallery id (`vitrieval.index.evaluation.metrics`' tie
    rule).
    `exclude_self`: the queries are the gallery's rows (Q == N) and row i never lists
    i. Fewer than n candidates: the rest of the row is id -1, score 0. `chunk` query
    rows are scored at a time (None: as many as keep a block under
    MAX_BLOCK_FLOATS floats); peak extra memory about 20 * chunk * N bytes.
    """
    q, g = _matrix(queries, "queries"), _matrix(gallery, "gallery")
    if q.shape[1] != g.shape[1]:
        raise ValueError(f"queries have dimension {q.shape[1]}, the gallery {g.shape[1]}")
    if exclude_self and len(q) != len(g):
        raise ValueError(f"exclude_self needs one query per gallery row; got {len(q)}, {len(g)}")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    rows = _chunk_rows(len(g), chunk)
    take = min(n, len(g))
    ids = np.full((len(q), n), -1, dtype=np.int64)
    scores = np.zeros((len(q), n), dtype=np.float32)
    for start in range(0, len(q) if take else 0, rows):
        stop = min(start + rows, len(q))
        block = q[start:stop] @ g.T
        if exclude_self:
            block[np.arange(stop - start), np.arange(start, stop)] = -np.inf
        top = _top(block, take)
        best = np.take_along_axis(block, top, axis=1)
        real = np.isfinite(best)  # -inf: the excluded row itself
        ids[start:stop, :take] = np.where(real, top, -1)
        scores[start:stop, :take] = np.where(real, best, 0.0)
    return ids, scores


def _top(block: np.ndarray, k: int) -> np.ndarray:
    """Column ids of each row's k best scores, by descending score then ascending id."""
    if k >= block.shape[1]:
        return np.argsort(-block, axis=1, kind="stable")[:, :k]
    candidates = np.argpartition(-block, k - 1, axis=1)[:, :k]
    chosen = np.take_along_axis(block, candidates, axis=1)
    order = np.lexsort((candidates, -chosen), axis=1)
    top = np.take_along_axis(candidates, order, axis=1)
    # argpartition picks any of the items tied at the k-th score: where some were left
    # out, sort the whole row so the lowest ids among them win
    kth = chosen.min(axis=1, keepdims=True)
    unfair = np.flatnonzero(
        np.count_nonzero(block == kth, axis=1) != np.count_nonzero(chosen == kth, axis=1)
    )
    for row in unfair:
        top[row] = np.argsort(-block[row], kind="stable")[:k]
    return top


def dba_vectors(
    vectors: np.ndarray,
    n: int = DEFAULT_DBA_NEIGHBOURS,
    alpha: float = DEFAULT_DBA_ALPHA,
    *,
    chunk: int | None = None,
) -> np.ndarray:
    """DBA of a whole set: every row of (N, d) `vectors` augmented with its exact top-n
    neighbours among the other rows (never itself; an exact duplicate is another row,
    so it counts) -> (N, d) float32, L2-normalised. Computed `chunk` rows at a time
    (`exact_neighbours`), so memory stays bounded; the result does not depend on it.
    """
    x = _matrix(vectors, "vectors")
    # more than N - 1 slots would all be empty: they add nothing, so none are made
    ids, scores = exact_neighbours(x, x, _at_most(n, len(x)), exclude_self=True, chunk=chunk)
    return augment_database(x, ids, scores, alpha)


def aqe_vectors(
    queries: np.ndarray,
    gallery: np.ndarray,
    n: int = DEFAULT_AQE_NEIGHBOURS,
    alpha: float = DEFAULT_AQE_ALPHA,
    *,
    exclude_self: bool = False,
    chunk: int | None = None,
) -> np.ndarray:
    """alpha-QE with an exact first search: (Q, d) queries expanded with their top-n in
    the (N, d) gallery -> (Q, d) float32, L2-normalised. `exclude_self`: the queries are
    the gallery's rows (leave-one-out), and a query is not its own neighbour."""
    q, g = _matrix(queries, "queries"), _matrix(gallery, "gallery")
    ids, scores = exact_neighbours(
        q, g, _at_most(n, len(g)), exclude_self=exclude_self, chunk=chunk
    )
    return augment_database(q, ids, scores, alpha, pool=g)


@dataclass(frozen=True)
class RerankSettings:
    """n and alpha of each method (the defaults above unless asked otherwise)."""

    aqe_neighbours: int = DEFAULT_AQE_NEIGHBOURS
    aqe_alpha: float = DEFAULT_AQE_ALPHA
    dba_neighbours: int = DEFAULT_DBA_NEIGHBOURS
    dba_alpha: float = DEFAULT_DBA_ALPHA

    def __post_init__(self) -> None:
        for name in ("aqe_neighbours", "dba_neighbours"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("aqe_alpha", "dba_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def rerank_vectors(
    queries: np.ndarray,
    gallery: np.ndarray,
    methods: Sequence[str],
    settings: RerankSettings = RerankSettings(),
    *,
    leave_one_out: bool = False,
) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """The vectors each re-ranking ranks with: method -> (query vectors (Q, d),
    gallery vectors (N, d), seconds it took).

    The exact re-ranked order of query i is the gallery sorted by descending
    <query'_i, gallery'_j> (then ascending j), so any metric of
    `vitrieval.index.evaluation.metrics` on
    these vectors is the metric of the re-ranked search, over the whole gallery:
    - "aqe": queries expanded with their top-n in the gallery; the gallery as it is;
    - "dba": queries as they are; the gallery's DBA vectors;
    - "dba+aqe": the DBA gallery, and queries expanded with their top-n in it.
    `leave_one_out`: the queries are the gallery's rows (Q == N); a query is never
    its own neighbour in the first search, and the caller leaves it out of its ranking
    (`leave_one_out_metrics`). DBA is computed once over the whole gallery, the query
    among it, as a database holding the query would be. The DBA gallery is computed
    once for "dba" and "dba+aqe" (its time is counted in each).
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown re-ranking {unknown[0]!r}; known: {', '.join(METHODS)}")
    q, g = _matrix(queries, "queries"), _matrix(gallery, "gallery")
    dba_gallery: np.ndarray | None = None
    dba_seconds = 0.0
    out: dict[str, tuple[np.ndarray, np.ndarray, float]] = {}
    for method in dict.fromkeys(methods):
        started = time.perf_counter()
        base = g
        if method != "aqe":
            if dba_gallery is None:
                dba_gallery = dba_vectors(g, settings.dba_neighbours, settings.dba_alpha)
                dba_seconds = time.perf_counter() - started
                started = time.perf_counter()
            base = dba_gallery
        expanded = q
        if method != "dba":
            expanded = aqe_vectors(
                q, base, settings.aqe_neighbours, settings.aqe_alpha, exclude_self=leave_one_out
            )
        seconds = time.perf_counter() - started + (0.0 if method == "aqe" else dba_seconds)
        out[method] = (expanded, base, seconds)
    return out


def rerank_search(
    queries: np.ndarray,
    gallery: np.ndarray,
    k: int,
    method: str,
    settings: RerankSettings = RerankSettings(),
    *,
    leave_one_out: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The re-ranked exact search: (Q, k) gallery ids, best first (-1 past the end),
    and their (Q, k) scores against the re-ranked vectors (`rerank_vectors`)."""
    expanded, base, _ = rerank_vectors(
        queries, gallery, [method], settings, leave_one_out=leave_one_out
    )[method]
    return exact_neighbours(expanded, base, k, exclude_self=leave_one_out)


def leave_one_out_metrics(
    queries: np.ndarray,
    gallery: np.ndarray,
    labels: Sequence[Hashable] | np.ndarray,
    ks: Sequence[int],
    *,
    chunk: int | None = None,
) -> QueryMetrics:
    """`vitrieval.index.evaluation.metrics.query_metrics`' leave-one-out protocol where query i has
    a vector
    of its own (a re-ranked query) but is still gallery row i: row i is left out of
    query i's ranking and of its relevant items. Same metrics, tie rule and dropped
    queries; with queries equal to the gallery it gives query_metrics' numbers."""
    q, g = _matrix(queries, "queries"), _matrix(gallery, "gallery")
    if q.shape != g.shape:
        raise ValueError(f"leave-one-out needs one query per gallery row; got {q.shape}, {g.shape}")
    return query_metrics(
        q,
        labels,
        ks,
        gallery_embeddings=g,
        gallery_labels=labels,
        chunk_size=_chunk_rows(len(g), chunk),
        own_row_out=True,
    )


def _matrix(x: np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (n, d); got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _at_most(n: int, rows: int) -> int:
    """n, checked, capped at the rows there are (at least 1)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    return min(n, max(rows, 1))


def _chunk_rows(floats_per_row: int, chunk: int | None, most: int = 1024) -> int:
    """`chunk`, checked, or the rows (at most `most`) that keep a block of
    `floats_per_row` floats a row under MAX_BLOCK_FLOATS."""
    if chunk is not None:
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1, got {chunk}")
        return int(chunk)
    return max(1, min(most, MAX_BLOCK_FLOATS // max(floats_per_row, 1)))
