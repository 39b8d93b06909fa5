"""Retrieval-quality metrics: Recall@K, Precision@K, mAP, MAP@R and R-Precision.

Setting
-------
Every query is ranked against a gallery by inner-product similarity
``s(q, g) = <q, g>``, which is cosine similarity because vitrieval's embeddings are
L2-normalised (the exported model guarantees it; this module does not renormalise,
so pass normalised vectors if you mean cosine). A gallery item is *relevant* to a
query when their labels are equal.

Two protocols:

- leave-one-out (no gallery given): the set is its own gallery and each query is
  left out of its own ranking, so a query ranks the N - 1 other items;
- query/gallery: queries are ranked against a separate gallery and nothing is left
  out (an identical image in both sets counts as an ordinary relevant item).

A query with no relevant item in its gallery (its class appears nowhere else) has
no defined AP or recall: it is dropped from every metric and counted in
``n_dropped``.

Ties
----
The ranking is total and deterministic: items are sorted by descending score, and
items with exactly equal scores (float32 equality) by ascending gallery index. So
the rank of gallery item j for a query is::

    rank(j) = 1 + #{g : s_g > s_j} + #{g : s_g == s_j and g < j}

(counting gallery items other than the query itself in leave-one-out). Every metric
below is computed from these ranks, so ties never depend on a search library's
order.

Metrics (per query, then averaged over the queries that are not dropped)
--------------------------------------------------------------------------
Let R be the number of relevant gallery items and r_1 < r_2 < ... < r_R their ranks.

- ``recall@K``: 1 if r_1 <= K else 0 (the deep-metric-learning Recall@K: is any
  relevant item among the top K).
- ``precision@K``: #{i : r_i <= K} / K. When K exceeds the gallery size the
  denominator is still K.
- ``map``: average precision over the full ranking,
  AP = (1/R) * sum_{i=1..R} i / r_i (i / r_i is the precision at the i-th hit).
- ``map_at_r``: MAP@R of Musgrave et al., "A Metric Learning Reality Check"
  (ECCV 2020): MAP@R = (1/R) * sum_{k=1..R} P(k) * rel(k) with P(k) the precision
  at rank k and rel(k) = 1 if the item at rank k is relevant, i.e.
  (1/R) * sum_{i : r_i <= R} i / r_i.
- ``r_precision``: #{i : r_i <= R} / R.

Memory and cost
---------------
Queries are processed ``chunk_size`` at a time: the float32 score block
(chunk_size x N_gallery) is computed with one matrix product, and for each query
its row is sorted (a copy of N_gallery floats) and the relevant items' scores are
located in it by binary search, which gives each relevant item's exact rank in the
full ranking without materialising an argsort. Peak extra memory is about
4 * chunk_size * N_gallery bytes (400 MB for chunk_size 1024 and a 100k gallery)
plus O(N_gallery + N_queries * len(ks)); a 100k x 100k evaluation never holds the
full similarity matrix. Rows where a relevant item shares its exact score with
another item take a slower exact path (counting equal scores by index, or a
stable argsort of that row when many relevant items are tied).

A top-k search (FAISS) is deliberately not used here: mAP needs the rank of every
relevant item in the full ranking, and a kNN library's order among tied scores is
unspecified, whereas the counting above is exact and follows the tie rule.

One relevant item per query (copy detection)
--------------------------------------------
When each query has exactly one relevant gallery item, its *target* (the original
a copy was made from), labels are the wrong tool: ``target_ranks`` takes the
target's gallery index per query and returns its rank under the same tie rule,

    rank = 1 + #{g : s_g > s_t} + #{g : s_g == s_t and g < t},

and ``target_metrics`` turns ranks into ``recall@K`` = mean(rank <= K) and
``map`` = mean(1 / rank) (with R = 1, AP = 1 / rank, so mAP is the mean reciprocal
rank), plus ``median_rank``. precision@K, MAP@R and R-Precision add nothing here
(recall@K / K, recall@1 and recall@1) and are not reported. These give exactly what
``retrieval_metrics`` gives with a distinct label per gallery item (a test checks
it) without per-class bookkeeping or a sort: one chunk of scores, two comparisons.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .isotropy import isotropy_score

__all__ = [
    "QueryMetrics",
    "isotropy_score",
    "query_metrics",
    "retrieval_metrics",
    "target_metrics",
    "target_ranks",
]

# Above this many relevant items tied with some other item in one row, rank the
# row with a stable argsort instead of counting equal scores item by item.
_MAX_TIED_COUNTS = 16


def _as_matrix(x: object, name: str) -> np.ndarray:
    """Check that `x` is a non-empty finite 2-D float array; return it as C-contiguous float32."""
    arr = np.asarray(x)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (n, dim); got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{name} must be a float array; got dtype {arr.dtype}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {arr.shape})")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _as_labels(labels: object, n: int, name: str) -> list[Hashable]:
    """Return `labels` as a list of `n` hashable Python values (ints, strings, ...)."""
    if labels is None:
        raise ValueError(f"{name} must be given")
    if isinstance(labels, str | bytes):
        raise ValueError(f"{name} must be a sequence of labels, not a single string")
    if isinstance(labels, np.ndarray):
        if labels.ndim != 1:
            raise ValueError(f"{name} must be 1-D; got shape {labels.shape}")
        values = labels.tolist()
    else:
        try:
            values = list(labels)  # type: ignore[call-overload]
        except TypeError:
            raise ValueError(f"{name} must be a sequence of labels") from None
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries but there are {n} embeddings")
    for v in values:
        if not isinstance(v, Hashable):
            raise ValueError(f"{name} must hold scalar labels (int, str); got {type(v).__name__}")
    return values


def _check_ks(ks: object) -> list[int]:
    if isinstance(ks, numbers.Integral | str | bytes):
        raise ValueError(f"ks must be a sequence of positive ints, e.g. (1, 2, 4, 8); got {ks!r}")
    try:
        values = list(ks)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"ks must be a sequence of positive ints; got {ks!r}") from None
    out: list[int] = []
    for k in values:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"ks must hold positive ints; got {k!r}")
        if int(k) not in out:
            out.append(int(k))
    return out


def _relevant_ranks(row: np.ndarray, rel: np.ndarray) -> np.ndarray:
    """Ranks (1-based, ascending) of the gallery items `rel` in the ranking of `row`.

    row: (N,) float32 scores; an excluded item (the query itself) holds -inf, so it
    sorts below every finite score and never counts as higher or equal. rel: sorted
    gallery indices of the relevant items. Applies the module's tie rule.
    """
    v = row[rel]
    srt = np.sort(row)
    n = row.shape[0]
    above_or_equal = n - np.searchsorted(srt, v, side="left")
    above = n - np.searchsorted(srt, v, side="right")
    ranks = above + 1
    tied = np.flatnonzero(above_or_equal - above > 1)
    if tied.size:
        if tied.size <= _MAX_TIED_COUNTS:
            # Equal scores at a lower index come first.
            for t in tied:
                j = rel[t]
                ranks[t] += np.count_nonzero(row[:j] == v[t])
        else:
            order = np.argsort(-row, kind="stable")
            rank_of = np.empty(n, dtype=np.int64)
            rank_of[order] = np.arange(1, n + 1)
            ranks = rank_of[rel]
    return np.sort(ranks)


@dataclass(frozen=True)
class QueryMetrics:
    """Per-query values behind `retrieval_metrics`, for means over any subset of queries.

    ``first_rank`` (rank of the best relevant item), ``hits_at_k`` (relevant items in
    the top K, one column per K of ``ks``), ``ap``, ``map_at_r``, ``r_precision``, and
    ``counted`` (False for a dropped query: no relevant item; its values are 0).
    """

    ks: tuple[int, ...]
    first_rank: np.ndarray
    hits_at_k: np.ndarray
    ap: np.ndarray
    map_at_r: np.ndarray
    r_precision: np.ndarray
    counted: np.ndarray

    @classmethod
    def zeros(cls, ks: Sequence[int], n: int) -> QueryMetrics:
        """Values for `n` queries, all 0 and none counted: `query_metrics` fills them in."""
        return cls(
            ks=tuple(ks),
            first_rank=np.zeros(n, dtype=np.int64),
            hits_at_k=np.zeros((n, len(ks)), dtype=np.int64),
            ap=np.zeros(n),
            map_at_r=np.zeros(n),
            r_precision=np.zeros(n),
            counted=np.zeros(n, dtype=bool),
        )

    def summary(self, mask: np.ndarray | None = None) -> dict[str, float | int]:
        """`retrieval_metrics`' dict over the queries in `mask` (None: all of them)."""
        selected = np.ones_like(self.counted) if mask is None else np.asarray(mask, dtype=bool)
        counted = self.counted & selected
        n_counted = int(counted.sum())
        out: dict[str, float | int] = {}
        if n_counted == 0:
            out.update(dict.fromkeys(metric_names(self.ks), math.nan))
        else:
            means = [
                *(np.mean(self.first_rank[counted] <= k) for k in self.ks),
                *(np.mean(self.hits_at_k[counted, col] / k) for col, k in enumerate(self.ks)),
                np.mean(self.ap[counted]),
                np.mean(self.map_at_r[counted]),
                np.mean(self.r_precision[counted]),
            ]  # in metric_names' order
            out.update(zip(metric_names(self.ks), map(float, means), strict=True))
        out["n_queries"] = n_counted
        out["n_dropped"] = int(selected.sum()) - n_counted
        return out


def metric_names(ks: Sequence[int]) -> list[str]:
    """The means `retrieval_metrics` answers for the cut-offs `ks`, in its order."""
    return [
        *(f"recall@{k}" for k in ks),
        *(f"precision@{k}" for k in ks),
        "map",
        "map_at_r",
        "r_precision",
    ]


def retrieval_metrics(
    embeddings: np.ndarray,
    labels: Sequence | np.ndarray,
    ks: Sequence[int] = (1, 2, 4, 8),
    **options: Any,
) -> dict[str, float | int]:
    """Evaluate retrieval: leave-one-out within `embeddings`, or queries against a gallery.

    Args:
        embeddings: (Nq, D) float query embeddings, expected L2-normalised (similarity
            is the inner product; nothing is renormalised here).
        labels: (Nq,) query labels, ints or strings, compared by equality.
        ks: the cut-offs K for ``recall@K`` and ``precision@K`` (positive ints).
        options: keyword-only, those of `query_metrics` (whose result this averages):
            gallery_embeddings: (Ng, D) float gallery embeddings. Omitted:
                leave-one-out, each query is ranked against the other Nq - 1 queries.
            gallery_labels: (Ng,) gallery labels; required with `gallery_embeddings`.
            chunk_size: queries scored per block (default 1024); peak memory is about
                4 * chunk_size * Ng bytes.

    Returns:
        ``recall@K`` and ``precision@K`` for each K, ``map``, ``map_at_r``,
        ``r_precision`` (floats, means over the counted queries; formulas in the
        module docstring), ``n_queries`` (queries counted) and ``n_dropped`` (queries
        without any relevant gallery item, left out of every mean). If every query
        is dropped, the metrics are NaN and ``n_queries`` is 0.

    Raises:
        ValueError: for arrays that are not 2-D, finite and float, lengths or
            dimensions that do not match, labels that are not scalars, a gallery
            without labels (or labels without a gallery), ks that are not positive
            ints, or a chunk_size that is not a positive int.
    """
    return query_metrics(embeddings, labels, ks, **options).summary()


def query_metrics(
    embeddings: np.ndarray,
    labels: Sequence | np.ndarray,
    ks: Sequence[int] = (1, 2, 4, 8),
    *,
    gallery_embeddings: np.ndarray | None = None,
    gallery_labels: Sequence | np.ndarray | None = None,
    chunk_size: int = 1024,
    own_row_out: bool = False,
) -> QueryMetrics:
    """`retrieval_metrics` per query, before averaging: same arguments and errors.

    `own_row_out`, with a gallery: query i is gallery row i under another vector (a
    re-ranked query), so row i is left out of its ranking and relevant items, as in
    leave-one-out."""
    k_list = _check_ks(ks)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    chunk_size = int(chunk_size)

    queries = _as_matrix(embeddings, "embeddings")
    n_q = queries.shape[0]
    q_labels = _as_labels(labels, n_q, "labels")

    if gallery_embeddings is None:
        if gallery_labels is not None:
            raise ValueError("gallery_labels given without gallery_embeddings")
        leave_one_out = True
        gallery = queries
        g_labels = q_labels
    else:
        if gallery_labels is None:
            raise ValueError("gallery_embeddings given without gallery_labels")
        leave_one_out = False
        gallery = _as_matrix(gallery_embeddings, "gallery_embeddings")
        if gallery.shape[1] != queries.shape[1]:
            raise ValueError(
                f"gallery_embeddings has dimension {gallery.shape[1]} but embeddings has "
                f"dimension {queries.shape[1]}"
            )
        g_labels = _as_labels(gallery_labels, gallery.shape[0], "gallery_labels")
        if own_row_out:
            if gallery.shape[0] != n_q:
                raise ValueError(
                    f"own_row_out needs one query per gallery row; got {n_q} and {gallery.shape[0]}"
                )
            leave_one_out = True
    n_g = gallery.shape[0]

    # Integer class codes; -1 marks a query label absent from the gallery.
    codes: dict[Hashable, int] = {}
    g_codes = np.fromiter(
        (codes.setdefault(lab, len(codes)) for lab in g_labels), dtype=np.int64, count=n_g
    )
    q_codes = np.fromiter((codes.get(lab, -1) for lab in q_labels), dtype=np.int64, count=n_q)
    by_class = np.argsort(g_codes, kind="stable")  # gallery indices grouped by class, ascending
    class_start = np.concatenate(([0], np.cumsum(np.bincount(g_codes, minlength=len(codes)))))

    out = QueryMetrics.zeros(k_list, n_q)
    k_arr = np.asarray(k_list, dtype=np.int64)

    # One score block reused for every chunk, so peak memory does not double.
    block = np.empty((min(chunk_size, n_q), n_g), dtype=np.float32)
    for start in range(0, n_q, chunk_size):
        stop = min(start + chunk_size, n_q)
        scores = block[: stop - start]  # (chunk, Ng) float32
        with np.errstate(over="ignore", invalid="ignore"):
            np.matmul(queries[start:stop], gallery.T, out=scores)
        # min/max propagate NaN and expose infinities without a boolean copy of the block.
        if not (np.isfinite(scores.min()) and np.isfinite(scores.max())):
            raise ValueError(
                "similarities overflow float32; embeddings are expected to be L2-normalised"
            )
        if leave_one_out:
            scores[np.arange(stop - start), np.arange(start, stop)] = -np.inf
        for r in range(stop - start):
            i = start + r
            c = q_codes[i]
            if c < 0:
                continue
            rel = by_class[class_start[c] : class_start[c + 1]]
            if leave_one_out:
                rel = rel[rel != i]
            n_rel = rel.shape[0]
            if n_rel == 0:
                continue
            ranks = _relevant_ranks(scores[r], rel)
            hit_no = np.arange(1, n_rel + 1)
            precision_at_hits = hit_no / ranks
            out.counted[i] = True
            out.first_rank[i] = ranks[0]
            out.hits_at_k[i] = np.searchsorted(ranks, k_arr, side="right")
            out.ap[i] = precision_at_hits.mean()
            in_top_r = int(np.searchsorted(ranks, n_rel, side="right"))
            out.r_precision[i] = in_top_r / n_rel
            out.map_at_r[i] = precision_at_hits[:in_top_r].sum() / n_rel
    return out


def target_ranks(
    embeddings: np.ndarray,
    gallery_embeddings: np.ndarray,
    targets: Sequence[int] | np.ndarray,
    *,
    chunk_size: int = 1024,
) -> np.ndarray:
    """Rank (1-based) of each query's single relevant gallery item in its full ranking.

    Args:
        embeddings: (Nq, D) float query embeddings (similarity is the inner product,
            nothing is renormalised).
        gallery_embeddings: (Ng, D) float gallery embeddings.
        targets: (Nq,) ints, the gallery index of each query's relevant item.
        chunk_size: queries scored per block; peak extra memory is about
            6 * chunk_size * Ng bytes (float32 scores and two boolean masks).

    Returns:
        (Nq,) int64 ranks in [1, Ng], with the module's tie rule: items scoring
        exactly as much as the target come first when their gallery index is lower.

    Raises:
        ValueError: for arrays that are not 2-D, finite and float, mismatched
            dimensions, targets that are not ints in [0, Ng) or not one per query,
            or a chunk_size that is not a positive int.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    queries = _as_matrix(embeddings, "embeddings")
    gallery = _as_matrix(gallery_embeddings, "gallery_embeddings")
    if gallery.shape[1] != queries.shape[1]:
        raise ValueError(
            f"gallery_embeddings has dimension {gallery.shape[1]} but embeddings has "
            f"dimension {queries.shape[1]}"
        )
    n_q, n_g = queries.shape[0], gallery.shape[0]
    t = np.asarray(targets)
    if t.ndim != 1 or t.shape[0] != n_q:
        raise ValueError(f"targets must be 1-D with one entry per query ({n_q}); got {t.shape}")
    if not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"targets must be integer gallery indices; got dtype {t.dtype}")
    if t.min() < 0 or t.max() >= n_g:
        raise ValueError(f"targets must lie in [0, {n_g}); got [{t.min()}, {t.max()}]")
    t = t.astype(np.int64)

    ranks = np.empty(n_q, dtype=np.int64)
    column = np.arange(n_g)
    block = np.empty((min(int(chunk_size), n_q), n_g), dtype=np.float32)
    for start in range(0, n_q, int(chunk_size)):
        stop = min(start + int(chunk_size), n_q)
        scores = block[: stop - start]
        with np.errstate(over="ignore", invalid="ignore"):
            np.matmul(queries[start:stop], gallery.T, out=scores)
        if not (np.isfinite(scores.min()) and np.isfinite(scores.max())):
            raise ValueError(
                "similarities overflow float32; embeddings are expected to be L2-normalised"
            )
        own = t[start:stop]
        target_score = scores[np.arange(stop - start), own][:, None]
        above = np.count_nonzero(scores > target_score, axis=1)
        tied_before = np.count_nonzero((scores == target_score) & (column < own[:, None]), axis=1)
        ranks[start:stop] = 1 + above + tied_before
    return ranks


def target_metrics(ranks: Sequence[int] | np.ndarray, ks: Sequence[int] = (1, 2, 4, 8)) -> dict:
    """Metrics of one-relevant-item queries from their target ranks (`target_ranks`).

    Returns ``recall@K`` for each K (fraction of queries with rank <= K), ``map``
    (mean of 1 / rank: AP with a single relevant item), ``median_rank`` and
    ``n_queries``. No queries: the metrics are NaN and ``n_queries`` is 0.
    """
    k_list = _check_ks(ks)
    r = np.asarray(ranks, dtype=np.int64).reshape(-1)
    if r.size and r.min() < 1:
        raise ValueError("ranks are 1-based; got a rank below 1")
    out: dict[str, float | int] = {}
    for k in k_list:
        out[f"recall@{k}"] = float(np.mean(r <= k)) if r.size else math.nan
    out["map"] = float(np.mean(1.0 / r)) if r.size else math.nan
    out["median_rank"] = float(np.median(r)) if r.size else math.nan
    out["n_queries"] = int(r.size)
    return out
