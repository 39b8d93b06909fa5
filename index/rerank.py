"""Re-ranking after the first search: alpha query expansion (alpha-QE).

Radenović, Tolias and Chum (fine-tuning CNN image retrieval with no human annotation,
the GeM paper, section 5): the query is replaced by the weighted mean of itself and
its top-n neighbours, each neighbour weighted by its similarity raised to alpha,

    q' = normalise(q + sum_{i=1..n} max(s_i, 0)^alpha * x_i),

and the index is searched again with q'. alpha = 0 is plain average query expansion;
a large alpha trusts the closest neighbours most.
"""

from __future__ import annotations

import numpy as np

DEFAULT_AQE_NEIGHBOURS = 2
DEFAULT_AQE_ALPHA = 3.0


def expand_queries(
    queries: np.ndarray, neighbours: np.ndarray, scores: np.ndarray, alpha: float
) -> np.ndarray:
    """alpha-QE: float32 (q, d) queries, their neighbours' vectors (q, n, d) and
    similarities (q, n) -> the expanded, L2-normalised queries (q, d).

    A neighbour slot that is all zeros (fewer than n hits) adds nothing.
    """
    q = np.asarray(queries, dtype=np.float32)
    x = np.asarray(neighbours, dtype=np.float32)
    s = np.asarray(scores, dtype=np.float32)
    if q.ndim != 2 or x.ndim != 3 or s.shape != x.shape[:2] or x.shape[0] != q.shape[0]:
        raise ValueError(
            f"expand_queries needs (q, d), (q, n, d), (q, n); got {q.shape}, {x.shape}, {s.shape}"
        )
    weights = np.power(np.clip(s, 0.0, None), np.float32(alpha))
    expanded = q + np.einsum("qn,qnd->qd", weights, x)
    norms = np.linalg.norm(expanded, axis=1, keepdims=True)
    return (expanded / np.maximum(norms, 1e-12)).astype(np.float32)
