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

from ._vectors import NO_HITS, TopK
from .segment_contract import Segment


def rescored(segment: Segment, queries: np.ndarray, candidates: TopK, k: int) -> TopK:
    """Each query's `candidates` (its codes' TopK row; the codes' scores are not read)
    ranked by their exact scores <q, x> against the segment's stored vectors: per query
    of float32 (q, d) `queries`, its top `k` by exact score, ties by ascending id."""
    if len(candidates) == 1:  # one query, the usual case: no padded matrix
        ids = candidates[0][0][None, :]
    else:
        width = max((found.size for found, _ in candidates), default=0)
        ids = np.full((len(candidates), width), -1, dtype=np.int64)
        for row, (found, _) in enumerate(candidates):
            ids[row, : found.size] = found
    if ids.size == 0:
        return [NO_HITS] * len(candidates)
    # each candidate's row in the stored vectors; -1 (padding, or an item the segment
    # no longer holds) scores -inf, sorts last and is dropped below
    base, rows = segment.exact_rows(ids)
    scores = inner_products_by_row(queries, base, rows)
    results: TopK = []
    for item_ids, item_scores in zip(ids, scores, strict=True):
        order = np.lexsort((item_ids, -item_scores))[:k]
        top_ids, top_scores = item_ids[order], item_scores[order]
        if top_scores.size and top_scores[-1] == -np.inf:  # fewer than k held: drop the rest
            held = top_scores > -np.inf
            top_ids, top_scores = top_ids[held], top_scores[held]
        results.append((top_ids, top_scores))
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
