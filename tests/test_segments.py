"""The segmented store: search over segments equals one index, saves cost the change,
merges run beside searches and adds and survive SIGKILL, and format-1 directories
are refused by the store and upgrade in place."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import faiss
import numpy as np
import pytest
from store_helpers import as_pairs, brute_force, exact_vectors, unit_vectors

from vitrieval.index.store import IndexStore, StoreError, upgrade
from vitrieval.index.store import _sealed_segment as segment_module
from vitrieval.index.store._leases import LEASE_DIR
from vitrieval.index.store._merge_policy import FLOOR_ROWS, MERGE_FACTOR, pick_merge, tier

REPO = Path(__file__).resolve().parents[1]


def saved_in_parts(directory: Path, x: np.ndarray, parts: int, **kwargs) -> IndexStore:
    """A store over `x` (keys str(row), labels row % 4) saved after each of `parts`
    slices: one sealed segment per slice, unless a merge folded some."""
    store = IndexStore.create(directory, dim=x.shape[1], **kwargs)
    if store.needs_training():
        store.train(x)
    for chunk in np.array_split(np.arange(len(x)), parts):
        store.add([str(i) for i in chunk], x[chunk], labels=[str(i % 4) for i in chunk])
        store.save()
    return store


def test_flat_search_over_segments_equals_one_segment(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = exact_vectors(rng, 600)
    x = np.concatenate([x, x[:40]])  # exact ties across segments
    queries = np.concatenate([x[:10], exact_vectors(rng, 20)])
    many = saved_in_parts(tmp_path / "many", x, 6)
    one = saved_in_parts(tmp_path / "one", x, 1)
    assert len(many._state.sealed) > 1 and len(one._state.sealed) == 1
    many.remove(["3", "333", "610"])  # tombstones in sealed segments
    one.remove(["3", "333", "610"])
    for kwargs in ({}, {"label": "2"}, {"exclude_keys": ["0", "5", "620"]}):
        assert many.search(queries, 25, **kwargs) == one.search(queries, 25, **kwargs)
    keep = np.ones(len(x), bool)
    keep[[3, 333, 610]] = False
    assert as_pairs(many.search(queries, 25)) == brute_force(queries, x, 25, keep)
    assert many.keys() == one.keys()
    for key in ("0", "599", "639"):
        assert np.array_equal(many.get(key).vector, one.get(key).vector)
    assert many.get("333") is None
    keys_m, labels_m, vectors_m = many.labelled_items()
    keys_o, labels_o, vectors_o = one.labelled_items()
    assert keys_m == keys_o and labels_m == labels_o and np.array_equal(vectors_m, vectors_o)


@pytest.mark.parametrize("factory", ["IVF16,Flat", "HNSW16", "IVF16,PQ8"])
def test_approximate_factories_keep_their_recall_over_segments(tmp_path: Path, factory) -> None:
    rng = np.random.default_rng(1)
    x, queries = unit_vectors(rng, 2000), unit_vectors(rng, 50)
    exact = brute_force(queries, x, 10)

    def recall(store: IndexStore) -> float:
        found = store.search(queries, 10)
        hits = [
            len({int(h.key) for h in row} & {i for i, _ in truth})
            for row, truth in zip(found, exact, strict=True)
        ]
        return sum(hits) / (10 * len(queries))

    many = saved_in_parts(tmp_path / "many", x, 5, factory=factory)
    one = saved_in_parts(tmp_path / "one", x, 1, factory=factory)
    for store in (many, one):
        params = {"ef_search": 128} if "HNSW" in factory else {"nprobe": 16}
        store.set_search_params(**params)
    assert recall(many) >= recall(one) - 0.05, (recall(many), recall(one))
    many.save()  # the search settings are saved with the index
    reopened = IndexStore.open(tmp_path / "many")
    assert reopened.search(queries, 10) == many.search(queries, 10)


def test_a_save_writes_only_what_changed(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = unit_vectors(rng, 5000)
    store = saved_in_parts(tmp_path / "idx", x[:4990], 1)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (tmp_path / "idx").iterdir()}
    store.add([str(i) for i in range(4990, 5000)], x[4990:])
    store.remove(["7"])
    store.save()
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (tmp_path / "idx").iterdir()}
    unchanged = {name for name in before if after.get(name) == before[name]}
    assert {"seg.1.faiss", "seg.1.items.sqlite"} <= unchanged  # the big segment is not rewritten
    written = sorted(set(after) - unchanged - {LEASE_DIR})  # the store's lease moved on
    assert written == [
        "manifest.json",
        "seg.1.del.2.npy",
        "seg.2.columns",
        "seg.2.faiss",
        "seg.2.items.sqlite",
    ]
    sizes = {name: (tmp_path / "idx" / name).stat().st_size for name in written}
    assert sum(sizes.values()) < 0.02 * (tmp_path / "idx" / "seg.1.faiss").stat().st_size
    reopened = IndexStore.open(tmp_path / "idx")
    assert len(reopened) == 4999 and "7" not in reopened and "4999" in reopened


def test_merge_policy() -> None:
    class Seg:
        def __init__(self, live: int, dead: int = 0) -> None:
            self.live_count, self.ntotal, self.tombstones = live, live + dead, set(range(dead))

    assert [tier(n) for n in (0, FLOOR_ROWS, 4 * FLOOR_ROWS - 1, 4 * FLOOR_ROWS, 10**6)] == [
        0,
        0,
        0,
        1,
        3,
    ]
    assert pick_merge([Seg(100)] * (MERGE_FACTOR - 1)) == []
    # eight large segments and one small new one: the small one waits for its peers
    assert pick_merge([Seg(1_000_000)] * 3 + [Seg(1_000)]) == []
    sizes = [900_000, 5, 1_000, 7, 800_000, 3, 12, 600]  # tier 0: 5, 1000, 7, 3, 12, 600
    assert pick_merge([Seg(n) for n in sizes]) == [1, 3, 5, 6]  # its 4 smallest
    assert pick_merge([Seg(100, 30), Seg(10)]) == [0]  # worn out: rewritten alone
    assert pick_merge([Seg(100, 20)]) == []  # 20% is not above the limit
    assert pick_merge([Seg(10), Seg(20)], everything=True) == [0, 1]


def test_write_amplification_of_the_policy_is_logarithmic() -> None:
    """Simulated: 2,000 checkpoints of 1,000 rows (2M rows) copy each row a few times,
    not once per checkpoint."""

    class Seg:
        def __init__(self, live: int) -> None:
            self.live_count, self.ntotal, self.tombstones = live, live, set()

    segments: list[Seg] = []
    copied = 0
    for _ in range(2000):
        segments.append(Seg(1000))
        while picks := pick_merge(segments):
            merged = sum(segments[i].live_count for i in picks)
            copied += merged
            segments = [s for i, s in enumerate(segments) if i not in picks] + [Seg(merged)]
    levels = math.log(2_000_000 / 1000, MERGE_FACTOR)  # about 5.5
    assert copied / 2_000_000 < 2 * levels, copied / 2_000_000  # the old policy: over 300
    assert len(segments) <= 4 * (MERGE_FACTOR - 1)


def test_saves_keep_the_segment_count_bounded_and_merges_drop_tombstones(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    x = exact_vectors(rng, 1200)
    queries = exact_vectors(rng, 10)
    store = saved_in_parts(tmp_path / "idx", x, 30)
    assert len(store._state.sealed) < MERGE_FACTOR  # all in the smallest tier
    store.remove([str(i) for i in range(0, 1200, 2)])
    store.save()
    store.merge(everything=True)
    assert len(store._state.sealed) == 1 and store.info()["deleted"] == 0 and len(store) == 600
    keep = np.arange(1200) % 2 == 1
    assert as_pairs(store.search(queries, 10)) == brute_force(queries, x, 10, keep)
    assert as_pairs(IndexStore.open(tmp_path / "idx").search(queries, 10)) == brute_force(
        queries, x, 10, keep
    )


def test_searches_and_writes_go_on_during_a_merge(tmp_path: Path, monkeypatch) -> None:
    """A merge writes its segment outside the store's lock: searches and adds run while
    it does, and a removal made meanwhile of a merged item survives into the new segment."""
    rng = np.random.default_rng(4)
    x = exact_vectors(rng, 900)
    store = saved_in_parts(tmp_path / "idx", x[:800], 3)
    real_write = segment_module.write_segment
    during: list[str] = []

    def slow_write(*args, **kwargs):
        result = real_write(*args, **kwargs)
        # while the merge holds no store lock: search, add and remove
        assert store.search(x[:1], 1)[0][0].key == "0"
        store.add(["800"], x[800:801])
        assert store.remove(["10"]) == 1  # an item being merged
        during.append("done")
        return result

    monkeypatch.setattr(segment_module, "write_segment", slow_write)
    import vitrieval.index.store._persist as persist_module

    monkeypatch.setattr(persist_module, "write_segment", slow_write)
    merger = threading.Thread(target=store.merge, kwargs={"everything": True})
    merger.start()
    merger.join(60)
    assert during == ["done"] and len(store._state.sealed) == 1
    assert "10" not in store and "800" in store and len(store) == 800
    monkeypatch.undo()
    store.save()
    reopened = IndexStore.open(tmp_path / "idx")
    assert "10" not in reopened and "800" in reopened and len(reopened) == 800


def test_checkpoints_do_not_hold_the_search_lock(tmp_path: Path, monkeypatch) -> None:
    rng = np.random.default_rng(5)
    x = unit_vectors(rng, 400)
    store = saved_in_parts(tmp_path / "idx", x[:300], 1)
    store.add([str(i) for i in range(300, 400)], x[300:])
    import vitrieval.index.store._persist as persist_module

    real_write = persist_module.write_segment
    searched = []

    def write_and_search(*args, **kwargs):
        thread = threading.Thread(target=lambda: searched.append(store.search(x[350:351], 1)))
        thread.start()
        thread.join(10)  # would dead-lock if the save held the lock
        return real_write(*args, **kwargs)

    monkeypatch.setattr(persist_module, "write_segment", write_and_search)
    store.save()
    assert searched and searched[0][0][0].key == "350"  # the segment being sealed answers


CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from vitrieval.index.store import IndexStore

    store = IndexStore.open(sys.argv[1])
    print("ready", flush=True)
    while True:
        store.merge(everything=True)
        print("merged", flush=True)
        store.remove(["k0"]); store.add(["k0"], store.get("k1").vector[None, :] * 1.0)
        store.save()
    """
)


def test_sigkill_during_merges_leaves_the_last_commit_loadable(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    x = exact_vectors(rng, 3000)
    queries = exact_vectors(rng, 5)
    saved_in_parts(tmp_path / "idx", x, 3).close()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    pace = random.Random(7)
    keys = {str(i) for i in range(3000)}
    for _ in range(8):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path / "idx")],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert child.stdout.readline() == "ready\n"
        time.sleep(pace.uniform(0.05, 0.6))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        store = IndexStore.open(tmp_path / "idx", verify=True)
        found = set(store.keys())
        assert found - {"k0"} == keys  # every item, whatever the moment of the kill
        hits = store.search(queries, 10)
        truth = brute_force(queries, x, 10)
        assert [[h.key for h in row] for row in hits] == [[str(i) for i, _ in t] for t in truth]
        store.close()


# -- format 1 ---------------------------------------------------------------------------


def write_format_1(directory: Path, x: np.ndarray, deleted: set[int] = frozenset()) -> None:
    """A format-1 index directory as earlier releases wrote it: one generation, a FAISS
    file (IndexIDMap2 over IndexFlatIP, ids = item ids) and an SQLite item table with
    every vector, listed with their checksums in manifest.json."""
    directory.mkdir(parents=True)
    index = faiss.IndexIDMap2(faiss.IndexFlatIP(x.shape[1]))
    index.add_with_ids(x, np.arange(len(x), dtype=np.int64))
    faiss.write_index(index, str(directory / "index.1.faiss"))
    with sqlite3.connect(directory / "items.1.sqlite") as db:
        db.executescript(
            "CREATE TABLE items (id INTEGER PRIMARY KEY, key TEXT NOT NULL, label TEXT, "
            "path TEXT, metadata TEXT NOT NULL DEFAULT '{}', vector BLOB NOT NULL, "
            "deleted INTEGER NOT NULL DEFAULT 0);"
        )
        db.executemany(
            "INSERT INTO items VALUES (?,?,?,?,?,?,?)",
            [
                (i, str(i), str(i % 4), None, "{}", x[i].astype("<f4").tobytes(), int(i in deleted))
                for i in range(len(x))
            ],
        )
    files = {}
    for name in ("index.1.faiss", "items.1.sqlite"):
        data = (directory / name).read_bytes()
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest = {
        "format_version": 1,
        "generation": 1,
        "model": None,
        "dim": x.shape[1],
        "metric": "inner_product",
        "factory": "Flat",
        "count": len(x) - len(deleted),
        "files": files,
        "created": "2026-01-01T00:00:00+00:00",
        "updated": "2026-01-01T00:00:00+00:00",
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_a_format_1_index_is_refused_and_upgrades_in_place(tmp_path: Path) -> None:
    """The store does not open format 1: it names the upgrade, which converts it."""
    rng = np.random.default_rng(8)
    x = exact_vectors(rng, 300)
    queries = exact_vectors(rng, 10)
    write_format_1(tmp_path / "old", x)
    files_before = sorted(p.name for p in (tmp_path / "old").iterdir())
    refusal = rf"{tmp_path / 'old'} is an index of format 1.*vitrieval-index upgrade "
    for journal in (False, True):
        with pytest.raises(StoreError, match=refusal):
            IndexStore.open(tmp_path / "old", journal=journal)
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == files_before
    assert upgrade(tmp_path / "old") == (1, 300)
    names = sorted(p.name for p in (tmp_path / "old").iterdir() if p.name != LEASE_DIR)
    assert names == [".lock", "manifest.json", "seg.1.columns", "seg.1.faiss", "seg.1.items.sqlite"]
    new = IndexStore.open(tmp_path / "old", journal=True, verify=True)
    assert new.info()["format_version"] == 4 and len(new) == 300
    assert as_pairs(new.search(queries, 10)) == brute_force(queries, x, 10)
    new.close()
    assert upgrade(tmp_path / "old") == (4, 300)  # already done: nothing to do


def test_the_upgrade_of_format_1_includes_its_journalled_mutations(tmp_path: Path) -> None:
    x = exact_vectors(np.random.default_rng(11), 40)
    write_format_1(tmp_path / "old", x)
    vector = np.ascontiguousarray(x[5], dtype="<f4").tobytes()
    with sqlite3.connect(tmp_path / "old" / "journal.sqlite") as db:  # as format 1 left it
        db.execute(
            "CREATE TABLE ops (seq INTEGER PRIMARY KEY AUTOINCREMENT, op TEXT NOT NULL, "
            "key TEXT NOT NULL, label TEXT, path TEXT, metadata TEXT, vector BLOB)"
        )
        db.executemany(
            "INSERT INTO ops (op, key, label, path, metadata, vector) VALUES (?,?,?,?,?,?)",
            [("add", "new", "N", None, "{}", vector), ("remove", "3", None, None, None, None)],
        )
    assert upgrade(tmp_path / "old") == (1, 40)
    with IndexStore.open(tmp_path / "old", journal=True, verify=True) as new:
        assert new.get("new").label == "N" and "3" not in new and len(new) == 40


def test_the_store_never_imports_the_format_1_reader(tmp_path: Path) -> None:
    """Opening, searching and saving a store loads no format-1 code: only the upgrade
    does."""
    script = (
        "import sys, numpy as np\n"
        "from vitrieval.index.store import IndexStore\n"
        "x = np.eye(4, dtype='float32')\n"
        f"s = IndexStore.create({str(tmp_path / 'idx')!r}, dim=4)\n"
        "s.add(['a', 'b'], x[:2]); s.save(); s.close()\n"
        f"s = IndexStore.open({str(tmp_path / 'idx')!r}, journal=True)\n"
        "s.search(x[:1], 2); s.add(['c'], x[2:3]); s.save(); s.merge(everything=True)\n"
        "s.close()\n"
        "print(sorted(m for m in sys.modules if 'format1' in m or 'legacy' in m))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


def test_a_format_2_index_opens_read_only_and_upgrade_writes_its_columns(
    tmp_path: Path,
) -> None:
    """Format 2 is format 3 without the columns files: it opens and answers filters
    from its field index, is not written, and `upgrade` writes the columns."""
    rng = np.random.default_rng(10)
    x = exact_vectors(rng, 200)
    metadata = [{"rank": i, "colour": ["red", "blue"][i % 2]} for i in range(200)]
    directory = tmp_path / "idx"
    store = IndexStore.create(directory, dim=x.shape[1])
    store.add([str(i) for i in range(100)], x[:100], metadata=metadata[:100])
    store.save()
    store.add([str(i) for i in range(100, 200)], x[100:], metadata=metadata[100:])
    store.save()
    flt = {"must": [{"key": "rank", "range": {"lt": 150}}, {"key": "colour", "match": "red"}]}
    before = store.search(x[:5], 20, filter=flt)
    store.close()
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["format_version"] = 2
    for segment in manifest["segments"]:
        for name in [n for n in segment["files"] if n.endswith(".columns")]:
            del segment["files"][name]
            (directory / name).unlink()
    (directory / "manifest.json").write_text(json.dumps(manifest))

    old = IndexStore.open(directory)
    assert old.info()["format_version"] == 2 and old.search(x[:5], 20, filter=flt) == before
    old.add(["new"], x[:1])
    with pytest.raises(StoreError, match=r"format 2.*vitrieval-index upgrade"):
        old.save()
    with pytest.raises(StoreError, match=r"format 2.*vitrieval-index upgrade"):
        old.merge(everything=True)
    old.close()
    with pytest.raises(StoreError, match=r"format 2.*vitrieval-index upgrade"):
        IndexStore.open(directory, journal=True)
    assert upgrade(directory) == (2, 200)
    assert sorted(p.name for p in directory.glob("seg.*.columns")) == [
        "seg.1.columns",
        "seg.2.columns",
    ]
    new = IndexStore.open(directory, journal=True, verify=True)
    assert new.info()["format_version"] == 4 and new.search(x[:5], 20, filter=flt) == before
    assert all("rank" in s.columns.numbers for s in new._state.sealed)
    new.close()
    assert upgrade(directory) == (4, 200)


def test_an_upgrade_that_fails_midway_leaves_format_1(tmp_path: Path, monkeypatch) -> None:
    x = exact_vectors(np.random.default_rng(9), 50)
    write_format_1(tmp_path / "old", x)
    import vitrieval.index.store._persist as persist_module

    def failing_commit(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(persist_module.mf, "write_manifest", failing_commit)
    with pytest.raises(OSError):
        upgrade(tmp_path / "old")
    monkeypatch.undo()
    with pytest.raises(StoreError, match=r"format 1.*vitrieval-index upgrade"):
        IndexStore.open(tmp_path / "old")  # still format 1, as it was
    assert upgrade(tmp_path / "old") == (1, 50)


# -- failure paths of a save -------------------------------------------------------------


def _journalled_store(directory: Path, x: np.ndarray) -> IndexStore:
    store = IndexStore.create(directory, dim=x.shape[1])
    store.add(["a0"], x[:1])
    store.save()
    store.close()
    return IndexStore.open(directory, journal=True)


def _crash(store: IndexStore) -> None:
    """Drop the store without saving, as SIGKILL would."""
    store._state.detach_journal()
    store.close()


def test_a_removal_after_a_failed_save_survives_the_next_save(tmp_path: Path, monkeypatch) -> None:
    import vitrieval.index.store._persist as persist_module

    x = unit_vectors(np.random.default_rng(10), 3)
    store = _journalled_store(tmp_path / "idx", x)
    store.add(["k1", "k2"], x[1:])
    real_write = persist_module.write_segment

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist_module, "write_segment", disk_full)
    with pytest.raises(OSError):
        store.save()
    monkeypatch.setattr(persist_module, "write_segment", real_write)
    assert store.remove(["k1"]) == 1  # acknowledged: journalled
    store.save()
    assert store.journal_pending == 0
    _crash(store)
    assert IndexStore.open(tmp_path / "idx").keys() == ["a0", "k2"]


def test_a_failure_opening_the_sealed_segment_loses_nothing(tmp_path: Path, monkeypatch) -> None:
    import vitrieval.index.store._persist as persist_module

    x = unit_vectors(np.random.default_rng(11), 3)
    store = _journalled_store(tmp_path / "idx", x)
    store.add(["k1", "k2"], x[1:])
    real_open = persist_module._open_sealed

    def too_many_files(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(persist_module, "_open_sealed", too_many_files)
    with pytest.raises(OSError):
        store.save()
    assert "k1" in store and "k2" in store  # still searched from the frozen segment
    monkeypatch.setattr(persist_module, "_open_sealed", real_open)
    store.save()
    _crash(store)
    assert IndexStore.open(tmp_path / "idx").keys() == ["a0", "k1", "k2"]


def test_a_crash_after_the_commit_never_replays_what_it_holds(tmp_path: Path, monkeypatch) -> None:
    """A new index saved over one whose journal holds rows: if the process dies between
    the commit and the journal's truncation, the old rows are not replayed into it."""
    import vitrieval.index.store._journal as journal_module

    x = unit_vectors(np.random.default_rng(12), 4)
    old = _journalled_store(tmp_path / "idx", x)
    old.add(["old-journalled"], x[1:2])
    _crash(old)
    fresh = IndexStore.create(tmp_path / "idx", dim=x.shape[1], overwrite=True)
    fresh.add(["new0"], x[2:3])
    monkeypatch.setattr(journal_module.Journal, "truncate", lambda self, upto: None)
    fresh.save()  # committed; the truncation "never happened"
    fresh.close()
    monkeypatch.undo()
    assert IndexStore.open(tmp_path / "idx").keys() == ["new0"]


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat"])
def test_exact_vectors_of_a_segment_with_and_without_gaps_in_its_ids(
    tmp_path: Path, factory: str
) -> None:
    """A segment sealed from one run of adds holds one unbroken id range (rows found by
    arithmetic); a merge over removed items leaves gaps (rows found by search). Both
    give every asked item that the segment holds, with its stored vector, in order."""
    x = unit_vectors(np.random.default_rng(11), 300, 8)
    store = IndexStore.create(tmp_path / "idx", dim=8, factory=factory)
    if store.needs_training():
        store.train(x)
    store.add([str(i) for i in range(200)], x[:200])
    store.save()
    (whole,) = store._state.sealed
    asked = np.array([-5, 0, 3, 3, 199, 200, 250], dtype=np.int64)
    found, vectors = whole.exact_vectors(asked)
    assert found.tolist() == [0, 3, 3, 199]
    np.testing.assert_array_equal(vectors, x[[0, 3, 3, 199]])

    store.remove([str(i) for i in range(0, 200, 3)])
    store.add([str(i) for i in range(200, 300)], x[200:])
    store.save()
    store.merge(everything=True)
    (merged,) = store._state.sealed
    ids = np.arange(-2, 305, dtype=np.int64)
    found, vectors = merged.exact_vectors(ids)
    kept = [i for i in range(300) if i >= 200 or i % 3]
    assert found.tolist() == kept  # item ids are the order of the adds here
    np.testing.assert_array_equal(vectors, x[kept])
    store.close()


_LEGACY_SCAN_AFTER_TRUNCATION = """
import os, sys
import numpy as np
from vitrieval.index.store import IndexStore

directory = sys.argv[1]
x = np.eye(8, dtype=np.float32)[np.arange(3000) % 8]
store = IndexStore.create(directory, dim=8, factory="Flat")
store.add([f"k{i}" for i in range(3000)], x, metadata=[{"i": i} for i in range(3000)])
store.save()
store.close()
store = IndexStore.open(directory)
with open(os.path.join(directory, "seg.1.items.sqlite"), "r+b") as fh:
    fh.truncate(8192)
print(store.legacy_items())
"""


def test_the_legacy_items_scan_checks_the_files_it_reads_first(tmp_path) -> None:
    # the item tables are memory-mapped: reading one truncated since it was opened is
    # SIGBUS (the process killed), so this scan takes it out of service first, as a
    # search does
    scan = subprocess.run(
        [sys.executable, "-c", _LEGACY_SCAN_AFTER_TRUNCATION, str(tmp_path / "index")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert scan.returncode == 0, (scan.returncode, scan.stderr[-2000:])
    assert scan.stdout.strip() == "[]"
    assert "seg.1.items.sqlite changed on disk while in service" in scan.stderr
