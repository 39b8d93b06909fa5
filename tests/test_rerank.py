"""Re-ranking (index/rerank.py): alpha-QE and DBA against values worked out by hand on
2-D vectors, their edge cases (fewer neighbours than n, negative similarities, alpha
0), exact neighbours and their tie rule, chunking, the leave-one-out metrics of
re-ranked queries against a naive full sort, a clustered set where both must raise
mAP, and `vitrieval-index bench --rerank` end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py
from PIL import Image
from skimage import data as skdata

from vitrieval.index.evaluation.metrics import query_metrics, retrieval_metrics
from vitrieval.index.rerank import (
    METHODS,
    RerankSettings,
    aqe_vectors,
    augment_database,
    dba_vectors,
    exact_neighbours,
    expand_queries,
    leave_one_out_metrics,
    rerank_search,
    rerank_vectors,
)

# unit vectors at 0, 36.87, 53.13, 90 and 180 degrees: inner products 0.8, 0.6, 0, -1
# with Q = (1, 0)
Q = np.array([[1.0, 0.0]], dtype=np.float32)
G = np.array([[0.8, 0.6], [0.6, 0.8], [0.0, 1.0], [-1.0, 0.0]], dtype=np.float32)


def unit(*xy: float) -> np.ndarray:
    v = np.array(xy, dtype=np.float64)
    return v / math.sqrt(float(v @ v))


def test_expand_queries_by_hand():
    neighbours = G[None, :2]  # (1, 2, 2)
    scores = np.array([[0.8, 0.6]], dtype=np.float32)
    # alpha 1: (1, 0) + 0.8 (0.8, 0.6) + 0.6 (0.6, 0.8) = (2.0, 0.96)
    assert expand_queries(Q, neighbours, scores, 1.0)[0] == pytest.approx(unit(2.0, 0.96))
    # alpha 3: weights 0.512 and 0.216: (1 + 0.4096 + 0.1296, 0.3072 + 0.1728)
    assert expand_queries(Q, neighbours, scores, 3.0)[0] == pytest.approx(unit(1.5392, 0.48))
    # alpha 0: the plain average of the query and both neighbours
    assert expand_queries(Q, neighbours, scores, 0.0)[0] == pytest.approx(unit(2.4, 1.4))
    with pytest.raises(ValueError, match="needs"):
        expand_queries(Q, G, scores, 1.0)


def test_aqe_vectors_by_hand_and_the_edge_cases():
    ids, scores = exact_neighbours(Q, G, 2)
    assert ids.tolist() == [[0, 1]] and scores[0] == pytest.approx([0.8, 0.6])
    assert aqe_vectors(Q, G, 2, 1.0)[0] == pytest.approx(unit(2.0, 0.96))
    # every neighbour: similarities 0 and -1 weigh nothing once clipped (alpha > 0) ...
    assert aqe_vectors(Q, G, 4, 1.0)[0] == pytest.approx(unit(2.0, 0.96))
    # ... but alpha 0 is the plain average: (1 + 0.8 + 0.6 + 0 - 1, 0.6 + 0.8 + 1 + 0)
    assert aqe_vectors(Q, G, 4, 0.0)[0] == pytest.approx(unit(1.4, 2.4))
    # fewer gallery items than n: the missing slots are -1 and add nothing
    ids, scores = exact_neighbours(Q, G[:2], 5)
    assert ids.tolist() == [[0, 1, -1, -1, -1]] and scores[0, 2:].tolist() == [0, 0, 0]
    assert aqe_vectors(Q, G[:2], 5, 1.0)[0] == pytest.approx(unit(2.0, 0.96))
    assert aqe_vectors(Q, G[:2], 10**9, 1.0)[0] == pytest.approx(unit(2.0, 0.96))
    # a huge alpha keeps only the closest neighbour's direction (0.8^200 is tiny)
    assert aqe_vectors(Q, G, 2, 200.0)[0] == pytest.approx(unit(1.0, 0.0), abs=1e-6)


def test_dba_by_hand_excludes_each_vector_itself():
    a, b, c = (1.0, 0.0), (0.6, 0.8), (0.0, 1.0)
    x = np.array([a, b, c], dtype=np.float32)
    # top-1 other than itself: a -> b (0.6), b -> c (0.8), c -> b (0.8)
    expected = [unit(1 + 0.36, 0.48), unit(0.6, 0.8 + 0.8), unit(0.48, 1 + 0.64)]
    got = dba_vectors(x, 1, 1.0)
    for row, want in zip(got, expected, strict=True):
        assert row == pytest.approx(want)
    # with itself as a neighbour a would stay a; it moved
    assert not np.allclose(got[0], a)
    # n beyond the others: c (similarity 0 to a) adds nothing at alpha 1
    assert dba_vectors(x, 5, 1.0)[0] == pytest.approx(unit(1.36 + 0.0, 0.48 + 0.0))
    ids, _ = exact_neighbours(x, x, 5, exclude_self=True)
    assert ids.tolist() == [[1, 2, -1, -1, -1], [2, 0, -1, -1, -1], [1, 0, -1, -1, -1]]


def test_augment_database_from_given_neighbours():
    x = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    pool = np.array([[0.6, 0.8], [0.8, -0.6]], dtype=np.float32)
    ids = np.array([[0, -1], [1, 0]])
    scores = np.array([[0.5, 0.9], [-0.2, 0.8]], dtype=np.float32)
    got = augment_database(x, ids, scores, 2.0, pool=pool)
    # row 0: the -1 slot adds nothing whatever its score; 0.25 (0.6, 0.8)
    assert got[0] == pytest.approx(unit(1 + 0.15, 0.2))
    # row 1: -0.2 is clipped to 0; 0.64 (0.6, 0.8)
    assert got[1] == pytest.approx(unit(0.384, 1 + 0.512))
    for bad in (np.array([[0, 2], [0, 0]]), np.array([[0, -2], [0, 0]])):
        with pytest.raises(ValueError, match="must lie in"):
            augment_database(x, bad, scores, 2.0, pool=pool)
    with pytest.raises(ValueError, match="integers"):
        augment_database(x, ids.astype(float), scores, 2.0)


def test_exact_neighbours_ties_go_to_the_lower_id():
    gallery = np.array([[0.0, 1.0]] + [[1.0, 0.0]] * 6 + [[0.6, 0.8]], dtype=np.float32)
    ids, scores = exact_neighbours(Q, gallery, 3)
    assert ids.tolist() == [[1, 2, 3]] and scores.tolist() == [[1.0, 1.0, 1.0]]
    ids, _ = exact_neighbours(Q, gallery[::-1].copy(), 3)
    assert ids.tolist() == [[1, 2, 3]]
    ids, _ = exact_neighbours(Q, gallery, 8)
    assert ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]


def clustered(seed: int = 0, sigma: float = 0.25) -> tuple[np.ndarray, np.ndarray]:
    """8 clusters of 25 unit vectors in 32-D around random centres."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(8, 32))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    labels = np.repeat(np.arange(8), 25)
    x = centres[labels] + sigma * rng.normal(size=(200, 32))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32), labels


def test_chunked_equals_unchunked():
    x, _ = clustered(1)
    ids, scores = exact_neighbours(x[:50], x, 7)
    for chunk in (1, 3, 64):
        got_ids, got_scores = exact_neighbours(x[:50], x, 7, chunk=chunk)
        assert np.array_equal(got_ids, ids)
        np.testing.assert_allclose(got_scores, scores, atol=1e-6)
    whole = dba_vectors(x, 4, 3.0)
    for chunk in (1, 7, 1000):
        np.testing.assert_allclose(dba_vectors(x, 4, 3.0, chunk=chunk), whole, atol=1e-6)
    np.testing.assert_allclose(
        augment_database(x, *exact_neighbours(x, x, 4, exclude_self=True), 3.0, chunk=3),
        whole,
        atol=1e-6,
    )


def test_exact_neighbours_match_a_full_sort():
    x, _ = clustered(2)
    ids, _ = exact_neighbours(x, x, 5, exclude_self=True, chunk=16)
    scores = x @ x.T
    np.fill_diagonal(scores, -np.inf)
    assert np.array_equal(ids, np.argsort(-scores, axis=1, kind="stable")[:, :5])
    with pytest.raises(ValueError, match="one query per gallery row"):
        exact_neighbours(x[:3], x, 2, exclude_self=True)


def naive_leave_one_out(q: np.ndarray, g: np.ndarray, labels: np.ndarray) -> dict:
    """recall@1, mAP and MAP@R by a stable full sort of every query's row."""
    first, ap, map_r = [], [], []
    for i in range(len(q)):
        scores = (g @ q[i]).astype(np.float32)
        order = [j for j in np.argsort(-scores, kind="stable") if j != i]
        relevant = np.array([labels[j] == labels[i] for j in order])
        if not relevant.any():
            continue
        hits = np.cumsum(relevant)
        precision = hits / np.arange(1, len(order) + 1)
        r = relevant.sum()
        first.append(bool(relevant[0]))
        ap.append(float(precision[relevant].sum() / r))
        map_r.append(float(precision[:r][relevant[:r]].sum() / r))
    return {"recall@1": np.mean(first), "map": np.mean(ap), "map_at_r": np.mean(map_r)}


def test_leave_one_out_metrics():
    x, labels = clustered(3, sigma=0.35)
    labels = labels.copy()
    labels[0] = 99  # a query with no other item of its class is dropped
    plain = leave_one_out_metrics(x, x, labels, (1, 4), chunk=33).summary()
    assert plain == query_metrics(x, labels, (1, 4)).summary()
    assert plain["n_dropped"] == 1
    expanded = aqe_vectors(x, x, 3, 3.0, exclude_self=True)
    got = leave_one_out_metrics(expanded, x, labels, (1,)).summary()
    want = naive_leave_one_out(expanded, x, labels)
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key


def test_alpha_qe_and_dba_raise_map_on_clustered_vectors():
    x, labels = clustered(0)
    base = query_metrics(x, labels).summary()["map"]
    found = rerank_vectors(x, x, METHODS, RerankSettings(3, 3.0, 3, 3.0), leave_one_out=True)
    got = {
        m: leave_one_out_metrics(q, g, labels, (1,)).summary()["map"]
        for m, (q, g, _) in found.items()
    }
    assert 0.6 < base < 0.8
    assert got["aqe"] > base + 0.03 and got["dba"] > base + 0.03
    assert got["dba+aqe"] > max(got["aqe"], got["dba"])
    # expanding with a query's farthest items instead wrecks it: the property can fail
    far = np.argsort(x @ x.T, axis=1)[:, :3]
    wrong = expand_queries(x, x[far], np.ones(far.shape, dtype=np.float32), 0.0)
    assert leave_one_out_metrics(wrong, x, labels, (1,)).summary()["map"] < base - 0.1


def test_rerank_vectors_and_search():
    x, _ = clustered(4)
    queries, gallery = x[:20], x[20:]
    settings = RerankSettings(aqe_neighbours=3, aqe_alpha=1.0, dba_neighbours=2, dba_alpha=2.0)
    found = rerank_vectors(queries, gallery, ["dba+aqe", "aqe", "dba"], settings)
    assert list(found) == ["dba+aqe", "aqe", "dba"]
    dba = dba_vectors(gallery, 2, 2.0)
    q, g, seconds = found["dba"]
    assert q is not None and np.array_equal(q, queries) and np.array_equal(g, dba)
    assert seconds >= 0
    q, g, _ = found["aqe"]
    assert np.array_equal(q, aqe_vectors(queries, gallery, 3, 1.0)) and np.array_equal(g, gallery)
    q, g, _ = found["dba+aqe"]
    assert np.array_equal(q, aqe_vectors(queries, dba, 3, 1.0)) and np.array_equal(g, dba)
    ids, scores = rerank_search(queries, gallery, 5, "dba+aqe", settings)
    assert np.array_equal(ids, exact_neighbours(q, dba, 5)[0])
    assert np.all(np.diff(scores, axis=1) <= 0)
    with pytest.raises(ValueError, match="unknown re-ranking 'qe'"):
        rerank_vectors(queries, gallery, ["qe"])
    for bad in ({"aqe_neighbours": 0}, {"dba_alpha": -1.0}, {"aqe_neighbours": True}):
        with pytest.raises(ValueError, match="must be"):
            RerankSettings(**bad)


def test_bench_rerank_leave_one_out(tmp_path, capsys, tiny_onnx):
    bench = ("bench", "--model", tiny_onnx, "--dataset", "digits")
    code, out, err = run(capsys, *bench, "--out", tmp_path / "plain")
    assert code == 0, err
    plain = json.loads((tmp_path / "plain" / "report.json").read_text())
    assert "rerank" not in plain and "rerank_settings" not in plain and "re-ranked" not in out

    code, out, err = run(
        capsys, *bench, "--rerank", "all", "--aqe-alpha", "1", "--out", tmp_path / "r"
    )
    assert code == 0, err
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    # the plain report is there unchanged, the re-ranked metrics after it
    assert list(report)[: len(plain)] == list(plain)
    assert report["rerank_settings"] == {
        "aqe_neighbours": 2,
        "aqe_alpha": 1.0,
        "dba_neighbours": 2,
        "dba_alpha": 3.0,
    }
    rows = report["rerank"]
    assert list(rows) == ["none", "aqe", "dba", "dba+aqe"]
    for key in ("recall@1", "recall@8", "map", "map_at_r", "r_precision"):
        assert rows["none"][key] == plain[key]
        assert all(0.0 <= rows[m][key] <= 1.0 for m in METHODS)
    assert "seconds" in rows["aqe"] and "seconds" not in rows["none"]
    assert "exact search re-ranked (aqe n=2 alpha=1; dba n=2 alpha=3):" in out
    line = next(line for line in out.splitlines() if line.startswith("dba+aqe "))
    assert f"{rows['dba+aqe']['map']:.4f}" in line
    assert "| dba+aqe |" in (tmp_path / "r" / "report.md").read_text()


def test_bench_rerank_queries_against_a_gallery(tiny_onnx):
    from vitrieval.index.evaluation.benchmark import run_benchmark
    from vitrieval.index.evaluation.datasets import load_dataset
    from vitrieval.index.runtime.embedder import Embedder

    items = load_dataset("digits", image_size=32).test
    embedder = Embedder(tiny_onnx)
    report = run_benchmark(embedder, items[:150], items[150:200], rerank=("aqe", "dba"))
    assert report["protocol"] == "queries-vs-gallery" and list(report["rerank"]) == [
        "none",
        "aqe",
        "dba",
    ]
    # the re-ranked numbers are the metrics of the re-ranked vectors
    gallery = embedder.embed_items(items[:150]).embeddings
    queries = embedder.embed_items(items[150:200]).embeddings
    g_labels = [item.label for item in items[:150]]
    q_labels = [item.label for item in items[150:200]]
    want = retrieval_metrics(
        aqe_vectors(queries, gallery),
        q_labels,
        gallery_embeddings=gallery,
        gallery_labels=g_labels,
    )
    assert report["rerank"]["aqe"]["map"] == pytest.approx(want["map"])
    assert report["rerank"]["aqe"]["recall@1"] == pytest.approx(want["recall@1"])


def test_bench_rerank_copy_detection(tmp_path, capsys, tiny_onnx):
    photos = tmp_path / "photos"
    for folder, names in {"a": ("astronaut", "coffee"), "b": ("chelsea", "rocket")}.items():
        (photos / folder).mkdir(parents=True)
        for name in names:
            Image.fromarray(getattr(skdata, name)()).save(photos / folder / f"{name}.png")
    argv = ("bench", "--model", tiny_onnx, "--copy-detection", photos, "--queries-per-image", "2")
    code, out, err = run(
        capsys, *argv, "--rerank", "dba", "--rerank", "aqe", "--out", tmp_path / "r"
    )
    assert code == 0, err
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    rows = report["rerank"]
    assert list(rows) == ["none", "aqe", "dba"]
    assert rows["none"]["recall@1"] == report["recall@1"] and rows["none"]["map"] == report["map"]
    assert {"recall@1", "map", "median_rank", "seconds"} <= set(rows["dba"])
    # the summary line stays last; the side-by-side table is printed above it
    lines = out.strip().splitlines()
    assert lines[-1].startswith("copy detection: 8 copies of 4 photos")
    assert lines[-2].startswith("dba ")

    # versions of one design (a folder) count as found: the label metrics, re-ranked
    code, out, err = run(
        capsys, *argv, "--labels-from-folders", "--rerank", "all", "--out", tmp_path / "l"
    )
    assert code == 0, err
    labelled = json.loads((tmp_path / "l" / "report.json").read_text())
    assert list(labelled["rerank"]) == ["none", *METHODS]
    assert labelled["rerank"]["none"]["map_at_r"] == labelled["map_at_r"]
    assert all(0 < labelled["rerank"][m]["map"] <= 1 for m in METHODS)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--aqe-alpha", "2"], "--aqe-alpha needs --rerank aqe, dba+aqe or all"),
        (["--rerank", "aqe", "--dba-neighbours", "3"], "--dba-neighbours needs --rerank dba"),
        (["--rerank", "dba", "--dba-neighbours", "0"], "--dba-neighbours must be at least 1"),
        (["--rerank", "all", "--aqe-alpha", "-1"], "--aqe-alpha must be a number >= 0"),
    ],
)
def test_bench_rerank_options_checked_before_embedding(tmp_path, capsys, extra, needle):
    code, out, err = run(
        capsys, "bench", "--model", tmp_path / "none.onnx", *extra, "--out", tmp_path / "r"
    )
    assert code == 2 and out == "" and needle in err and err.count("\n") == 1
