"""Database-side augmentation in the store: the DBA vector set a merge writes, against
a naive reference computed here; switching it on and off; persistence and checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from store_helpers import flip_byte, unit_vectors

from index.store import IndexStore, StoreError

N, DIM = 400, 16


def naive_dba(x: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """x_i' = normalise(x_i + sum over its n nearest others j of s_ij^alpha x_j)."""
    out = np.empty_like(x)
    for i in range(len(x)):
        scores = [(float(x[i] @ x[j]), j) for j in range(len(x)) if j != i]
        scores.sort(key=lambda t: (-t[0], t[1]))
        v = x[i].astype(np.float64).copy()
        for s, j in scores[:n]:
            v += max(s, 0.0) ** alpha * x[j]
        out[i] = v / np.linalg.norm(v)
    return out


def ranked(queries: np.ndarray, vectors: np.ndarray, k: int, allowed=None) -> list[list[str]]:
    scores = queries @ vectors.T
    if allowed is not None:
        scores[:, ~allowed] = -np.inf
    return [[str(i) for i in np.lexsort((np.arange(len(vectors)), -row))[:k]] for row in scores]


def built(directory: Path, x: np.ndarray, factory: str, colours: list[str]) -> IndexStore:
    store = IndexStore.create(directory, dim=x.shape[1], factory=factory)
    if store.needs_training():
        store.train(x)
    half = len(x) // 2
    for part in (slice(0, half), slice(half, len(x))):  # two segments, merged below
        keys = [str(i) for i in range(len(x))][part]
        store.add(keys, x[part], metadata=[{"colour": c} for c in colours[part]])
        store.save()
    return store


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat"])
def test_augmented_search_ranks_against_the_naive_dba_vectors(tmp_path: Path, factory) -> None:
    rng = np.random.default_rng(0)
    x = unit_vectors(rng, N, DIM)
    colours = [("red", "blue")[i % 2] for i in range(N)]
    queries = unit_vectors(rng, 8, DIM)
    store = built(tmp_path / "idx", x, factory, colours)
    if factory.startswith("IVF"):
        store.set_search_params(nprobe=8)  # every list: the comparison is exact
    plain = store.search(queries, 10)
    store.set_dba(3, 2.0)
    assert store.merge(everything=True, rewrite=True) == 2
    reference = naive_dba(x, 3, 2.0)
    hits = store.search(queries, 10, augmented=True)
    assert [[h.key for h in row] for row in hits] == ranked(queries, reference, 10)
    expected = queries @ reference.T
    assert max(abs(h.score - expected[q, int(h.key)]) for q, r in enumerate(hits) for h in r) < 1e-5
    assert store.search(queries, 10) == plain  # the plain vectors are untouched
    # with a filter, also on the exact-subset path (the DBA vectors file or flat codes)
    red = np.array([c == "red" for c in colours])
    flt = {"must": [{"key": "colour", "match": "red"}]}
    got = store.search(queries, 10, augmented=True, filter=flt)
    assert [[h.key for h in row] for row in got] == ranked(queries, reference, 10, red)
    store.close()
    with IndexStore.open(tmp_path / "idx", verify=True) as again:  # committed and checksummed
        assert again.info()["dba"] == {"neighbours": 3, "alpha": 2.0, "live_items_with_dba": N}
        if factory.startswith("IVF"):
            again.set_search_params(nprobe=8)
        assert again.search(queries, 10, augmented=True) == hits


def test_new_items_are_ranked_plain_until_merged_and_dba_switches_off(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = unit_vectors(rng, N, DIM)
    store = built(tmp_path / "idx", x, "Flat", ["red"] * N)
    store.set_dba(2, 3.0)
    store.merge(everything=True, rewrite=True)
    extra = unit_vectors(rng, 1, DIM)
    store.add(["new"], extra)
    store.save()  # sealed without a DBA set: searched by its plain vector
    top = store.search(extra, 1, augmented=True)[0][0]
    assert top.key == "new" and top.score == pytest.approx(1.0, abs=1e-5)
    assert store.info()["dba"]["live_items_with_dba"] == N
    store.set_dba(None)
    store.save()
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["dba"] is None
    with pytest.raises(StoreError, match="has no DBA vectors: compute them with"):
        store.search(extra, 1, augmented=True)
    with pytest.raises(StoreError, match="DBA neighbours must be between 1 and"):
        store.set_dba(0)
    with pytest.raises(StoreError, match="alpha must be a number >= 0"):
        store.set_dba(2, -1.0)
    store.close()


def test_a_damaged_dba_file_fails_verification(tmp_path: Path) -> None:
    x = unit_vectors(np.random.default_rng(2), 200, DIM)
    store = built(tmp_path / "idx", x, "IVF4,Flat", ["red"] * 200)
    store.set_dba(2, 3.0)
    store.merge(everything=True, rewrite=True)
    number = store._state.sealed[0].number
    store.close()
    names = sorted(p.name for p in (tmp_path / "idx").glob(f"seg.{number}.dba.*"))
    assert names == [f"seg.{number}.dba.faiss", f"seg.{number}.dba.npy"]
    flip_byte(tmp_path / "idx" / f"seg.{number}.dba.npy", 200)
    with pytest.raises(StoreError, match=f"seg.{number}.dba.npy"):
        IndexStore.open(tmp_path / "idx", verify=True)
