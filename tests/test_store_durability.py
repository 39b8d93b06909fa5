"""index.store durability: damaged or missing files refused, debris ignored, one writer,
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

from index.store import IndexStore, StoreError

REPO = Path(__file__).resolve().parents[1]


# -- damaged files ---------------------------------------------------------------------------


@pytest.fixture
def saved_index(tmp_path: Path) -> Path:
    x = unit_vectors(np.random.default_rng(15), 200)
    build(tmp_path / "idx", x, labels=["a"] * 200).save()
    return tmp_path / "idx"


@pytest.mark.parametrize("name", ["index.1.faiss", "items.1.sqlite"])
@pytest.mark.parametrize("damage", ["truncate", "flip", "missing"])
def test_damaged_files_are_refused(saved_index: Path, name: str, damage: str) -> None:
    path = saved_index / name
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size - 100])
    elif damage == "flip":
        flip_byte(path, path.stat().st_size // 2)
    else:
        path.unlink()
    expected = "missing" if damage == "missing" else "checksum mismatch"
    with pytest.raises(StoreError, match=f"{expected}.*{name}|{name}.*{expected}"):
        IndexStore.open(saved_index)


def test_missing_or_bad_manifest_is_refused(saved_index: Path, tmp_path: Path) -> None:
    manifest = saved_index / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(StoreError, match="not valid JSON"):
        IndexStore.open(saved_index)
    data = json.loads(text)
    data["files"]["../outside.faiss"] = {"sha256": "0", "bytes": 1}
    manifest.write_text(json.dumps(data))
    with pytest.raises(StoreError, match="unexpected file name"):
        IndexStore.open(saved_index)
    manifest.unlink()
    with pytest.raises(StoreError, match=r"manifest.json not found"):
        IndexStore.open(saved_index)
    with pytest.raises(StoreError, match="does not exist"):
        IndexStore.open(tmp_path / "nowhere")


def test_unreadable_file_with_matching_checksum_is_refused(saved_index: Path) -> None:
    # a file that passes its checksum but is not a FAISS index (e.g. a buggy writer)
    garbage = b"this is not a faiss index" * 10
    (saved_index / "index.1.faiss").write_bytes(garbage)
    data = json.loads((saved_index / "manifest.json").read_text())
    import hashlib

    data["files"]["index.1.faiss"] = {"sha256": hashlib.sha256(garbage).hexdigest(), "bytes": 250}
    (saved_index / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(StoreError, match="not a readable FAISS index"):
        IndexStore.open(saved_index)


def test_debris_is_ignored_on_load_and_cleaned_on_save(saved_index: Path) -> None:
    debris = [
        ".index.2.faiss.x1y2.tmp",
        ".manifest.json.abc.tmp",
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
    names = sorted(p.name for p in saved_index.iterdir())
    assert names == [".lock", "index.2.faiss", "items.2.sqlite", "manifest.json", "notes.txt"]
    assert len(IndexStore.open(saved_index)) == 199


def test_second_writer_is_refused(saved_index: Path) -> None:
    first, second = IndexStore.open(saved_index), IndexStore.open(saved_index)
    first.remove(["1"])
    first.save()
    second.remove(["2"])
    with pytest.raises(StoreError, match="another writer"):
        second.save()
    assert "2" in IndexStore.open(saved_index)


def test_open_retries_when_a_save_lands_meanwhile(saved_index: Path, monkeypatch) -> None:
    import index.store.manifest as manifest_module

    real_read = manifest_module.read_verified
    raced: list[str] = []

    def read_after_a_racing_save(directory: Path, name: str, expected):
        if not raced:  # another process commits generation 2 and deletes generation 1
            raced.append(name)
            other = IndexStore.open(saved_index)
            other.remove(["5"])
            other.save()
        return real_read(directory, name, expected)

    monkeypatch.setattr(manifest_module, "read_verified", read_after_a_racing_save)
    store = IndexStore.open(saved_index)
    assert raced == ["index.1.faiss"]
    assert store.info()["generation"] == 2 and len(store) == 199 and "5" not in store


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
    from index.store import IndexStore

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
    while True:
        # generation g holds batches max(1, g - 2) .. g
        gen = (store.info()["generation"] or 0) + 1
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
    gen = store.info()["generation"]
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
    known = {"manifest.json", ".lock", *listed["files"]}
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
