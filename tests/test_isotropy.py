"""isotropy_score (Mu & Viswanath, min/max form) against hand values and a direct reference."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vitrieval.index.evaluation.metrics import isotropy_score


def reference_score(X: np.ndarray) -> float:
    """Direct evaluation: Z(c) = sum_v exp(c . v) for c = +-u over the eigenvectors u."""
    _, u = np.linalg.eigh(X.T @ X)
    z = [np.exp(X @ (s * u[:, k])).sum() for k in range(u.shape[1]) for s in (1.0, -1.0)]
    return min(z) / max(z)


def test_perfectly_isotropic_cross_scores_one():
    X = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    assert isotropy_score(X) == pytest.approx(1.0, abs=1e-12)


def test_stretched_cross():
    # X^T X = diag(8, 2): eigenvectors e1, e2.
    # Z(+-e1) = e^2 + e^-2 + 1 + 1 = 9.524391,  Z(+-e2) = 1 + 1 + e + e^-1 = 5.086161
    # IS = 5.086161 / 9.524391 = 0.534014
    X = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    expected = (2 + math.e + 1 / math.e) / (2 + math.e**2 + math.e**-2)
    assert isotropy_score(X) == pytest.approx(0.534014, abs=1e-6)
    assert isotropy_score(X) == pytest.approx(expected, abs=1e-12)


def test_returns_python_float_and_float32_works():
    X = np.random.default_rng(0).standard_normal((20, 5)).astype(np.float32)
    value = isotropy_score(X)
    assert type(value) is float
    assert value == pytest.approx(reference_score(X.astype(np.float64)), rel=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_matches_direct_reference(seed):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((30, 4)) + rng.standard_normal(4)  # not symmetric about 0
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    value = isotropy_score(X)
    assert 0 < value <= 1
    assert value == pytest.approx(reference_score(X), rel=1e-10)


def test_invariant_to_eigenvector_signs(monkeypatch):
    rng = np.random.default_rng(7)
    X = rng.standard_normal((25, 6)) + 2.0  # skewed set: Z(u) != Z(-u)
    before = isotropy_score(X)
    real_eigh = np.linalg.eigh

    def flipped_eigh(a):
        w, v = real_eigh(a)
        return w, v * np.array([(-1.0) ** k for k in range(v.shape[1])])

    monkeypatch.setattr(np.linalg, "eigh", flipped_eigh)
    assert isotropy_score(X) == pytest.approx(before, rel=1e-12)
    # ... and the one-sign reading would indeed have depended on it.
    _, u = real_eigh(X.T @ X)
    assert not np.isclose(np.exp(X @ u[:, 0]).sum(), np.exp(-X @ u[:, 0]).sum())


def test_invariant_to_rotation():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((40, 5)) * np.array([3.0, 2.0, 1.0, 0.5, 0.2]) + 0.3
    Q, _ = np.linalg.qr(rng.standard_normal((5, 5)))
    assert isotropy_score(X @ Q) == pytest.approx(isotropy_score(X), rel=1e-8)


def test_anisotropic_set_scores_low_and_large_norms_do_not_overflow():
    rng = np.random.default_rng(1)
    X = np.array([1.0, 0.0, 0.0]) + 0.01 * rng.standard_normal((50, 3))  # one cone
    assert isotropy_score(X) < 0.5
    big = isotropy_score(1000.0 * X)  # exp(1000) overflows without log-sum-exp
    assert math.isfinite(big) and 0 <= big < 1e-100


def test_fewer_vectors_than_dimensions():
    # Z(+e1) = e, Z(-e1) = 1/e, and the null-space directions have Z = n = 1.
    X = np.array([[1.0, 0.0, 0.0, 0.0]])
    assert isotropy_score(X) == pytest.approx(math.exp(-2.0), rel=1e-12)


@pytest.mark.parametrize(
    ("X", "error", "message"),
    [
        ([[1.0, 0.0], [0.0, 1.0]], TypeError, "numpy array"),
        (np.ones(3), ValueError, "2-D"),
        (np.ones((2, 2, 2)), ValueError, "2-D"),
        (np.ones((3, 2), dtype=np.int64), ValueError, "float"),
        (np.ones((3, 2), dtype=bool), ValueError, "float"),
        (np.ones((3, 2), dtype=np.complex128), ValueError, "float"),
        (np.ones((0, 2)), ValueError, "at least one"),
        (np.ones((2, 0)), ValueError, "at least one"),
        (np.array([[1.0, np.nan]]), ValueError, "NaN"),
        (np.array([[1.0, np.inf]]), ValueError, "NaN or infinite"),
    ],
)
def test_validation(X, error, message):
    with pytest.raises(error, match=message):
        isotropy_score(X)


def test_index_metrics_does_not_import_torch():
    code = (
        "import sys, index.evaluation.metrics, index.evaluation.isotropy; "
        "assert 'torch' not in sys.modules"
    )
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()
