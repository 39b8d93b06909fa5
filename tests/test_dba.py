"""Database-side augmentation in the store: the derived DBA index a commit writes,
against a naive reference computed here (before and after adds, removes and merges);
refusals while it is stale; switching it on and off; persistence, crashes, checks and
the upgrade of format 3 (DBA vectors inside segments)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from store_helpers import flip_byte, unit_vectors

from vitrieval.index.store import IndexStore, StoreError, upgrade

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


def test_unsaved_items_are_refused_then_saved_with_their_dba_and_dba_switches_off(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(1)
    x = unit_vectors(rng, N, DIM)
    store = built(tmp_path / "idx", x, "Flat", ["red"] * N)
    store.set_dba(2, 3.0)
    with pytest.raises(StoreError, match="no DBA vectors for its settings yet: save the index"):
        store.search(x[:1], 1, augmented=True)  # set, not computed yet
    store.save()  # the commit computes the DBA vectors of every item
    extra = unit_vectors(rng, 1, DIM)
    store.add(["new"], extra)
    with pytest.raises(StoreError, match="unsaved adds or removes its DBA vectors do not cover"):
        store.search(extra, 1, augmented=True)
    store.save()
    reference = naive_dba(np.concatenate([x, extra]), 2, 3.0)
    top = store.search(extra, 1, augmented=True)[0][0]
    assert top.key == "new" and top.score == pytest.approx(float(extra[0] @ reference[N]), abs=1e-5)
    assert store.info()["dba"]["live_items_with_dba"] == N + 1
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
    generation = store.info()["generation"]
    store.close()
    names = sorted(p.name for p in (tmp_path / "idx").glob("dba.*"))
    assert names == [f"dba.{generation}.ids.npy", f"dba.{generation}.npy"]  # outside segments
    assert not list((tmp_path / "idx").glob("seg.*.dba.*"))
    flip_byte(tmp_path / "idx" / f"dba.{generation}.npy", 200)
    with pytest.raises(StoreError, match=rf"dba\.{generation}\.npy"):
        IndexStore.open(tmp_path / "idx", verify=True)


def assert_augmented_is_naive(store, vectors: dict[str, np.ndarray], queries, n, alpha) -> None:
    keys = sorted(vectors, key=int)  # ids follow the keys' order of addition here
    reference = naive_dba(np.stack([vectors[k] for k in keys]), n, alpha)
    hits = store.search(queries, 10, augmented=True)
    expected = [[keys[int(i)] for i in row] for row in ranked(queries, reference, 10)]
    assert [[h.key for h in row] for row in hits] == expected
    scores = queries @ reference.T
    position = {k: i for i, k in enumerate(keys)}
    assert (
        max(abs(h.score - scores[q, position[h.key]]) for q, row in enumerate(hits) for h in row)
        < 1e-5
    )


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat"])
def test_dba_follows_adds_removes_and_merges(tmp_path: Path, factory: str) -> None:
    rng = np.random.default_rng(3)
    x = unit_vectors(rng, 300, DIM)
    queries = unit_vectors(rng, 6, DIM)
    store = built(tmp_path / "idx", x[:200], factory, ["red"] * 200)
    store.set_dba(3, 2.0)
    store.save()
    live = {str(i): x[i] for i in range(200)}
    assert_augmented_is_naive(store, live, queries, 3, 2.0)
    store.add([str(i) for i in range(200, 300)], x[200:])  # a third segment
    store.remove([str(i) for i in range(0, 60, 3)])  # tombstones in the first
    store.save()
    live.update({str(i): x[i] for i in range(200, 300)})
    for i in range(0, 60, 3):
        del live[str(i)]
    assert_augmented_is_naive(store, live, queries, 3, 2.0)
    files = sorted(p.name for p in (tmp_path / "idx").glob("dba.*"))
    assert store.merge(everything=True) > 0  # the same items: the derived index is kept
    assert sorted(p.name for p in (tmp_path / "idx").glob("dba.*")) == files
    assert_augmented_is_naive(store, live, queries, 3, 2.0)
    store.remove(["250"])
    store.save()
    del live["250"]
    assert_augmented_is_naive(store, live, queries, 3, 2.0)
    store.close()
    with IndexStore.open(tmp_path / "idx", verify=True) as again:
        assert_augmented_is_naive(again, live, queries, 3, 2.0)
        assert again.info()["dba"]["live_items_with_dba"] == len(live)


def test_a_crash_between_the_derived_index_and_the_manifest(tmp_path: Path, monkeypatch) -> None:
    rng = np.random.default_rng(4)
    x = unit_vectors(rng, 150, DIM)
    queries = unit_vectors(rng, 4, DIM)
    store = built(tmp_path / "idx", x[:100], "Flat", ["red"] * 100)
    store.set_dba(2, 3.0)
    store.save()
    store.close()
    before = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    store = IndexStore.open(tmp_path / "idx")
    store.add([str(i) for i in range(100, 150)], x[100:])
    import vitrieval.index.store._persist as persist_module

    def crash(*args, **kwargs):
        raise OSError("killed before the manifest")

    monkeypatch.setattr(persist_module.mf, "write_manifest", crash)
    with pytest.raises(OSError, match="killed"):
        store.save()
    monkeypatch.undo()
    # the new generation's derived index was written, then the commit never happened
    assert (tmp_path / "idx" / f"dba.{before['generation'] + 1}.npy").exists()
    store.close()
    assert json.loads((tmp_path / "idx" / "manifest.json").read_text()) == before
    with IndexStore.open(tmp_path / "idx", verify=True) as again:  # the last commit, whole
        assert len(again) == 100
        assert_augmented_is_naive(again, {str(i): x[i] for i in range(100)}, queries, 2, 3.0)
        again.add([str(i) for i in range(100, 150)], x[100:])
        again.save()  # writes over the debris, then commits and removes what is unlisted
        assert_augmented_is_naive(again, {str(i): x[i] for i in range(150)}, queries, 2, 3.0)
    listed = json.loads((tmp_path / "idx" / "manifest.json").read_text())["dba"]
    assert sorted(p.name for p in (tmp_path / "idx").glob("dba.*")) == sorted(
        [listed["ids"]["file"], listed["vectors"]["file"]]
    )


def test_a_format_3_index_with_dba_in_its_segments_upgrades(tmp_path: Path) -> None:
    """Format 3 kept DBA vectors in segment files: it opens read-only, refuses an
    augmented search naming the upgrade, which computes the derived index and drops
    the segment files."""
    rng = np.random.default_rng(5)
    x = unit_vectors(rng, 120, DIM)
    queries = unit_vectors(rng, 4, DIM)
    directory = tmp_path / "idx"
    store = built(directory, x, "Flat", ["red"] * 120)
    store.set_dba(2, 3.0)
    store.save()
    store.close()
    manifest = json.loads((directory / "manifest.json").read_text())
    for name in (manifest["dba"]["ids"]["file"], manifest["dba"]["vectors"]["file"]):
        (directory / name).unlink()
    manifest["format_version"] = 3
    manifest["dba"] = {"neighbours": 2, "alpha": 3.0}
    for segment in manifest["segments"]:  # a DBA vector set as format 3 wrote it
        name = f"seg.{segment['number']}.dba.faiss"
        (directory / name).write_bytes(b"old DBA vectors")
        digest = hashlib.sha256(b"old DBA vectors").hexdigest()
        segment["files"][name] = {"sha256": digest, "bytes": len(b"old DBA vectors")}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with IndexStore.open(directory) as old:
        assert old.info()["format_version"] == 3 and len(old) == 120
        with pytest.raises(StoreError, match="vitrieval-index upgrade"):
            old.search(queries, 5, augmented=True)
    assert upgrade(directory) == (3, 120)
    assert not list(directory.glob("seg.*.dba.*"))
    with IndexStore.open(directory, journal=True, verify=True) as new:
        assert new.info()["format_version"] == 4
        assert_augmented_is_naive(new, {str(i): x[i] for i in range(120)}, queries, 2, 3.0)


def test_committed_ids_are_the_committed_live_items_without_their_vectors(tmp_path: Path):
    """What a commit compares the derived DBA index against, read without vectors."""
    x = unit_vectors(np.random.default_rng(4), 60, 8)
    store = IndexStore.create(tmp_path / "idx", dim=8)
    store.add([str(i) for i in range(40)], x[:40])
    store.save()
    store.remove(["1", "7", "30"])
    store.add([str(i) for i in range(40, 60)], x[40:])
    store.save()
    store.remove(["45"])  # not committed: still counted
    state = store._state
    expected = np.sort(np.concatenate([ids for ids, _ in state.committed_live()]))
    np.testing.assert_array_equal(state.committed_ids(), expected)
    assert state.committed_ids().size == 57
    store.close()
