"""L2 normalisation (index/unit_vectors.py) on every path that makes a unit vector: any
finite vector that is not all zero becomes a unit vector, however small or large its
values (float32 would underflow or overflow computing its norm); alpha-QE never
searches with a vector that has no direction; the service accepts what is finite."""

from __future__ import annotations

import numpy as np
import pytest
from app_client import AUTH, make_client

from vitrieval.index.fusion import FusionError, fuse_mean
from vitrieval.index.query import AQE, search_store
from vitrieval.index.rerank import augment_database, expand_queries
from vitrieval.index.store import IndexStore
from vitrieval.index.unit_vectors import l2_normalize, unit_rows

DIM = 128
SCALES = [1e-22, 1e-40, 1e-300, 1e30, 1e200, 1.0]
"""1e-22 squared underflows float32 (a cosine of 1.0097 came back); 1e-40 is a float32
subnormal; 1e30 squared overflows float32, 1e200 float64."""


def direction(scale: float) -> np.ndarray:
    """A fixed direction, as values of about `scale` (float64)."""
    v = np.linspace(1.0, 2.0, DIM) * np.where(np.arange(DIM) % 2, -1.0, 1.0)
    return v * scale


EXPECTED = (direction(1.0) / np.linalg.norm(direction(1.0))).astype(np.float32)


@pytest.mark.parametrize("scale", SCALES)
def test_any_finite_nonzero_row_becomes_the_same_unit_vector(scale: float) -> None:
    unit, ok = unit_rows(direction(scale)[None, :])
    assert ok.tolist() == [True] and unit.dtype == np.float32
    assert float(np.linalg.norm(unit[0].astype(np.float64))) == pytest.approx(1.0, abs=1e-6)
    assert np.allclose(unit[0], EXPECTED, atol=1e-6)


def test_rows_without_a_direction_are_flagged_and_zero() -> None:
    rows = np.stack([np.zeros(4), [np.nan, 1, 1, 1], [np.inf, 1, 1, 1], [3.0, 0, 4, 0]])
    unit, ok = unit_rows(rows)
    assert ok.tolist() == [False, False, False, True]
    assert (unit[:3] == 0).all() and unit[3].tolist() == pytest.approx([0.6, 0, 0.8, 0])
    assert l2_normalize(rows[3:]).tolist() == unit[3:].tolist()


def test_alpha_qe_never_searches_with_a_cancelled_or_non_finite_sum() -> None:
    q = np.array([[1.0, 0.0, 0.0]], np.float32)
    # alpha 0 weighs every neighbour 1, -q included: q + (-q) = 0 has no direction
    cancelled = expand_queries(q, -q[:, None, :], np.array([[-1.0]], np.float32), 0.0)
    assert cancelled.tolist() == q.tolist()
    nearly = expand_queries(q, -q[:, None, :] * (1 - 1e-8), np.array([[-1.0]], np.float32), 0.0)
    assert nearly.tolist() == q.tolist()
    # rows are independent: one row falls back, the other is expanded
    two = np.array([[1.0, 0, 0], [0, 1.0, 0]], np.float32)
    neighbours = np.array([[[-1.0, 0, 0]], [[1.0, 0, 0]]], np.float32)
    out = expand_queries(two, neighbours, np.zeros((2, 1), np.float32), 0.0)
    assert out[0].tolist() == [1.0, 0, 0]
    assert out[1] == pytest.approx(np.array([1, 1, 0]) / np.sqrt(2))
    # DBA uses the same expansion: a vector cancelled by its neighbour keeps itself
    pool = np.array([[1.0, 0, 0], [-1.0, 0, 0]], np.float32)
    dba = augment_database(pool, np.array([[1], [0]]), np.array([[-1.0], [-1.0]]), 0.0)
    assert dba.tolist() == pool.tolist()


def test_alpha_qe_with_alpha_0_scores_the_opposite_item_minus_1(tmp_path) -> None:
    store = IndexStore.create(tmp_path / "idx", dim=3, factory="Flat")
    store.add(["minus"], np.array([[-1.0, 0, 0]], np.float32))
    # q's one hit is -q (score -1, weight 0^0 = 1): q + (-q) = 0, so q is searched as
    # it is; a zero vector would have scored every item 0.0
    found = search_store(store, np.array([[1.0, 0, 0]], np.float32), 1, rerank=AQE(1, 0.0))
    assert [(hit.key, hit.score) for _, hit in found[0]] == [("minus", -1.0)]


def test_fuse_mean_normalises_in_float64_and_refuses_cancelled_images() -> None:
    assert fuse_mean(np.stack([EXPECTED, EXPECTED])) == pytest.approx(EXPECTED, abs=1e-6)
    with pytest.raises(FusionError, match="cancel"):
        fuse_mean(np.stack([EXPECTED, -EXPECTED]))


@pytest.mark.parametrize("scale", [1e-22, 1e30, 1e300])
def test_the_service_adds_and_searches_with_tiny_and_huge_vectors(
    digits_gallery, served_index, scale: float
) -> None:
    values = direction(scale).tolist()
    with make_client(digits_gallery["model"], served_index) as client:
        added = client.post("/v1/items", json={"key": "scaled", "vector": values}, headers=AUTH)
        assert added.status_code == 201, added.text
        stored = client.get("/v1/items/scaled", params={"vector": True}).json()["vector"]
        assert np.allclose(stored, EXPECTED, atol=1e-6)
        found = client.post("/v1/search", json={"vector": values, "k": 1}).json()["hits"]
        assert found[0]["key"] == "scaled" and found[0]["score"] == pytest.approx(1.0, abs=1e-5)
        assert found[0]["score"] <= 1.0 + 1e-6
        for bad, why in (("0.0", "all zeros"), ("1e999", "not a finite number")):
            body = '{"vector": [' + ", ".join([bad] * DIM) + "]}"
            refused = client.post(
                "/v1/search", content=body, headers={"content-type": "application/json"}
            )
            assert refused.status_code == 422 and why in refused.json()["detail"]
