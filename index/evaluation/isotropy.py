"""Isotropy score of an embedding set (Mu & Viswanath, "All-but-the-Top", ICLR 2018).

LaCViT (its "Discussion" section, Table 3) reports this score to show that its
contrastive stage makes the embedding space more isotropic. Its printed formula is
max/min, but its table and its "a perfectly isotropic space scores 1" only fit the
original min/max form (docs/papers.md, reading 3), which is what is implemented:

    IS(V) = min_{c in C} Z(c) / max_{c in C} Z(c),    Z(c) = sum_{v in V} exp(c . v)

The ideal C is every unit vector; as in both papers it is approximated by the
eigenvectors of V^T V (V: the (n, d) matrix of stacked embeddings). The score lies in
(0, 1]; higher is more isotropic.

Reading of C implemented here: C = {+u_k, -u_k : k = 1..d}, the d unit eigenvectors of
V^T V *with both signs*. An eigenvector is only defined up to its sign (numpy may
return u or -u, and the choice can change between LAPACK builds), and Z(u) != Z(-u)
for a set that is not symmetric about the origin, so "the eigenvectors as numpy
returns them" would make the score depend on an arbitrary sign. The unit sphere that
C stands for contains -c with every c, so including both signs is the faithful,
deterministic reading. For a set symmetric about the origin (v in V => -v in V) it
agrees with the one-sign reading, e.g.

    {(1,0), (-1,0), (0,1), (0,-1)}:  Z = 2 + e + 1/e for every c      -> IS = 1
    {(2,0), (-2,0), (0,1), (0,-1)}:  Z(+-e1) = 2 + e^2 + e^-2 = 9.5244,
                                      Z(+-e2) = 2 + e + e^-1   = 5.0862  -> IS = 0.534014

Eigenvectors of a repeated eigenvalue (e.g. V^T V = 2I above) are any orthonormal
basis of that eigenspace; the score then depends on the basis LAPACK returns, as it
does in every implementation of this definition. When n < d, V^T V has zero
eigenvalues whose eigenvectors are orthogonal to every v, so Z = n there.

The embeddings are used as given (not centred, not normalised): pass L2-normalised
embeddings to score the space that retrieval uses. Computed in float64 with a
log-sum-exp per direction, so large norms do not overflow:
IS = exp(min_c log Z(c) - max_c log Z(c)). Cost: one (d, d) Gram matrix and its
eigendecomposition, O(n d^2 + d^3), plus the (n, 2d) projections.

numpy only (the index package never imports torch).
"""

from __future__ import annotations

import numpy as np

__all__ = ["isotropy_score"]


def _check(X: object) -> np.ndarray:
    if not isinstance(X, np.ndarray):
        raise TypeError(f"X must be a numpy array (n, d); got {type(X).__name__}")
    if X.ndim != 2:
        raise ValueError(f"X must be a 2-D array (n, d); got shape {X.shape}")
    if not np.issubdtype(X.dtype, np.floating):
        raise ValueError(f"X must be a float array; got dtype {X.dtype}")
    if X.shape[0] < 1 or X.shape[1] < 1:
        raise ValueError(f"X needs at least one vector of dimension >= 1; got shape {X.shape}")
    if not np.isfinite(X).all():
        raise ValueError("X contains NaN or infinite values")
    return X.astype(np.float64, copy=False)


def _logsumexp_columns(a: np.ndarray) -> np.ndarray:
    """log(sum_rows exp(a)) per column of a finite (n, m) array, without overflow."""
    top = a.max(axis=0)
    return top + np.log(np.exp(a - top).sum(axis=0))


def isotropy_score(X: np.ndarray) -> float:
    """Isotropy score in (0, 1] of the rows of `X` (n, d); 1 is perfectly isotropic.

    min over c of Z(c) / max over c of Z(c), c in {+u, -u} for the unit eigenvectors u
    of X^T X (see the module docstring for the definition and the reading of C).

    Raises TypeError if X is not a numpy array, ValueError if it is not 2-D, not a float
    dtype, empty, or holds NaN / inf.
    """
    V = _check(X)
    _, eigvecs = np.linalg.eigh(V.T @ V)  # columns: orthonormal eigenvectors, (d, d)
    directions = np.concatenate([eigvecs, -eigvecs], axis=1)  # (d, 2d): +u and -u
    log_z = _logsumexp_columns(V @ directions)  # (2d,) log Z(c)
    return float(np.exp(log_z.min() - log_z.max()))
