"""Tests for index.store: round trips, exactness against numpy, filters, removal and
tombstones, model fingerprints, input errors and the (simulated) GPU path (damaged
files and crash safety: tests/test_store_durability.py)."""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import pytest
from store_helpers import (  # tests/store_helpers.py
    DIM,
    as_pairs,
    brute_force,
    build,
    exact_vectors,
    faiss_rows,
    flip_byte,
    unit_vectors,
    with_duplicates,
)

from vitrieval.index.runtime.model_metadata import read_model_metadata
from vitrieval.index.store import IndexStore, StoreError, suggest_factory
from vitrieval.index.store._items import IN_CHUNK
from vitrieval.index.store._leases import LEASE_DIR
from vitrieval.index.store._vectors import VectorIndex

REPO = Path(__file__).resolve().parents[1]


# -- round trips and exactness ---------------------------------------------------------


@pytest.mark.parametrize("factory", ["Flat", "IVF16,Flat", "HNSW16", "IVF16,PQ16"])
def test_round_trip_is_bit_identical(tmp_path: Path, factory: str) -> None:
    rng = np.random.default_rng(1)
    x = unit_vectors(rng, 500)
    queries = unit_vectors(rng, 40)
    labels = [f"c{i % 7}" for i in range(500)]
    metadata = [{"i": i, "tags": ["a", str(i % 3)]} for i in range(500)]
    store = IndexStore.create(tmp_path / "idx", dim=DIM, factory=factory)
    if store.needs_training():
        store.train(x)
    keys = [f"item-{i}" for i in range(500)]
    store.add(keys, x, labels=labels, paths=[f"img/{i}.jpg" for i in range(500)], metadata=metadata)
    store.remove(keys[:25])  # tombstones for HNSW (below the auto-compact share)
    before = store.search(queries, 10)
    before_label = store.search(queries, 10, label="c3")
    store.save()
    assert not (tmp_path / "idx" / "model.onnx").exists()

    loaded = IndexStore.open(tmp_path / "idx", dim=DIM)
    assert loaded.search(queries, 10) == before  # keys, scores (exact floats) and metadata
    assert loaded.search(queries, 10, label="c3") == before_label
    assert len(loaded) == 475 and loaded.keys() == keys[25:] and loaded.factory == factory
    assert "item-0" not in loaded and "item-25" in loaded
    record = loaded.get("item-42")
    assert record is not None and record.vector.dtype == np.float32
    assert np.array_equal(record.vector, x[42])
    assert (record.label, record.path, record.metadata) == ("c0", "img/42.jpg", metadata[42])
    assert loaded.get("item-3") is None
    hit = before[0][0]
    assert isinstance(hit.score, float) and hit.metadata == metadata[int(hit.key[5:])]


def test_flat_finds_every_item_first(tmp_path: Path) -> None:
    x = unit_vectors(np.random.default_rng(2), 500)
    build(tmp_path / "idx", x).save()
    hits = IndexStore.open(tmp_path / "idx").search(x, 1)
    assert [row[0].key for row in hits] == [str(i) for i in range(500)]
    assert all(abs(row[0].score - 1.0) < 1e-5 for row in hits)


def test_flat_equals_brute_force_with_ties(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    x = with_duplicates(exact_vectors(rng, 300))
    # queries that tie (copies of duplicated rows) and ordinary ones
    queries = np.concatenate([x[:10], exact_vectors(rng, 30)])
    store = build(tmp_path / "idx", x)
    for k in (1, 3, 7, 20):
        assert as_pairs(store.search(queries, k)) == brute_force(queries, x, k)
    # a query equal to a duplicated row: its 5 copies tie at the top, in insertion order
    top = as_pairs(store.search(x[:1], 5))[0]
    assert [row for row, _ in top] == [0, 300, 301, 302, 303]


def test_a_search_deeper_than_one_in_list_describes_every_hit(tmp_path: Path) -> None:
    # a sealed segment looks its hits up IN_CHUNK ids per statement: deeper takes several
    rng = np.random.default_rng(6)
    x = exact_vectors(rng, 2 * IN_CHUNK + 200)
    queries = exact_vectors(rng, 2)
    labels = [f"class-{i % 7}" for i in range(len(x))]
    store = build(tmp_path / "idx", x, labels=labels)
    store.save()
    k = 2 * IN_CHUNK + 100
    hits = store.search(queries, k)
    assert as_pairs(hits) == brute_force(queries, x, k)
    assert all(h.label == labels[int(h.key)] for row in hits for h in row)


def test_ivf_full_probe_equals_brute_force(tmp_path: Path) -> None:
    # nprobe = nlist scans every inverted list, so IVF-Flat search is exact
    rng = np.random.default_rng(4)
    x = with_duplicates(exact_vectors(rng, 1000))
    queries = np.concatenate([x[:5], exact_vectors(rng, 30)])
    store = build(tmp_path / "idx", x, factory="IVF32,Flat")
    assert store.info()["search_params"] == {"nprobe": 8, "nlist": 32}  # default nlist/16, >= 8
    store.set_search_params(nprobe=32)
    assert as_pairs(store.search(queries, 10)) == brute_force(queries, x, 10)
    store.save()
    reopened = IndexStore.open(tmp_path / "idx")
    assert reopened.info()["search_params"]["nprobe"] == 32  # saved inside the FAISS file


@pytest.mark.parametrize("journal", [False, True])
def test_adds_after_opening_are_searched_with_the_saved_nprobe(tmp_path: Path, journal) -> None:
    # nprobe set after the first save lives in the manifest, not in the quantizer file:
    # the items added after opening (or replayed from the journal) must be probed with
    # it too, here nprobe = nlist, so the search is exact
    rng = np.random.default_rng(7)
    x, later = exact_vectors(rng, 500), exact_vectors(rng, 200)
    queries = np.concatenate([later[:3], exact_vectors(rng, 5)])
    store = build(tmp_path / "idx", x, factory="IVF16,Flat")
    store.save()
    store.set_search_params(nprobe=16)
    store.save()
    store.close()
    store = IndexStore.open(tmp_path / "idx", journal=journal)
    store.add([str(len(x) + i) for i in range(len(later))], later)
    if journal:  # unsaved: the next open replays them
        store.close()
        store = IndexStore.open(tmp_path / "idx", journal=True)
    both = np.concatenate([x, later])
    assert as_pairs(store.search(queries, 50)) == brute_force(queries, both, 50)
    store.close()


def test_hnsw_recall_at_10(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    x, queries = unit_vectors(rng, 2000, 64), unit_vectors(rng, 200, 64)
    store = build(tmp_path / "idx", x, factory="HNSW32")  # default efSearch 64
    found = as_pairs(store.search(queries, 10))
    truth = brute_force(queries, x, 10)
    recall = np.mean(
        [len({r for r, _ in f} & {r for r, _ in t}) / 10 for f, t in zip(found, truth, strict=True)]
    )
    assert recall >= 0.95


# -- label filter and exclusions -----------------------------------------------------------


@pytest.mark.parametrize("factory", ["Flat", "HNSW32"])
def test_label_filter_equals_brute_force_on_subset(tmp_path: Path, factory: str) -> None:
    rng = np.random.default_rng(6)
    x = with_duplicates(exact_vectors(rng, 400))
    labels = [("rare" if i % 40 == 0 else f"c{i % 3}") for i in range(len(x))]
    queries = exact_vectors(rng, 25)
    store = build(tmp_path / "idx", x, factory=factory, labels=labels)
    if factory.startswith("HNSW"):
        store.set_search_params(ef_search=len(x))  # exhaustive graph walk: exact results
    for label in ("c1", "rare"):
        hits = store.search(queries, 10, label=label)
        assert all(h.label == label for row in hits for h in row)
        allowed = np.array([lab == label for lab in labels])
        assert as_pairs(hits) == brute_force(queries, x, 10, allowed)
    assert store.search(queries, 10, label="no-such-label") == [[] for _ in range(25)]


def test_label_filter_without_selector_support(tmp_path: Path, monkeypatch) -> None:
    # IndexPQ rejects IDSelectors: the store over-fetches and post-filters instead
    # (a filter this small is searched exactly unless the exact path is turned off)
    monkeypatch.setattr("vitrieval.index.store._filter_plans.EXACT_SEARCH_MAX", 0)
    rng = np.random.default_rng(7)
    x = unit_vectors(rng, 600, 32)
    labels = [f"c{i % 5}" for i in range(600)]
    store = build(tmp_path / "idx", x, factory="PQ8", labels=labels)
    queries = unit_vectors(rng, 20, 32)
    everything = store.search(queries, 600)  # the index's own full ranking
    filtered = store.search(queries, 10, label="c2")
    for full_row, row in zip(everything, filtered, strict=True):
        assert row == [h for h in full_row if h.label == "c2"][:10]
    assert all(not s.vectors.selector_works() for s in store._state.segments() if s.live_count)


def test_exclude_keys_and_small_stores(tmp_path: Path) -> None:
    x = unit_vectors(np.random.default_rng(8), 6)
    store = build(tmp_path / "idx", x)
    hits = store.search(x[:2], 10, exclude_keys=["0", "1", "unknown"])
    assert [len(row) for row in hits] == [4, 4]  # fewer than k: only 4 items remain
    assert all(h.key not in {"0", "1"} for row in hits for h in row)
    empty = IndexStore.create(tmp_path / "empty", dim=DIM)
    assert empty.search(x[:3], 5) == [[], [], []]
    empty.save()
    assert len(IndexStore.open(tmp_path / "empty")) == 0


# -- removal, tombstones, compaction ----------------------------------------------------


@pytest.mark.parametrize("factory", ["Flat", "IVF16,Flat", "HNSW16"])
def test_remove_survives_save_and_compact_equals_fresh_build(tmp_path: Path, factory: str) -> None:
    rng = np.random.default_rng(9)
    x = exact_vectors(rng, 300)
    queries = exact_vectors(rng, 30)
    store = build(tmp_path / "idx", x, factory=factory)
    store.set_search_params(**({"ef_search": 512} if "HNSW" in factory else {}))
    if "IVF" in factory:
        store.set_search_params(nprobe=16)
    removed = [str(i) for i in range(0, 300, 20)]  # 15 items: 5%, below auto-compaction
    assert store.remove([*removed, "unknown", removed[0]]) == 15
    assert store.remove(removed) == 0
    assert len(store) == 285 and all(key not in store for key in removed)
    tombstones = 15 if factory == "HNSW16" else 0
    assert store.info()["deleted"] == tombstones
    hits = store.search(queries, 285)
    assert all(len(row) == 285 and not {h.key for h in row} & set(removed) for row in hits)
    store.save()
    reopened = IndexStore.open(tmp_path / "idx")
    assert len(reopened) == 285 and reopened.info()["deleted"] == tombstones
    assert reopened.search(queries, 10) == store.search(queries, 10)

    keep = np.array([str(i) not in removed for i in range(300)])
    fresh = IndexStore.create(tmp_path / "fresh", dim=DIM, factory=factory)
    if fresh.needs_training():
        fresh.train(x)
    fresh.add([str(i) for i in np.flatnonzero(keep)], x[keep])
    fresh.set_search_params(**({"ef_search": 512} if "HNSW" in factory else {}))
    if "IVF" in factory:
        fresh.set_search_params(nprobe=16)
    reopened.compact()
    assert reopened.info()["deleted"] == 0 and faiss_rows(reopened) == 285
    assert reopened.search(queries, 10) == fresh.search(queries, 10)
    assert as_pairs(reopened.search(queries, 10)) == brute_force(queries, x, 10, keep)


def test_save_auto_compacts_above_a_fifth_tombstones(tmp_path: Path) -> None:
    x = unit_vectors(np.random.default_rng(10), 100)
    store = build(tmp_path / "idx", x, factory="HNSW16")
    store.remove([str(i) for i in range(20)])  # 20 of 100: not above 20%
    store.save()
    assert store.info()["deleted"] == 20
    store.remove(["20"])  # 21 of 100
    store.save()
    assert store.info()["deleted"] == 0 and faiss_rows(store) == 79
    assert IndexStore.open(tmp_path / "idx").info()["deleted"] == 0


@pytest.mark.parametrize("factory", ["Flat", "HNSW16"])
def test_replace_existing_keys(tmp_path: Path, factory: str) -> None:
    rng = np.random.default_rng(11)
    x = unit_vectors(rng, 50)
    store = build(tmp_path / "idx", x, factory=factory)
    new = unit_vectors(rng, 2)
    with pytest.raises(StoreError, match=r"already in the index.*replace=True"):
        store.add(["3", "new"], new)
    assert len(store) == 50 and "new" not in store  # nothing half-added
    store.add(["3", "new"], new, labels=["x", "y"], replace=True)
    assert len(store) == 51 and np.array_equal(store.get("3").vector, new[0])
    assert store.search(new[:1], 1)[0][0].key == "3"
    row = store.search(x[3:4], 51)[0]  # the old vector of "3" is gone: only the new one left
    assert [h.key for h in row].count("3") == 1 and row[0].key != "3"
    assert next(h.score for h in row if h.key == "3") == pytest.approx(float(new[0] @ x[3]))
    store.save()
    assert IndexStore.open(tmp_path / "idx").get("3").label == "x"


# -- model copy, fingerprint and dimension checks ---------------------------------------------


def test_fingerprint_and_dim_mismatch_refused(tmp_path: Path) -> None:
    x = unit_vectors(np.random.default_rng(12), 10, 8)
    build(tmp_path / "idx", x, fingerprint="abc123").save()
    assert IndexStore.open(tmp_path / "idx", fingerprint="abc123", dim=8).fingerprint == "abc123"
    with pytest.raises(StoreError, match=r"abc123.*def456"):
        IndexStore.open(tmp_path / "idx", fingerprint="def456")
    with pytest.raises(StoreError, match=r"8-d.*16-d"):
        IndexStore.open(tmp_path / "idx", dim=16)
    build(tmp_path / "anon", x).save()
    with pytest.raises(StoreError, match="unrecorded model"):
        IndexStore.open(tmp_path / "anon", fingerprint="abc123")


def test_model_copy_is_kept_and_verified(
    tmp_path: Path, tiny_onnx: Path, tiny_onnx_other: Path
) -> None:
    ours = read_model_metadata(tiny_onnx).fingerprint
    theirs = read_model_metadata(tiny_onnx_other).fingerprint
    x = unit_vectors(np.random.default_rng(13), 20)
    with pytest.raises(StoreError, match="fingerprint"):
        IndexStore.create(tmp_path / "a", dim=DIM, model_path=tiny_onnx, fingerprint=theirs)
    with pytest.raises(StoreError, match="128-d vectors, not 64-d"):
        IndexStore.create(tmp_path / "a", dim=64, model_path=tiny_onnx)
    store = build(tmp_path / "idx", x, model_path=tiny_onnx)
    assert store.fingerprint == ours and store.model_path is None  # not copied before save
    store.save()
    copy = tmp_path / "idx" / "model.onnx"
    assert store.model_path == copy and copy.read_bytes() == tiny_onnx.read_bytes()
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["model"]["file"] == "model.onnx" and manifest["model"]["fingerprint"] == ours

    opened = IndexStore.open(tmp_path / "idx", fingerprint=ours)
    assert opened.model_path == copy and read_model_metadata(copy).fingerprint == ours
    with pytest.raises(StoreError, match=f"{ours}.*{theirs}"):
        IndexStore.open(tmp_path / "idx", fingerprint=theirs)
    flip_byte(copy, copy.stat().st_size // 2)
    with pytest.raises(StoreError, match=r"checksum mismatch.*model.onnx"):
        IndexStore.open(tmp_path / "idx")


def test_overwrite_with_another_model(
    tmp_path: Path, tiny_onnx: Path, tiny_onnx_other: Path
) -> None:
    x = unit_vectors(np.random.default_rng(14), 20)
    build(tmp_path / "idx", x, model_path=tiny_onnx).save()
    with pytest.raises(StoreError, match="not empty"):
        IndexStore.create(tmp_path / "idx", dim=DIM)
    other = build(tmp_path / "idx", x[:5], model_path=tiny_onnx_other, overwrite=True)
    other.save()
    reopened = IndexStore.open(tmp_path / "idx")
    assert len(reopened) == 5
    assert reopened.fingerprint == read_model_metadata(tiny_onnx_other).fingerprint
    assert reopened.model_path.read_bytes() == tiny_onnx_other.read_bytes()
    names = sorted(p.name for p in (tmp_path / "idx").iterdir())
    # the new index's files never overwrite the old one's before the commit
    names = [name for name in names if name != LEASE_DIR]  # reader leases (leases.py)
    assert names == [
        ".lock",
        "manifest.json",
        "model.2.onnx",
        "seg.2.columns",
        "seg.2.faiss",
        "seg.2.items.sqlite",
    ]


# -- errors ---------------------------------------------------------------------------------


def test_invalid_factory_strings(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"could not parse.*examples: \"Flat\""):
        IndexStore.create(tmp_path / "a", dim=DIM, factory="IVFx,Flat")
    with pytest.raises(StoreError, match="multiple of the number of subquantizers"):
        IndexStore.create(tmp_path / "a", dim=DIM, factory="PQ7")
    with pytest.raises(StoreError, match="drop the IDMap prefix"):
        IndexStore.create(tmp_path / "a", dim=DIM, factory="IDMap,Flat")
    # FAISS makes HNSW over PQ codes an L2 index whatever metric it is given: its
    # ascending distances would have been ranked as descending scores
    with pytest.raises(StoreError, match="for L2 distance only"):
        IndexStore.create(tmp_path / "a", dim=DIM, factory="HNSW16,PQ8")
    with pytest.raises(StoreError, match="dim must be a positive integer"):
        IndexStore.create(tmp_path / "a", dim=0)


def test_bad_inputs(tmp_path: Path) -> None:
    rng = np.random.default_rng(17)
    store = build(tmp_path / "idx", unit_vectors(rng, 10))
    good = unit_vectors(rng, 2)
    with pytest.raises(StoreError, match=r"shape \(n, 128\)"):
        store.add(["a", "b"], unit_vectors(rng, 2, 64))
    nan = good.copy()
    nan[1, 5] = np.nan
    with pytest.raises(StoreError, match="NaN"):
        store.add(["a", "b"], nan)
    with pytest.raises(StoreError, match="duplicate key 'a'"):
        store.add(["a", "a"], good)
    with pytest.raises(StoreError, match="L2-normalised"):
        store.add(["a", "b"], good * 2)
    with pytest.raises(StoreError, match="2 keys but 1 vectors"):
        store.add(["a", "b"], good[:1])
    with pytest.raises(StoreError, match="labels must be"):
        store.add(["a", "b"], good, labels=["x"])
    with pytest.raises(StoreError, match="JSON"):
        store.add(["a", "b"], good, metadata=[{"x": object()}, {}])
    for k in (0, -1, 2.5):
        with pytest.raises(StoreError, match="k must be an integer >= 1"):
            store.search(good, k)
    with pytest.raises(StoreError, match=r"shape \(n, 128\)"):
        store.search(good[0], 3)
    with pytest.raises(StoreError, match="efSearch"):
        store.set_search_params(ef_search=10)
    assert len(store) == 10 and "a" not in store  # no failed call changed anything


def test_untrained_ivf_refuses_adds_and_train_errors(tmp_path: Path) -> None:
    rng = np.random.default_rng(18)
    store = IndexStore.create(tmp_path / "idx", dim=DIM, factory="IVF16,Flat")
    assert store.needs_training()
    with pytest.raises(StoreError, match="must be trained first"):
        store.add(["a"], unit_vectors(rng, 1))
    with pytest.raises(StoreError, match="at least as large as number of clusters"):
        store.train(unit_vectors(rng, 5))
    x = unit_vectors(rng, 400)
    store.train(x[:200])
    store.add([str(i) for i in range(400)], x)
    store.remove(["0"])
    store.train(x[200:])  # retraining a filled store re-adds every live vector
    store.set_search_params(nprobe=16)
    assert len(store) == 399 and faiss_rows(store) == 399
    assert [row[0].key for row in store.search(x[1:50], 1)] == [str(i) for i in range(1, 50)]


def test_gpu_modes_without_gpu(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no GPU"):
        IndexStore.create(tmp_path / "a", dim=DIM, gpu="cuda")
    with pytest.raises(StoreError, match="gpu must be one of"):
        IndexStore.create(tmp_path / "a", dim=DIM, gpu="tpu")
    store = IndexStore.create(tmp_path / "a", dim=DIM)
    assert store.info()["gpu"] == "cpu"


def test_gpu_code_path_with_a_simulated_gpu(tmp_path: Path, monkeypatch) -> None:
    """faiss-cpu has no GPU: stand in CPU clones for GPU copies to check the plumbing
    (copy made for search, adds mirrored, copy dropped after removals, training)."""
    copies: list[faiss.Index] = []

    def to_gpu(index: faiss.Index) -> faiss.Index:
        copies.append(faiss.clone_index(index))
        return copies[-1]

    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", to_gpu)
    monkeypatch.setattr(faiss, "index_gpu_to_cpu", faiss.clone_index, raising=False)
    rng = np.random.default_rng(19)
    x = unit_vectors(rng, 300)
    store = build(tmp_path / "idx", x[:200])
    assert store.search(x[:2], 1)[0][0].key == "0" and store.info()["gpu"] == "1 GPU(s)"
    assert len(copies) == 1
    store.add([str(i) for i in range(200, 300)], x[200:])
    assert store.search(x[250:251], 1)[0][0].key == "250" and len(copies) == 1  # mirrored
    store.remove(["250"])
    assert store.search(x[250:251], 1)[0][0].key != "250" and len(copies) == 2  # re-copied
    ivf = build(tmp_path / "ivf", x, factory="IVF8,Flat")
    assert ivf.info()["trained"] and len(ivf) == 300
    assert IndexStore.create(tmp_path / "cpu", dim=DIM, gpu="cpu").info()["gpu"] == "cpu"


def test_selector_fallback_for_tombstones(tmp_path: Path, monkeypatch) -> None:
    rng = np.random.default_rng(20)
    x = exact_vectors(rng, 200)
    queries = exact_vectors(rng, 10)
    store = build(tmp_path / "idx", x, factory="HNSW16")
    store.set_search_params(ef_search=400)
    store.remove([str(i) for i in range(0, 200, 3)])
    with_selectors = store.search(queries, 10)

    def no_selectors(self, index, selector, widen):
        raise RuntimeError("selectors not supported here")

    monkeypatch.setattr(VectorIndex, "_params", no_selectors)
    assert store.search(queries, 10) == with_selectors
    keep = np.arange(200) % 3 != 0
    assert as_pairs(with_selectors) == brute_force(queries, x, 10, keep)


def test_suggest_factory() -> None:
    assert suggest_factory(0, 384) == "Flat"
    assert suggest_factory(49_999, 384) == "Flat"
    assert suggest_factory(100_000, 384) == "IVF1024,Flat"  # 4 * sqrt(1e5) = 1265
    assert suggest_factory(1_000_000, 384) == "IVF4096,Flat"  # 4000
    assert suggest_factory(50_000, 384) == "IVF1024,Flat"  # 894, capped at 50000 / 39 -> 1024
    with pytest.raises(StoreError):
        suggest_factory(10, 0)


def test_search_with_selector_after_faiss_torch_utils_patch(tmp_path):
    """Some torch libraries import faiss.contrib.torch_utils, which replaces Index.search
    with a wrapper that drops `params`; filtered search must still work."""
    pytest.importorskip("torch")
    import faiss.contrib.torch_utils  # noqa: F401

    rng = np.random.default_rng(5)
    vectors = unit_vectors(rng, 40)
    labels = ["a" if i % 2 else "b" for i in range(40)]
    store = IndexStore.create(tmp_path / "ix", dim=DIM)
    store.add([f"k{i}" for i in range(40)], vectors, labels=labels)
    hits = store.search(vectors[:3], 5, label="a")
    assert all(h.label == "a" for row in hits for h in row)
    assert [len(row) for row in hits] == [5, 5, 5]
