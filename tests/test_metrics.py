"""Tests for index.evaluation.metrics.retrieval_metrics: hand-computed cases, the tie rule, a naive
reference on random data, pytorch-metric-learning as an optional reference, validation."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from vitrieval.index.evaluation.metrics import metric_names, retrieval_metrics

METRIC_KEYS = ("map", "map_at_r", "r_precision")


def unit_vectors(degrees: list[float]) -> np.ndarray:
    """(N, 2) float32 unit vectors (cos a, sin a) for angles in degrees."""
    a = np.deg2rad(np.asarray(degrees, dtype=np.float64))
    return np.stack([np.cos(a), np.sin(a)], axis=1).astype(np.float32)


def quantised_unit_vectors(rng: np.random.Generator, n: int, dim: int, step: float) -> np.ndarray:
    """Random (almost) unit vectors whose coordinates are multiples of `step` (a power of 2).

    With step = 2**-11 and norms about 1, every product is a multiple of 2**-22 and every
    partial sum of a dot product stays below 2 in magnitude, so float32 and float64 dot
    products are exact whatever the summation order: the ranking, ties included, is the
    same in the function under test (float32 BLAS, any chunking) and in the reference.
    Coarser steps produce many exactly tied scores.
    """
    x = rng.standard_normal((n, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return (np.round(x / step) * step).astype(np.float32)


def reference_metrics(queries, query_labels, gallery, gallery_labels, ks, leave_one_out):
    """Naive metrics: a full ranking per query by (descending score, ascending index)."""
    q = np.asarray(queries, dtype=np.float64)
    g = np.asarray(gallery, dtype=np.float64)
    per_query: dict[str, list[float]] = {f"recall@{k}": [] for k in ks}
    per_query.update({f"precision@{k}": [] for k in ks})
    per_query.update({key: [] for key in METRIC_KEYS})
    dropped = 0
    for i in range(len(q)):
        idx = np.arange(len(g))
        if leave_one_out:
            idx = idx[idx != i]
        scores = g[idx] @ q[i]
        order = idx[np.lexsort((idx, -scores))]  # primary: score descending; then index
        rel = [gallery_labels[j] == query_labels[i] for j in order]
        n_rel = sum(rel)
        if n_rel == 0:
            dropped += 1
            continue
        hits = 0
        precision_sum = 0.0
        precision_sum_at_r = 0.0
        for pos, is_rel in enumerate(rel, start=1):
            if is_rel:
                hits += 1
                precision_sum += hits / pos
                if pos <= n_rel:
                    precision_sum_at_r += hits / pos
        for k in ks:
            per_query[f"recall@{k}"].append(float(any(rel[:k])))
            per_query[f"precision@{k}"].append(sum(rel[:k]) / k)
        per_query["map"].append(precision_sum / n_rel)
        per_query["map_at_r"].append(precision_sum_at_r / n_rel)
        per_query["r_precision"].append(sum(rel[:n_rel]) / n_rel)
    out: dict[str, float | int] = {
        key: (float(np.mean(v)) if v else math.nan) for key, v in per_query.items()
    }
    out["n_queries"] = len(q) - dropped
    out["n_dropped"] = dropped
    return out


def assert_same_metrics(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        if key.startswith("n_"):
            assert got[key] == value, key
        else:
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


# --- hand-computed cases ---------------------------------------------------------------


def test_issue_example_leave_one_out():
    # Angles 0, 12, 50, 20, 95 degrees, labels [0, 0, 0, 1, 1]; cosine ranking = ranking
    # by angular distance. Per query (gallery = the four others), ranking by distance:
    #   q0 (0, label 0):  12(1) 20(3) 50(2) 95(4)  relevant {1, 2} at ranks 1, 3
    #       R@1 1, R@2 1, AP (1/1 + 2/3)/2 = 5/6, R = 2: RP 1/2, MAP@R (1/1)/2 = 1/2
    #   q1 (12, label 0): 8(3) 12(0) 38(2) 83(4)   relevant {0, 2} at ranks 2, 3
    #       R@1 0, R@2 1, AP (1/2 + 2/3)/2 = 7/12, RP 1/2, MAP@R (1/2)/2 = 1/4
    #   q2 (50, label 0): 30(3) 38(1) 45(4) 50(0)  relevant {1, 0} at ranks 2, 4
    #       R@1 0, R@2 1, AP (1/2 + 2/4)/2 = 1/2, RP 1/2, MAP@R (1/2)/2 = 1/4
    #   q3 (20, label 1): 8(1) 20(0) 30(2) 75(4)   relevant {4} at rank 4
    #       R@1 0, R@2 0, AP 1/4, R = 1: RP 0, MAP@R 0
    #   q4 (95, label 1): 45(2) 75(3) 83(1) 95(0)  relevant {3} at rank 2
    #       R@1 0, R@2 1, AP 1/2, RP 0, MAP@R 0
    # Means: R@1 1/5 = 0.2; R@2 4/5 = 0.8; mAP (5/6 + 7/12 + 1/2 + 1/4 + 1/2)/5 = 8/15
    # = 0.533333; RP (1/2 * 3)/5 = 0.3; MAP@R (1/2 + 1/4 + 1/4)/5 = 0.2.
    # P@1 = R@1 = 0.2; P@2: relevant in the top 2 = 1, 1, 1, 0, 1 -> (4/2)/5 = 0.4.
    x = unit_vectors([0, 12, 50, 20, 95])
    m = retrieval_metrics(x, [0, 0, 0, 1, 1], ks=(1, 2))
    assert m["recall@1"] == pytest.approx(0.2, abs=1e-5)
    assert m["recall@2"] == pytest.approx(0.8, abs=1e-5)
    assert m["map"] == pytest.approx(0.533333, abs=1e-5)
    assert m["r_precision"] == pytest.approx(0.3, abs=1e-5)
    assert m["map_at_r"] == pytest.approx(0.2, abs=1e-5)
    assert m["precision@1"] == pytest.approx(0.2, abs=1e-12)
    assert m["precision@2"] == pytest.approx(0.4, abs=1e-12)
    assert m["n_queries"] == 5
    assert m["n_dropped"] == 0
    assert set(m) == {
        "recall@1",
        "recall@2",
        "precision@1",
        "precision@2",
        "map",
        "map_at_r",
        "r_precision",
        "n_queries",
        "n_dropped",
    }


def test_issue_example_lone_query_dropped():
    # Angles 0, 30, 100, labels [0, 0, 1]: items 0 and 1 are each other's nearest
    # neighbour (30 degrees against 100 and 70), so R@1 = AP = 1; item 2 has no other
    # item of its class and is dropped.
    m = retrieval_metrics(unit_vectors([0, 30, 100]), [0, 0, 1], ks=(1,))
    assert m["recall@1"] == 1.0
    assert m["map"] == 1.0
    assert m["map_at_r"] == 1.0
    assert m["r_precision"] == 1.0
    assert m["n_queries"] == 2
    assert m["n_dropped"] == 1


def test_query_gallery_hand_computed():
    # Gallery: g0 0 deg "a", g1 40 deg "b", g2 90 deg "a", g3 180 deg "b".
    #   q0 10 deg "a": distances 10, 30, 80, 170 -> order g0 g1 g2 g3; relevant ranks 1, 3
    #       R@1 1, R@2 1, P@1 1, P@2 1/2, AP (1 + 2/3)/2 = 5/6, RP 1/2, MAP@R 1/2
    #   q1 100 deg "b": distances 100, 60, 10, 80 -> order g2 g1 g3 g0; relevant ranks 2, 3
    #       R@1 0, R@2 1, P@1 0, P@2 1/2, AP (1/2 + 2/3)/2 = 7/12, RP 1/2, MAP@R 1/4
    #   q2 45 deg "c": no "c" in the gallery -> dropped.
    # Means over q0, q1: R@1 1/2, R@2 1, P@1 1/2, P@2 1/2, mAP 17/24, RP 1/2, MAP@R 3/8.
    gallery = unit_vectors([0, 40, 90, 180])
    queries = unit_vectors([10, 100, 45])
    m = retrieval_metrics(
        queries,
        ["a", "b", "c"],
        ks=(1, 2),
        gallery_embeddings=gallery,
        gallery_labels=["a", "b", "a", "b"],
    )
    assert m["recall@1"] == pytest.approx(0.5)
    assert m["recall@2"] == pytest.approx(1.0)
    assert m["precision@1"] == pytest.approx(0.5)
    assert m["precision@2"] == pytest.approx(0.5)
    assert m["map"] == pytest.approx(17 / 24)
    assert m["r_precision"] == pytest.approx(0.5)
    assert m["map_at_r"] == pytest.approx(3 / 8)
    assert m["n_queries"] == 2
    assert m["n_dropped"] == 1


def test_query_gallery_excludes_nothing():
    # A query identical to a gallery item of its own class finds it first; in
    # leave-one-out over the gallery that item would be excluded and q0's nearest other
    # item (30 deg, other class) would come first.
    gallery = unit_vectors([0, 30, 90])
    g_labels = [0, 1, 0]
    with_gallery = retrieval_metrics(
        gallery[:1], [0], ks=(1,), gallery_embeddings=gallery, gallery_labels=g_labels
    )
    assert with_gallery["recall@1"] == 1.0
    assert with_gallery["map"] == pytest.approx((1 / 1 + 2 / 3) / 2)
    loo = retrieval_metrics(gallery, g_labels, ks=(1,))
    # q0: order 30(1) 90(2) -> relevant rank 2; q1 (label 1) dropped; q2: order 30(1) 0(0).
    assert loo["recall@1"] == 0.0
    assert loo["map"] == pytest.approx(0.5)
    assert loo["n_dropped"] == 1


def test_labels_strings_ints_and_arrays_agree():
    x = unit_vectors([0, 12, 50, 20, 95])
    as_ints = retrieval_metrics(x, [0, 0, 0, 1, 1], ks=(1, 2))
    as_strings = retrieval_metrics(x, ["cat", "cat", "cat", "dog", "dog"], ks=(1, 2))
    as_array = retrieval_metrics(x.astype(np.float64), np.array([7, 7, 7, 3, 3]), ks=(1, 2))
    assert as_strings == as_ints
    assert as_array == as_ints


def test_k_larger_than_gallery():
    # Two items per class, leave-one-out: one relevant item among 3 others.
    m = retrieval_metrics(unit_vectors([0, 10, 90, 100]), [0, 0, 1, 1], ks=(1, 8))
    assert m["recall@8"] == 1.0
    assert m["precision@8"] == pytest.approx(1 / 8)
    assert m["recall@1"] == 1.0


def test_all_queries_dropped_gives_nan():
    m = retrieval_metrics(unit_vectors([0, 10, 20]), [0, 1, 2], ks=(1, 2))
    assert m["n_queries"] == 0
    assert m["n_dropped"] == 3
    for key in ("recall@1", "recall@2", "precision@1", "precision@2", *METRIC_KEYS):
        assert math.isnan(m[key]), key


# --- ties -------------------------------------------------------------------------------


def test_tie_broken_by_lower_gallery_index():
    # Both gallery items score exactly 0.5 against the query: the one with the lower
    # gallery index ranks first, whichever class it belongs to.
    query = np.array([[1.0, 0.0]], dtype=np.float32)
    gallery = np.array([[0.5, 0.5], [0.5, -0.5]], dtype=np.float32)
    relevant_second = retrieval_metrics(
        query, ["a"], ks=(1,), gallery_embeddings=gallery, gallery_labels=["b", "a"]
    )
    assert relevant_second["recall@1"] == 0.0
    assert relevant_second["map"] == 0.5
    relevant_first = retrieval_metrics(
        query, ["a"], ks=(1,), gallery_embeddings=gallery, gallery_labels=["a", "b"]
    )
    assert relevant_first["recall@1"] == 1.0
    assert relevant_first["map"] == 1.0


def test_all_scores_tied_leave_one_out():
    # Six identical vectors: every score ties, so each query ranks the others by index.
    #   q0 (0): others 1 2 3 4 5 = labels 1 0 1 0 1 -> ranks 2, 4: AP 1/2, RP 1/2, MAP@R 1/4
    #   q1 (1): others 0 2 3 4 5 = 0 0 1 0 1 -> ranks 3, 5: AP 11/30, RP 0, MAP@R 0
    #   q2 (0): others 0 1 3 4 5 = 0 1 1 0 1 -> ranks 1, 4: AP 3/4, RP 1/2, MAP@R 1/2
    #   q3 (1): others 0 1 2 4 5 = 0 1 0 0 1 -> ranks 2, 5: AP 9/20, RP 1/2, MAP@R 1/4
    #   q4 (0): others 0 1 2 3 5 = 0 1 0 1 1 -> ranks 1, 3: AP 5/6, RP 1/2, MAP@R 1/2
    #   q5 (1): others 0 1 2 3 4 = 0 1 0 1 0 -> ranks 2, 4: AP 1/2, RP 1/2, MAP@R 1/4
    # R@1 = 2/6; mAP = 3.4/6; RP = 2.5/6; MAP@R = 1.75/6.
    x = np.tile(np.array([[0.6, 0.8]], dtype=np.float32), (6, 1))
    m = retrieval_metrics(x, [0, 1, 0, 1, 0, 1], ks=(1,))
    assert m["recall@1"] == pytest.approx(2 / 6)
    assert m["map"] == pytest.approx(3.4 / 6)
    assert m["r_precision"] == pytest.approx(2.5 / 6)
    assert m["map_at_r"] == pytest.approx(1.75 / 6)


def test_many_tied_relevant_items_follow_the_rule():
    # 60 identical vectors plus distinct ones: rows with more than a handful of tied
    # relevant items take the stable-argsort path; it must follow the same rule.
    rng = np.random.default_rng(3)
    same = np.tile(np.array([[1.0, 0.0, 0.0, 0.0]], dtype=np.float32), (60, 1))
    other = quantised_unit_vectors(rng, 40, 4, 2.0**-11)
    x = np.concatenate([same, other])
    labels = [i % 3 for i in range(100)]
    expected = reference_metrics(x, labels, x, labels, (1, 5, 30), leave_one_out=True)
    for chunk in (7, 1024):
        assert_same_metrics(retrieval_metrics(x, labels, ks=(1, 5, 30), chunk_size=chunk), expected)


# --- random data against the naive reference ----------------------------------------------


@pytest.mark.parametrize("step", [2.0**-11, 0.5], ids=["fine", "coarse-many-ties"])
@pytest.mark.parametrize("chunk_size", [1, 17, 1024])
def test_random_leave_one_out_matches_reference(step, chunk_size):
    rng = np.random.default_rng(0)
    x = quantised_unit_vectors(rng, 300, 16 if step < 0.1 else 4, step)
    labels = rng.integers(0, 7, size=300)
    labels[0] = 99  # a lone class: dropped
    ks = (1, 2, 4, 8, 50)
    expected = reference_metrics(x, labels, x, labels, ks, leave_one_out=True)
    got = retrieval_metrics(x, labels, ks=ks, chunk_size=chunk_size)
    assert_same_metrics(got, expected)
    assert got["n_dropped"] == 1
    if step < 0.1:
        assert 0.0 < got["map"] < 0.5  # random data: far from perfect, above nothing


@pytest.mark.parametrize("step", [2.0**-11, 0.5], ids=["fine", "coarse-many-ties"])
@pytest.mark.parametrize("chunk_size", [1, 17, 1024])
def test_random_query_gallery_matches_reference(step, chunk_size):
    rng = np.random.default_rng(1)
    dim = 16 if step < 0.1 else 4
    gallery = quantised_unit_vectors(rng, 300, dim, step)
    queries = quantised_unit_vectors(rng, 120, dim, step)
    g_labels = [f"c{v}" for v in rng.integers(0, 7, size=300)]
    q_labels = [f"c{v}" for v in rng.integers(0, 8, size=120)]  # "c7" is not in the gallery
    ks = (1, 3, 10)
    expected = reference_metrics(queries, q_labels, gallery, g_labels, ks, leave_one_out=False)
    got = retrieval_metrics(
        queries,
        q_labels,
        ks=ks,
        gallery_embeddings=gallery,
        gallery_labels=g_labels,
        chunk_size=chunk_size,
    )
    assert_same_metrics(got, expected)
    assert got["n_dropped"] == q_labels.count("c7") > 0


def test_chunk_size_does_not_change_results():
    rng = np.random.default_rng(2)
    x = quantised_unit_vectors(rng, 257, 8, 2.0**-11)
    labels = rng.integers(0, 5, size=257)
    results = [retrieval_metrics(x, labels, chunk_size=c) for c in (1, 17, 256, 257, 5000)]
    for r in results[1:]:
        assert r == results[0]


def test_memory_stays_bounded_by_the_chunk():
    # 3000 x 3000 float32 scores would need 36 MB; with chunk_size 50 a score block is
    # 0.6 MB. numpy reports its allocations to tracemalloc.
    rng = np.random.default_rng(4)
    x = quantised_unit_vectors(rng, 3000, 8, 2.0**-11)
    labels = rng.integers(0, 10, size=3000)
    tracemalloc.start()
    try:
        retrieval_metrics(x, labels, chunk_size=50)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20


# --- pytorch-metric-learning as a reference (test-only, optional) --------------------------


def test_agrees_with_pytorch_metric_learning():
    pytest.importorskip(
        "pytorch_metric_learning",
        reason="pytorch-metric-learning (test-only reference) is not installed",
    )
    import torch
    from pytorch_metric_learning.distances import DotProductSimilarity
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
    from pytorch_metric_learning.utils.inference import CustomKNN

    rng = np.random.default_rng(5)
    x = quantised_unit_vectors(rng, 120, 16, 2.0**-11)
    labels = rng.integers(0, 4, size=120)
    labels[0] = 50  # one lone item, dropped by both
    scores = x.astype(np.float64) @ x.astype(np.float64).T
    np.fill_diagonal(scores, np.nan)
    for row in scores:  # precondition: no tied scores, so tie handling cannot differ
        finite = row[~np.isnan(row)]
        assert np.unique(finite).size == finite.size, "test data has tied scores"

    calc = AccuracyCalculator(
        include=("precision_at_1", "r_precision", "mean_average_precision_at_r"),
        k="max_bin_count",
        knn_func=CustomKNN(DotProductSimilarity(normalize_embeddings=False)),
    )
    xt = torch.from_numpy(x)
    lt = torch.from_numpy(labels)
    ref = calc.get_accuracy(
        query=xt, query_labels=lt, reference=xt, reference_labels=lt, ref_includes_query=True
    )
    m = retrieval_metrics(x, labels, ks=(1,))
    assert m["n_dropped"] == 1
    assert m["recall@1"] == pytest.approx(float(ref["precision_at_1"]), abs=1e-6)
    assert m["r_precision"] == pytest.approx(float(ref["r_precision"]), abs=1e-6)
    assert m["map_at_r"] == pytest.approx(float(ref["mean_average_precision_at_r"]), abs=1e-6)


# --- validation -----------------------------------------------------------------------------


GOOD = unit_vectors([0, 10, 20, 30])
GOOD_LABELS = [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"embeddings": GOOD[0]}, "2-D"),
        ({"embeddings": np.zeros((0, 2), np.float32), "labels": []}, "empty"),
        ({"embeddings": np.ones((4, 2), dtype=np.int64)}, "float"),
        ({"embeddings": np.where(np.eye(4, 2) > 0, np.nan, GOOD)}, "NaN"),
        ({"labels": [0, 0, 1]}, "3 entries"),
        ({"labels": np.zeros((4, 1))}, "1-D"),
        ({"labels": "abcd"}, "single string"),
        ({"labels": [[0], [0], [1], [1]]}, "scalar"),
        ({"ks": 5}, "sequence"),
        ({"ks": (1, 0)}, "positive"),
        ({"ks": (1, 2.5)}, "positive"),
        ({"ks": (True,)}, "positive"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 2.0}, "chunk_size"),
        ({"gallery_embeddings": GOOD}, "without gallery_labels"),
        ({"gallery_labels": GOOD_LABELS}, "without gallery_embeddings"),
        (
            {"gallery_embeddings": np.ones((4, 3), np.float32), "gallery_labels": GOOD_LABELS},
            "dimension",
        ),
        ({"gallery_embeddings": GOOD, "gallery_labels": [0, 1]}, "gallery_labels has 2"),
        ({"embeddings": np.full((4, 2), 1e30, np.float32)}, "overflow"),
    ],
)
def test_invalid_input_raises(kwargs, message):
    args = {"embeddings": GOOD, "labels": GOOD_LABELS, **kwargs}
    with pytest.raises(ValueError, match=message):
        retrieval_metrics(**args)


def test_metric_names_are_the_means_retrieval_metrics_answers() -> None:
    # what a promote request may name (service/schemas.py) is what an evaluation holds
    rng = np.random.default_rng(3)
    x = rng.normal(size=(12, 4)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    for ks, labels in (((1, 5), [i % 3 for i in range(12)]), ((2,), list(range(12)))):
        answered = retrieval_metrics(x, labels, ks)  # the second: every query dropped, NaN
        assert list(answered) == [*metric_names(ks), "n_queries", "n_dropped"]
