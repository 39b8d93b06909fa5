"""Re-scoring: a compressed segment's candidates ranked again by their exact vectors.

A segment whose FAISS index scores from codes (PQ, SQ, OPQ, RaBitQ: anything whose
scores are not the float32 inner products) ranks approximately twice over: the codes
choose which items come back, and the codes' scores order them. Every segment keeps
its items' float32 vectors beside its index (sealed: the memory-mapped
seg.<n>.vectors.npy; growing: the item table), so a search takes `oversample` x k
candidates from the codes and ranks those by the exact inner product <q, x> with the
vectors read for them alone (through the page cache: a few kB per query, never a
full load). The result is the exact top k of the candidate set, scored exactly as a
"Flat" index scores (the same FAISS kernel), equal scores by ascending item id.
"""

from __future__ import annotations

import faiss
import numpy as np

from .segment_contract import Segment

Pairs = list[list[tuple[int, float]]]
"""Per query, (item id, score) pairs best first."""


def rescored(segment: Segment, queries: np.ndarray, candidates: list[np.ndarray], k: int) -> Pairs:
    """Each query's `candidates` (int64 item ids from the segment's codes) ranked by
    their exact scores <q, x> against the segment's stored vectors: per query of
    float32 (q, d) `queries`, its top `k` (id, exact score), ties by ascending id."""
    width = max((row.size for row in candidates), default=0)
    if width == 0:
        return [[] for _ in candidates]
    ids = np.full((len(candidates), width), -1, dtype=np.int64)
    for row, found in enumerate(candidates):
        ids[row, : found.size] = found
    # each candidate's row in the stored vectors; -1 (padding, or an item the segment
    # no longer holds) scores -inf and is dropped below
    base, rows = segment.exact_rows(ids)
    scores = inner_products_by_row(queries, base, rows)
    results: Pairs = []
    for row in range(len(candidates)):
        keep = rows[row] >= 0
        item_ids, item_scores = ids[row, keep], scores[row, keep]
        order = np.lexsort((item_ids, -item_scores))[:k]
        best = zip(item_ids[order].tolist(), item_scores[order].tolist(), strict=True)
        results.append(list(best))
    return results


def inner_products_by_row(queries: np.ndarray, vectors: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """float32 (q, c): <queries[i], vectors[rows[i, j]]>, -inf where rows[i, j] is -1;
    computed by FAISS's `fvec_inner_product`, the kernel an exhaustive "Flat" search
    uses for a few queries, so a re-scored item scores what a Flat index gives it."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    base = np.ascontiguousarray(vectors, dtype=np.float32)  # held while FAISS reads it
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    out = np.empty(rows.shape, dtype=np.float32)
    if rows.size == 0:
        return out
    faiss.fvec_inner_products_by_idx(
        faiss.swig_ptr(out),
        faiss.swig_ptr(q),
        faiss.swig_ptr(base),
        faiss.swig_ptr(rows),
        q.shape[1],
        rows.shape[0],
        rows.shape[1],
    )
    return out
