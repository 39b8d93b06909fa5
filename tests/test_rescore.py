"""Re-scoring compressed segments (index/store/_rescore.py): the codes' top oversample x k
candidates ranked again by the exact stored vectors."""

from __future__ import annotations

import numpy as np
import pytest
from store_helpers import as_pairs, brute_force, build, exact_vectors, with_duplicates

from vitrieval.index.store import IndexStore, StoreError
from vitrieval.index.store._vectors import exact_top_k
from vitrieval.index.store.request import DEFAULT_OVERSAMPLE, MAX_OVERSAMPLE, Query

K = 5


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(29)
    x = with_duplicates(exact_vectors(rng, 1500, 32), copies=3, originals=20)
    q = np.concatenate([x[:5], exact_vectors(rng, 15, 32)])  # some queries tie on copies
    return x, q


def pq_store(tmp_path, x: np.ndarray, factory: str = "IVF8,PQ8", **kwargs) -> IndexStore:
    store = build(tmp_path / "pq", x, factory, **kwargs)
    store.save()
    return store


def test_rescored_hits_are_the_exact_top_k_of_the_codes_candidates(tmp_path, data) -> None:
    x, q = data
    store = pq_store(tmp_path, x)
    for oversample in (1, 3, 8):
        # one segment: its codes' top oversample x k is what the plain search returns
        codes = as_pairs(store.search(q, K * oversample, rescore=False))
        got = as_pairs(store.search(q, K, oversample=oversample))
        for query, candidates, hits in zip(q, codes, got, strict=True):
            ids = np.asarray(sorted(i for i, _ in candidates), np.int64)
            top_ids, top_scores = exact_top_k(query[None, :], ids, x[ids], K)[0]
            expected = list(zip(top_ids.tolist(), top_scores.tolist(), strict=True))
            assert hits == expected  # same items, order, scores (the Flat kernel's)


def test_rescored_scores_are_exact_and_codes_scores_are_not(tmp_path, data) -> None:
    x, q = data
    store = pq_store(tmp_path, x)
    exact = q.astype(np.float64) @ x.astype(np.float64).T
    rescored = as_pairs(store.search(q, K))
    plain = as_pairs(store.search(q, K, rescore=False))
    assert all(abs(s - exact[r, i]) < 1e-6 for r, row in enumerate(rescored) for i, s in row)
    assert any(abs(s - exact[r, i]) > 1e-3 for r, row in enumerate(plain) for i, s in row)


def test_a_large_enough_oversample_equals_flat(tmp_path, data) -> None:
    x, q = data
    store = pq_store(tmp_path, x)
    store.set_search_params(nprobe=8)  # every list: the codes' candidates cover everything
    got = as_pairs(store.search(q, K, oversample=MAX_OVERSAMPLE))
    flat = build(tmp_path / "flat", x)
    assert got == as_pairs(flat.search(q, K))
    truth = brute_force(q, x, K)
    assert [[i for i, _ in row] for row in got] == [[i for i, _ in row] for row in truth]


def test_equal_scores_come_by_ascending_item_id(tmp_path, data) -> None:
    x, q = data
    store = pq_store(tmp_path, x)
    store.set_search_params(nprobe=8)
    for row in as_pairs(store.search(q[:5], 4, oversample=16)):  # each query has 3 copies
        assert [s for _, s in row[:4]] == [row[0][1]] * 4
        assert [i for i, _ in row] == sorted(i for i, _ in row)


def test_filters_tombstones_and_unsaved_adds_are_re_scored_too(tmp_path, data) -> None:
    x, q = data
    store = pq_store(tmp_path, x[:1000], labels=[f"l{i % 3}" for i in range(1000)])
    store.add([str(i) for i in range(1000, len(x))], x[1000:])  # a growing segment
    store.remove([str(i) for i in range(0, 1000, 7)])
    store.set_search_params(nprobe=8)
    labels = np.asarray([f"l{i % 3}" if i < 1000 else "" for i in range(len(x))])
    allowed = (labels == "l1") & (np.arange(len(x)) % 7 != 0)
    got = as_pairs(store.search(q, K, label="l1", oversample=MAX_OVERSAMPLE))
    assert got == brute_force(q, x, K, allowed=allowed)
    live = np.arange(len(x)) % 7 != 0
    live[1000:] = True
    got = as_pairs(store.search(q, K, oversample=MAX_OVERSAMPLE))
    assert [[i for i, _ in r] for r in got] == [
        [i for i, _ in r] for r in brute_force(q, x, K, allowed=live)
    ]


def test_each_segment_finds_its_items_vectors_whatever_its_ids(tmp_path, data) -> None:
    # a segment's item i sits at row i - first when its ids run unbroken from `first`;
    # otherwise each row is looked up: a second segment starts past 0, a merge across
    # removes leaves gaps
    x, q = data
    store = pq_store(tmp_path, x[:1000])
    store.add([str(i) for i in range(1000, len(x))], x[1000:])
    store.save()
    store.set_search_params(nprobe=8)
    assert [s["rows"] for s in store.info()["segments"]] == [1000, len(x) - 1000]
    assert as_pairs(store.search(q, K, oversample=MAX_OVERSAMPLE)) == brute_force(q, x, K)
    store.remove([str(i) for i in range(3, len(x), 5)])
    store.save()
    assert store.merge(everything=True) == 2
    reopened = IndexStore.open(tmp_path / "pq")
    live = np.arange(len(x)) % 5 != 3
    got = as_pairs(reopened.search(q, K, oversample=MAX_OVERSAMPLE))
    assert got == brute_force(q, x, K, allowed=live)


def test_the_saved_oversample_is_the_default_and_survives_reopening(tmp_path, data) -> None:
    x, q = data
    store = pq_store(tmp_path, x)
    assert store.search_params()["oversample"] == DEFAULT_OVERSAMPLE
    store.set_search_params(oversample=12)
    store.save()
    reopened = IndexStore.open(tmp_path / "pq")
    assert reopened.search_params()["oversample"] == 12
    assert reopened.search(q, K) == reopened.search(q, K, oversample=12)
    assert reopened.search(q, K) != reopened.search(q, K, oversample=1)


def test_exact_indexes_ignore_re_scoring_and_refuse_an_oversample(tmp_path, data) -> None:
    x, q = data
    flat = build(tmp_path / "flat", x)
    assert "oversample" not in flat.search_params()
    assert flat.search(q, K, rescore=False) == flat.search(q, K, oversample=9)
    with pytest.raises(StoreError, match="exact already"):
        flat.set_search_params(oversample=4)


def test_only_the_candidates_vectors_are_read(tmp_path, data, monkeypatch) -> None:
    x, q = data
    store = pq_store(tmp_path, x)
    [segment] = [s for s in store._state.serving() if s.live_count]
    asked: list[int] = []
    real = segment.exact_rows

    def exact_rows(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        asked.append(int((ids >= 0).sum()))
        return real(ids)

    monkeypatch.setattr(segment, "exact_rows", exact_rows)
    store.search(q[:1], K, oversample=3)
    assert asked == [K * 3]


@pytest.mark.parametrize("bad", [0, MAX_OVERSAMPLE + 1, -1, True, 2.5, "4"])
def test_an_oversample_outside_its_range_is_refused(bad) -> None:
    with pytest.raises(
        StoreError, match=f"oversample must be an integer from 1 to {MAX_OVERSAMPLE}"
    ):
        Query(np.zeros((1, 4), np.float32), 3, oversample=bad)


def test_rescore_must_be_a_boolean() -> None:
    with pytest.raises(StoreError, match="rescore must be true or false"):
        Query(np.zeros((1, 4), np.float32), 3, rescore="yes")  # type: ignore[arg-type]


def test_the_vectors_file_is_mapped_as_saved(tmp_path) -> None:
    from vitrieval.index.store._mapped_vectors import MappedVectors

    x = np.arange(5 * 7, dtype=np.float32).reshape(5, 7)
    np.save(tmp_path / "v.npy", x)
    mapped = MappedVectors(tmp_path / "v.npy")
    assert np.array_equal(mapped.array, x) and mapped.array.flags.writeable is False
    for first, stop in ((0, 5), (3, 4), (4, 2)):  # any range, an empty one included
        mapped.prefetch(first, stop)
    assert np.array_equal(mapped.array[[4, 0, 2]], x[[4, 0, 2]])
    np.save(tmp_path / "f.npy", np.asfortranarray(x))
    with pytest.raises(ValueError, match="Fortran-ordered"):
        MappedVectors(tmp_path / "f.npy")


def test_unordered_candidates_are_the_ordered_top_k_as_a_set() -> None:
    # re-scoring asks its codes for a set of candidates (ordered=False), which a glance
    # at the k-th and (k + 1)-th scores settles when they differ; with tied codes at
    # that place (coarse SQ4 codes of many copies) it must pick the same ids as the
    # ordered search, which settles ties by ascending id
    from vitrieval.index.store._vectors import NO_IDS, VectorIndex

    rng = np.random.default_rng(5)
    x = with_duplicates(exact_vectors(rng, 400, 16), copies=6, originals=60)
    index = VectorIndex.create(16, "IVF4,SQ4", "cpu")
    index.train(x)
    index.add(x, np.arange(len(x), dtype=np.int64))
    index.set_parameter("nprobe", 4)
    q = np.concatenate([x[:20], exact_vectors(rng, 20, 16)])
    glanced = 0
    for k in (1, 5, 13, 40, len(x), len(x) + 3):
        ordered = index.top_k_arrays(q, k, allowed=None, blocked=NO_IDS)
        unordered = index.top_k_arrays(q, k, allowed=None, blocked=NO_IDS, ordered=False)
        for (ids, scores), (got_ids, got_scores) in zip(ordered, unordered, strict=True):
            assert sorted(got_ids.tolist()) == sorted(ids.tolist())
            assert sorted(got_scores.tolist()) == sorted(scores.tolist())
            assert got_scores.tolist() == sorted(got_scores.tolist(), reverse=True)
            glanced += got_ids.tolist() != ids.tolist()
    assert glanced  # some answers came back in FAISS's order, not re-sorted by id
