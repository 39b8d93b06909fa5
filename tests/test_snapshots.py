"""Snapshots (index/store/snapshot.py, `vitrieval-index snapshot` and `restore`): a
snapshot restores to exactly the acknowledged items, journal rows included, also when
taken while a writer adds and saves; a damaged index or snapshot is refused whole; the
CLI refuses an index a server owns and leaves no half file."""

from __future__ import annotations

import io
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py
from store_helpers import flip_byte, unit_vectors

from vitrieval.index.store import IndexStore, StoreError
from vitrieval.index.store.snapshot import SNAPSHOT_FILE, restore_snapshot, write_snapshot

DIM = 16


def items(store: IndexStore) -> dict[str, tuple]:
    return {
        key: (record.label, record.metadata, record.vector.tobytes())
        for key in list(store.keys())  # a list of keys, not a dict
        if (record := store.get(key)) is not None
    }


@pytest.fixture
def index(tmp_path: Path) -> Path:
    """Two committed generations, then journal rows: 30 adds and 5 removes unsaved."""
    rng = np.random.default_rng(0)
    directory = tmp_path / "index"
    store = IndexStore.create(directory, dim=DIM)
    store.add([f"a{i:03d}" for i in range(60)], unit_vectors(rng, 60, DIM),
              labels=["x"] * 60, metadata=[{"n": i} for i in range(60)])  # fmt: skip
    store.save()
    store.add([f"b{i:03d}" for i in range(40)], unit_vectors(rng, 40, DIM))
    store.save()
    store.close()
    with IndexStore.open(directory, journal=True) as live:
        live.add([f"c{i:03d}" for i in range(30)], unit_vectors(rng, 30, DIM))
        live.remove([f"a{i:03d}" for i in range(5)])
        assert live.info()["journal_pending"] > 0
    return directory


def test_the_cli_round_trip_restores_every_item_journal_rows_included(
    index: Path, tmp_path: Path, capsys
) -> None:
    with IndexStore.open(index) as store:
        expected = items(store)
    assert len(expected) == 125
    code, out, err = run(capsys, "snapshot", index, "--out", tmp_path / "snap.tar")
    assert code == 0, err
    assert "generation 2, 100 items committed" in out
    code, out, err = run(capsys, "restore", tmp_path / "snap.tar", "--out", tmp_path / "back")
    assert code == 0, err
    assert "125 items" in out
    with IndexStore.open(tmp_path / "back", verify=True) as store:
        assert items(store) == expected
    # into a folder that holds something: refused, nothing touched
    code, _, err = run(capsys, "restore", tmp_path / "snap.tar", "--out", tmp_path / "back")
    assert code == 2 and "not an empty folder" in err


def test_a_snapshot_taken_while_a_writer_adds_and_saves_holds_an_acknowledged_prefix(
    index: Path, tmp_path: Path
) -> None:
    rng = np.random.default_rng(1)
    vectors = unit_vectors(rng, 4000, DIM)
    acked = [0]
    stop = threading.Event()
    live = IndexStore.open(index, journal=True)
    before = set(live.keys())

    def write() -> None:
        for i in range(len(vectors)):
            if stop.is_set():
                return
            live.add([f"w{i:05d}"], vectors[i : i + 1])
            acked[0] = i + 1
            if i % 300 == 299:
                live.save()  # commits meanwhile: the snapshot must notice and retry

    writer = threading.Thread(target=write)
    writer.start()
    try:
        while acked[0] < 200:
            stop.wait(0.01)
        first = acked[0]
        buffer = io.BytesIO()
        write_snapshot(index, buffer)
        last = acked[0]
    finally:
        stop.set()
        writer.join()
        live.close()
    buffer.seek(0)
    restore_snapshot(buffer, tmp_path / "back")
    with IndexStore.open(tmp_path / "back") as store:
        keys = set(store.keys())
    written = sorted(keys - before)
    m = len(written)
    assert first <= m <= last, (first, m, last)
    assert written == [f"w{i:05d}" for i in range(m)]  # a prefix: nothing acked is lost
    assert before <= keys


def test_a_damaged_file_fails_the_snapshot(index: Path) -> None:
    segment = sorted(index.glob("seg.*.faiss"))[0]
    flip_byte(segment, 200)
    with pytest.raises(StoreError, match="sha256 differs"):
        write_snapshot(index, io.BytesIO())


def test_a_damaged_or_foreign_stream_restores_nothing(index: Path, tmp_path: Path) -> None:
    buffer = io.BytesIO()
    write_snapshot(index, buffer)
    data = bytearray(buffer.getvalue())
    # a byte of a member's content changed: that member is "altered"
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".faiss"))
    data[member.offset_data + 130] ^= 0xFF
    with pytest.raises(StoreError, match="altered"):
        restore_snapshot(io.BytesIO(bytes(data)), tmp_path / "bad")
    # cut short, and not a snapshot at all
    with pytest.raises(StoreError, match=r"not a complete snapshot|missing"):
        restore_snapshot(io.BytesIO(buffer.getvalue()[: len(data) // 2]), tmp_path / "bad")
    deep = b"[" * 20_000 + b"]" * 20_000  # nested past the parser's depth
    for name, content in (("notes.txt", b"hi"), (SNAPSHOT_FILE, deep)):
        plain = io.BytesIO()
        with tarfile.open(fileobj=plain, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
        with pytest.raises(StoreError, match=f"valid {SNAPSHOT_FILE}"):
            restore_snapshot(io.BytesIO(plain.getvalue()), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bad.restore-")]


def test_the_cli_refuses_an_index_a_server_owns(index: Path, tmp_path: Path, capsys) -> None:
    with IndexStore.open(index, journal=True):
        code, _, err = run(capsys, "snapshot", index, "--out", tmp_path / "snap.tar")
    assert code == 2 and "in use by a running server" in err
    assert not (tmp_path / "snap.tar").exists()
