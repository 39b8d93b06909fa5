"""vitrieval.index.store durability: damaged or missing files refused, debris ignored, one writer,
concurrent searches during writes, and a committed state after SIGKILL mid-save."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from store_helpers import build, flip_byte, unit_vectors  # tests/store_helpers.py

from vitrieval.index.store import IndexStore, StoreError
from vitrieval.index.store._leases import LEASE_DIR

REPO = Path(__file__).resolve().parents[1]


# -- damaged files ---------------------------------------------------------------------------


@pytest.fixture
def saved_index(tmp_path: Path) -> Path:
    x = unit_vectors(np.random.default_rng(15), 200)
    build(tmp_path / "idx", x, labels=["a"] * 200).save()
    return tmp_path / "idx"


@pytest.mark.parametrize("name", ["seg.1.faiss", "seg.1.items.sqlite", "seg.1.columns"])
@pytest.mark.parametrize("damage", ["truncate", "missing", "header"])
def test_damaged_files_are_refused_at_open(saved_index: Path, name: str, damage: str) -> None:
    """Opening checks sizes and headers, not every byte: a truncated or missing file, or
    a damaged header, is refused at once."""
    path = saved_index / name
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size - 100])
    elif damage == "header":
        flip_byte(path, 1)
    else:
        path.unlink()
    expected = {"missing": "missing", "truncate": "truncated", "header": "not a"}[damage]
    with pytest.raises(StoreError, match=f"{name}.*{expected}|{expected}.*{name}"):
        IndexStore.open(saved_index)


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat"])
@pytest.mark.parametrize("name", ["faiss", "items.sqlite", "vectors.npy", "columns"])
def test_a_flipped_byte_in_a_sealed_segment_is_found_and_never_merged(
    tmp_path: Path, factory: str, name: str
) -> None:
    """A byte flipped inside a sealed segment passes the cheap checks at open; `verify`,
    an open with verify=True and a merge (which reads the segment) all refuse it."""
    x = unit_vectors(np.random.default_rng(15), 400)
    # metadata, so that the columns file holds columns (its last bytes are values)
    metadata = [{"rank": i, "colour": "red" if i % 3 else "blue"} for i in range(400)]
    store = IndexStore.create(tmp_path / "idx", dim=x.shape[1], factory=factory)
    if store.needs_training():
        store.train(x[:200])
    store.add([str(i) for i in range(200)], x[:200], metadata=metadata[:200])
    store.save()
    store.add([str(i) for i in range(200, 400)], x[200:], metadata=metadata[200:])
    store.save()
    store.close()
    path = tmp_path / "idx" / f"seg.1.{name}"
    if not path.exists():
        assert factory == "Flat" and name == "vectors.npy"  # Flat keeps them in FAISS
        return
    flip_byte(path, path.stat().st_size - 10)
    opened = IndexStore.open(tmp_path / "idx")
    with pytest.raises(StoreError, match=r"checksum mismatch in .*seg\.1\."):
        opened.verify()
    with pytest.raises(StoreError, match="checksum mismatch"):
        opened.merge(everything=True)
    assert len(opened._state.sealed) == 2  # nothing was merged
    opened.close()
    with pytest.raises(StoreError, match="checksum mismatch"):
        IndexStore.open(tmp_path / "idx", verify=True)


def test_missing_or_bad_manifest_is_refused(saved_index: Path, tmp_path: Path) -> None:
    manifest = saved_index / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(StoreError, match="not valid JSON"):
        IndexStore.open(saved_index)
    manifest.write_text("[" * 20_000 + "]" * 20_000)  # nested past the parser's depth
    with pytest.raises(StoreError, match="not valid JSON"):
        IndexStore.open(saved_index)
    data = json.loads(text)
    data["segments"][0]["files"]["../outside.faiss"] = {"sha256": "0", "bytes": 1}
    manifest.write_text(json.dumps(data))
    with pytest.raises(StoreError, match="unexpected segment file name"):
        IndexStore.open(saved_index)
    manifest.unlink()
    with pytest.raises(StoreError, match=r"manifest.json not found"):
        IndexStore.open(saved_index)
    with pytest.raises(StoreError, match="does not exist"):
        IndexStore.open(tmp_path / "nowhere")


def test_unreadable_file_with_matching_size_is_refused(saved_index: Path) -> None:
    # a file of the right size that is not a FAISS index (e.g. a buggy writer)
    path = saved_index / "seg.1.faiss"
    path.write_bytes(b"x" * path.stat().st_size)
    with pytest.raises(StoreError, match="not a readable FAISS index"):
        IndexStore.open(saved_index)


def test_debris_is_ignored_on_load_and_cleaned_on_save(saved_index: Path) -> None:
    debris = [
        ".seg.2.faiss.x1y2.tmp",
        ".manifest.json.abc.tmp",
        "seg.7.faiss",
        "seg.3.del.9.npy",
        "index.2.faiss",
        "items.0.sqlite",
    ]
    for name in debris:
        (saved_index / name).write_bytes(b"half-written")
    (saved_index / "notes.txt").write_text("the user's own file")
    store = IndexStore.open(saved_index)
    assert len(store) == 200
    store.remove(["0"])
    store.save()
    names = sorted(p.name for p in saved_index.iterdir() if p.name != LEASE_DIR)
    assert names == [
        ".lock",
        "manifest.json",
        "notes.txt",
        "seg.1.columns",
        "seg.1.del.2.npy",
        "seg.1.faiss",
        "seg.1.items.sqlite",
    ]
    assert len(IndexStore.open(saved_index)) == 199


def test_second_writer_is_refused(saved_index: Path) -> None:
    first, second = IndexStore.open(saved_index), IndexStore.open(saved_index)
    first.remove(["1"])
    first.save()
    second.remove(["2"])
    with pytest.raises(StoreError, match="another writer"):
        second.save()
    assert "2" in IndexStore.open(saved_index)


def test_an_open_keeps_its_generation_when_a_merge_lands_meanwhile(
    saved_index: Path, monkeypatch
) -> None:
    import vitrieval.index.store._sealed_segment as segment_module

    real_init = segment_module.SealedSegment.__init__
    raced: list[int] = []

    def open_after_a_racing_merge(self, directory, entry, *args):
        if not raced:  # another process merges segment 1 away while it is being opened
            raced.append(entry.number)
            other = IndexStore.open(saved_index)
            other.remove([str(i) for i in range(50)])
            other.save()  # 50 of 200 tombstones: the segment is rewritten as segment 2
            other.close()
        return real_init(self, directory, entry, *args)

    monkeypatch.setattr(segment_module.SealedSegment, "__init__", open_after_a_racing_merge)
    store = IndexStore.open(saved_index)
    assert raced == [1]
    # the open's reader lease kept generation 1's files: it answers from it, whole
    assert store.info()["generation"] == 1 and len(store) == 200 and "5" in store
    assert (saved_index / "seg.1.faiss").exists()
    store.verify()  # every file it reads is still there
    store.close()
    writer = IndexStore.open(saved_index)
    writer.remove(["60"])
    writer.save()  # no reader holds generation 1 any more: its files go
    assert not (saved_index / "seg.1.faiss").exists()
    assert writer.info()["generation"] == 4 and len(writer) == 149


def test_an_open_store_keeps_its_files_while_a_writer_merges(saved_index: Path) -> None:
    import gc

    reader = IndexStore.open(saved_index)
    gc.collect()  # a lease the open did not keep would be closed, and its flock gone
    writer = IndexStore.open(saved_index)
    writer.remove([str(i) for i in range(50)])
    writer.save()  # segment 1 is rewritten as segment 2; the reader still reads 1
    assert (saved_index / "seg.1.faiss").exists()
    reader.verify()  # every file it reads is still there
    assert len(reader) == 200 and "5" in reader
    reader.close()
    writer.close()


@pytest.mark.parametrize("factory", ["Flat", "HNSW16"])
def test_searches_run_safely_during_adds_and_removes(tmp_path: Path, factory: str) -> None:
    x = unit_vectors(np.random.default_rng(21), 400)
    store = build(tmp_path / "idx", x[:200], factory=factory)
    stop, errors = threading.Event(), []

    def search_until_stopped() -> None:
        while not stop.is_set():
            try:
                hits = store.search(x[:40], 5)
                assert all(len(row) == 5 for row in hits)
            except Exception as exc:  # collected: assertions in threads do not fail tests
                errors.append(exc)
                return

    threads = [threading.Thread(target=search_until_stopped) for _ in range(3)]
    for thread in threads:
        thread.start()
    for start in range(200, 400, 10):
        store.add([str(i) for i in range(start, start + 10)], x[start : start + 10])
        assert store.remove([str(i) for i in range(start - 200, start - 190)]) == 10
    stop.set()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(store) == 200 and store.keys() == [str(i) for i in range(200, 400)]
    assert [row[0].key for row in store.search(x[200:], 1)] == store.keys()


# -- crash safety ------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from vitrieval.index.store import IndexStore

    directory, factory = sys.argv[1], sys.argv[2]
    DIM, BATCH, WINDOW = 16, 64, 3

    def batch(gen):
        x = np.random.default_rng(gen).standard_normal((BATCH, DIM))
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    if os.path.exists(os.path.join(directory, "manifest.json")):
        store = IndexStore.open(directory)
    else:
        store = IndexStore.create(directory, dim=DIM, factory=factory)
    print("ready", flush=True)
    def last_batch():
        return max((int(k.split("-")[0][1:]) for k in store.keys()), default=0)

    while True:
        # after batch g is saved, the store holds batches max(1, g - 2) .. g (saves may
        # also merge segments: generations and batches do not keep step)
        gen = last_batch() + 1
        store.add([f"g{gen}-{i}" for i in range(BATCH)], batch(gen), labels=[str(gen)] * BATCH)
        store.remove([f"g{gen - WINDOW}-{i}" for i in range(BATCH)])
        store.save()
        print(gen, flush=True)
    """
)
CRASH_BATCH, CRASH_WINDOW = 64, 3


def expected_batch(gen: int) -> np.ndarray:
    x = np.random.default_rng(gen).standard_normal((CRASH_BATCH, 16))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def check_committed_state(directory: Path, last_reported: int) -> tuple[int, bool]:
    """Open after a kill; the state must be exactly generation last_reported or the one
    after (saved, but killed before it could report). Returns (generation, debris seen)."""
    listed = json.loads((directory / "manifest.json").read_text())
    store = IndexStore.open(directory)
    gen = max((int(k.split("-")[0][1:]) for k in store), default=0)
    assert gen in (last_reported, last_reported + 1)
    batches = range(max(1, gen - CRASH_WINDOW + 1), gen + 1)
    expected_keys = [f"g{b}-{i}" for b in batches for i in range(CRASH_BATCH)]
    assert store.keys() == expected_keys and len(store) == len(expected_keys)
    for b in batches:
        vectors = expected_batch(b)
        for i in (0, CRASH_BATCH - 1):
            assert np.array_equal(store.get(f"g{b}-{i}").vector, vectors[i])
        top = store.search(vectors, 1, label=str(b))
        assert [row[0].key for row in top] == [f"g{b}-{i}" for i in range(CRASH_BATCH)]
    known = {"manifest.json", ".lock"}
    for segment in listed["segments"]:
        known.update(segment["files"])
        if segment["tombstones"]:
            known.add(segment["tombstones"]["file"])
    debris = any(p.name not in known for p in directory.iterdir())
    store.close()
    return gen, debris


def test_sigkill_during_saves_leaves_a_committed_state(tmp_path: Path) -> None:
    started = time.perf_counter()
    rng = random.Random(16)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    last = {"Flat": 0, "HNSW16": 0}
    trials, with_debris = 20, 0
    for trial in range(trials):
        factory = "Flat" if trial % 2 == 0 else "HNSW16"
        directory = tmp_path / factory
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(directory), factory],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert child.stdout is not None
        ready = child.stdout.readline()
        assert ready == "ready\n", child.communicate()[1]
        time.sleep(rng.uniform(0.05, 0.5))
        os.kill(child.pid, signal.SIGKILL)
        out, _ = child.communicate()
        assert child.returncode == -signal.SIGKILL
        reported = [int(line) for line in out.split()]
        assert reported == sorted(reported) and (not reported or reported[0] >= last[factory])
        last[factory], debris = check_committed_state(directory, max([last[factory], *reported]))
        with_debris += debris
    elapsed = time.perf_counter() - started
    print(f"{trials} SIGKILL trials in {elapsed:.1f}s; {with_debris} killed mid-save")
    assert min(last.values()) >= 5  # the children did commit many generations
