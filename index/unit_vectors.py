"""L2 normalisation, written once for every vector the index ranks: the embedder's
output, an embeddings folder's rows, a client's query or added vector, fused and
alpha-QE-expanded queries, DBA vectors.

Scores are cosines only for unit vectors, so how a vector is scaled to unit length
decides what it scores. In float32 the sum of squares of a vector of small values
underflows (128 values of 1e-22 square to 1e-44 each, below float32's smallest
normal, 1.2e-38) and of large ones overflows (1e30 squares past float32's 3.4e38):
the norm comes out wrong, zero or infinite although every value is finite. Here the
norm is taken in float64 after dividing each row by its largest magnitude, so any
row of finite values that is not all zero becomes a unit vector (float32 on return).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

CANCELLED_NORM = 1e-6
"""A sum or mean of unit vectors shorter than this has cancelled out (its direction is
rounding noise, not a query): fusion refuses it, alpha-QE keeps the plain query."""


def unit_rows(x: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `x` (n, d) scaled to unit L2 norm -> (float32 (n, d), bool (n,) `ok`).

    A row that has no direction (all zeros, or a NaN or infinite value) is not `ok` and
    comes back as zeros: callers refuse it or fall back to something else, never search
    with it."""
    rows = np.asarray(x, dtype=np.float64)
    if rows.ndim != 2:
        raise ValueError(f"unit_rows needs (n, d) rows, got shape {rows.shape}")
    if rows.shape[1] == 0:
        return np.zeros(rows.shape, np.float32), np.zeros(len(rows), bool)
    with np.errstate(invalid="ignore"):  # NaN rows are reported, not warned about
        scale = np.max(np.abs(rows), axis=1, keepdims=True)
    ok = np.isfinite(scale) & (scale > 0)
    # dividing by the largest magnitude first keeps the squares within float64's range
    # whatever the finite values (1e300 or 1e-300)
    scaled = np.where(ok, rows / np.where(ok, scale, 1.0), 0.0)
    norms = np.linalg.norm(scaled, axis=1, keepdims=True)
    unit = np.divide(scaled, norms, out=np.zeros_like(scaled), where=ok)
    return unit.astype(np.float32), ok[:, 0]


def l2_normalize(x: ArrayLike) -> np.ndarray:
    """Rows scaled to unit L2 norm, in float32 (computed as `unit_rows` does); a row
    with no direction (all zero, not finite) comes back as zeros."""
    return unit_rows(x)[0]
