"""Several query images as one query (index/fusion.py) and alpha-QE re-ranking
(index/query.py), on a real store against naive numpy references: max fusion equals
brute force over the max of the similarities, ties included; mean fusion is one search
of the normalised mean; alpha-QE equals top-n, the GeM paper's formula, then top-k."""

from __future__ import annotations

import json

import numpy as np
import pytest
from store_helpers import exact_vectors, unit_vectors, with_duplicates

from vitrieval.index.fusion import fuse_mean, merge_max
from vitrieval.index.pipeline.embeddings_folder import write_part
from vitrieval.index.query import AQE, MAX_AQE_NEIGHBOURS, Where, search_store, search_store_fused
from vitrieval.index.shards import open_index
from vitrieval.index.shards.build import build_shard, build_sharded
from vitrieval.index.store import Hit, IndexStore
from vitrieval.index.store.filters import parse_filter

COLOURS = ("red", "blue", "green")


def catalogue(directory, x: np.ndarray) -> tuple[IndexStore, list[dict]]:
    """A Flat store over `x`, keys str(row), with a colour and a price per item."""
    metadata = [{"colour": COLOURS[i % 3], "price": i % 50} for i in range(len(x))]
    store = IndexStore.create(directory, dim=x.shape[1], factory="Flat")
    store.add([str(i) for i in range(len(x))], x, metadata=metadata)
    return store, metadata


def max_reference(
    images: np.ndarray, x: np.ndarray, k: int, allowed: np.ndarray | None = None
) -> list[tuple[int, float]]:
    """Brute force: every item's max similarity to the images, descending, ties by row."""
    best = (images.astype(np.float64) @ x.astype(np.float64).T).max(axis=0)
    rows = np.arange(len(x)) if allowed is None else np.flatnonzero(allowed)
    order = np.lexsort((rows, -best[rows]))[:k]
    return [(int(rows[i]), float(best[rows[i]])) for i in order]


def pairs(found: list[tuple[int, Hit]]) -> list[tuple[int, float]]:
    return [(int(h.key), h.score) for _, h in found]


# -- fuse_mean and merge_max alone -------------------------------------------------------


def test_fuse_mean_is_the_normalised_mean_and_refuses_a_zero_mean() -> None:
    x = unit_vectors(np.random.default_rng(0), 3, 16)
    fused = fuse_mean(x)
    mean = x.mean(axis=0)
    np.testing.assert_allclose(fused, mean / np.linalg.norm(mean), atol=1e-6)
    assert fused.dtype == np.float32 and fused.shape == (16,)
    np.testing.assert_allclose(fuse_mean(x[:1]), x[0], atol=1e-6)
    with pytest.raises(ValueError, match="cancel"):
        fuse_mean(np.stack([x[0], -x[0]]))
    with pytest.raises(ValueError):
        fuse_mean(np.zeros((0, 16), dtype=np.float32))


def test_merge_max_keeps_each_keys_best_score_and_orders_ties_by_id() -> None:
    a = [(5, Hit("a", 0.9, None, None)), (2, Hit("b", 0.5, None, None))]
    b = [(2, Hit("b", 0.95, None, None)), (7, Hit("c", 0.9, None, None))]
    c = [(1, Hit("d", 0.9, None, None))]
    merged = merge_max([a, b, c], 3)
    assert [(i, h.key, h.score) for i, h in merged] == [
        (2, "b", 0.95),
        (1, "d", 0.9),
        (5, "a", 0.9),
    ]
    assert merge_max([[], []], 3) == []


# -- max fusion against brute force -------------------------------------------------------


@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_max_fusion_equals_brute_force_over_the_max_of_similarities(tmp_path, m) -> None:
    rng = np.random.default_rng(m)
    x = with_duplicates(exact_vectors(rng, 400, 32), copies=3, originals=20)  # exact ties
    store, metadata = catalogue(tmp_path / "index", x)
    # query images: some are stored items (their duplicates tie), some are not
    images = np.concatenate([x[rng.choice(20, size=(m + 1) // 2, replace=False)],
                             exact_vectors(rng, m // 2, 32)])  # fmt: skip
    for k in (1, 4, 10, 50):
        found = search_store_fused(store, images, k, fusion="max")
        assert pairs(found) == max_reference(images, x, k), k
    # with a filter: brute force over the allowed items only
    raw = {"must": [{"key": "colour", "match": {"any": ["red", "green"]}}]}
    flt = parse_filter(raw)
    allowed = np.array([flt.matches(None, md) for md in metadata])
    found = search_store_fused(store, images, 10, fusion="max", where=Where(filter=raw))
    assert pairs(found) == max_reference(images, x, 10, allowed)
    # and with keys left out
    excluded = [str(i) for i, _ in max_reference(images, x, 3)]
    allowed = np.ones(len(x), dtype=bool)
    allowed[[int(e) for e in excluded]] = False
    found = search_store_fused(store, images, 10, fusion="max", where=Where(exclude_keys=excluded))
    assert pairs(found) == max_reference(images, x, 10, allowed)


def test_max_fusion_on_a_sharded_index_equals_one_store(tmp_path) -> None:
    rng = np.random.default_rng(7)
    x = with_duplicates(exact_vectors(rng, 300, 32), copies=2, originals=10)
    emb = tmp_path / "emb"
    write_part(emb / "part-00000.parquet", [str(i) for i in range(len(x))], x)
    (emb / "embeddings.json").write_text(json.dumps({"dim": 32, "model_fingerprint": "f" * 64}))
    jobs = lambda js: [build_shard(**job) for job in js]  # noqa: E731
    build_sharded(emb, tmp_path / "sharded", "", "Flat", 3, 256, run_shards=jobs)
    build_sharded(emb, tmp_path / "single", "", "Flat", 1, 256, run_shards=jobs)
    images = np.stack([x[0], x[5], exact_vectors(rng, 1, 32)[0]])
    with open_index(tmp_path / "sharded") as sharded, open_index(tmp_path / "single") as single:
        assert len(sharded.shards) == 3
        stored = np.stack([single.get(str(i)).vector for i in range(len(x))])  # normalised
        found = search_store_fused(sharded, images, 20, fusion="max")
        reference = max_reference(images, stored, 20)
        assert [i for i, _ in pairs(found)] == [i for i, _ in reference]
        assert [s for _, s in pairs(found)] == pytest.approx([s for _, s in reference], abs=1e-6)
        assert found == search_store_fused(single, images, 20, fusion="max")
        expanded = search_store(sharded, images, 5, rerank=AQE(3, 3.0))
        assert expanded == search_store(single, images, 5, rerank=AQE(3, 3.0))


def test_mean_fusion_is_one_search_of_the_normalised_mean(tmp_path) -> None:
    rng = np.random.default_rng(3)
    x = unit_vectors(rng, 300, 32)
    store, _ = catalogue(tmp_path / "index", x)
    images = x[:3]
    found = search_store_fused(store, images, 10, fusion="mean")
    direct = store.search(fuse_mean(images)[None, :], 10)[0]
    assert [h for _, h in found] == direct
    # one image: its own search, whatever the fusion
    for fusion in ("mean", "max"):
        one = search_store_fused(store, x[4:5], 5, fusion=fusion)
        assert [h for _, h in one] == store.search(x[4:5], 5)[0]
    with pytest.raises(ValueError, match="fusion"):
        search_store_fused(store, images, 10, fusion="median")  # type: ignore[arg-type]


# -- alpha-QE ------------------------------------------------------------------------


def aqe_reference(
    q: np.ndarray, x: np.ndarray, n: int, alpha: float, allowed: np.ndarray
) -> np.ndarray:
    """q' = normalise(q + sum_i max(s_i, 0)^alpha x_i) over q's top n allowed items."""
    out = []
    for query in q.astype(np.float64):
        s = x.astype(np.float64) @ query
        rows = np.flatnonzero(allowed)
        top = rows[np.lexsort((rows, -s[rows]))[:n]]
        expanded = query + (np.clip(s[top], 0, None) ** alpha) @ x[top].astype(np.float64)
        out.append(expanded / np.linalg.norm(expanded))
    return np.array(out)


def top_k(q: np.ndarray, x: np.ndarray, k: int, allowed: np.ndarray) -> list[list[int]]:
    rows = np.flatnonzero(allowed)
    s = q @ x[rows].astype(np.float64).T
    return [[int(rows[i]) for i in np.lexsort((rows, -r))[:k]] for r in s]


@pytest.mark.parametrize(("n", "alpha"), [(1, 3.0), (2, 3.0), (5, 0.0), (10, 1.5)])
def test_alpha_qe_equals_top_n_the_formula_then_top_k(tmp_path, n, alpha) -> None:
    rng = np.random.default_rng(n)
    x = unit_vectors(rng, 500, 32)
    store, metadata = catalogue(tmp_path / "index", x)
    # queries near stored items, so their neighbours carry weight
    q = x[:6] + 0.3 * unit_vectors(rng, 6, 32)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    everything = np.ones(len(x), dtype=bool)
    found = search_store(store, q, 10, rerank=AQE(n, alpha))
    expected = top_k(aqe_reference(q, x, n, alpha, everything), x, 10, everything)
    assert [[int(h.key) for _, h in row] for row in found] == expected
    # the expanded query differs from the plain one (the test would be vacuous if not)
    assert expected != top_k(q.astype(np.float64), x, 10, everything)

    # the filter and the exclusions hold in both searches
    raw = {"must": [{"key": "price", "range": {"gte": 10, "lt": 40}}]}
    flt = parse_filter(raw)
    allowed = np.array([flt.matches(None, md) for md in metadata])
    allowed[[1, 2]] = False
    where = Where(filter=raw, exclude_keys=["1", "2"])
    found = search_store(store, q, 10, where=where, rerank=AQE(n, alpha))
    expected = top_k(aqe_reference(q, x, n, alpha, allowed), x, 10, allowed)
    assert [[int(h.key) for _, h in row] for row in found] == expected


def test_alpha_qe_with_fewer_hits_than_n_and_with_max_fusion(tmp_path) -> None:
    rng = np.random.default_rng(11)
    x = unit_vectors(rng, 200, 32)
    store, metadata = catalogue(tmp_path / "index", x)
    # a filter allowing 4 items: n = 10 expands with the 4 there are
    raw = {"must": [{"key": "price", "range": {"lt": 1}}]}
    allowed = np.array([md["price"] < 1 for md in metadata])
    assert allowed.sum() == 4
    found = search_store(store, x[:2], 3, where=Where(filter=raw), rerank=AQE(10, 3.0))
    expected = top_k(aqe_reference(x[:2], x, 10, 3.0, allowed), x, 3, allowed)
    assert [[int(h.key) for _, h in row] for row in found] == expected
    # max fusion with alpha-QE: each image expanded on its own, then merged by max
    images = x[10:13]
    fused = search_store_fused(store, images, 8, fusion="max", rerank=AQE(3, 2.0))
    everything = np.ones(len(x), dtype=bool)
    expanded = aqe_reference(images, x, 3, 2.0, everything)
    best = (expanded @ x.astype(np.float64).T).max(axis=0)
    assert [int(h.key) for _, h in fused] == [int(i) for i in np.argsort(-best)[:8]]


def test_alpha_qe_parameters_are_checked() -> None:
    assert AQE() == AQE(2, 3.0)
    for bad in (
        {"neighbours": 0},
        {"neighbours": MAX_AQE_NEIGHBOURS + 1},
        {"neighbours": 2.5},
        {"neighbours": True},
        {"alpha": -1.0},
        {"alpha": float("nan")},
        {"alpha": float("inf")},
        {"alpha": 1000.0},
    ):
        with pytest.raises(ValueError, match="alpha-QE"):
            AQE(**bad)
