"""Tests for the store's write-ahead journal (index/store/_journal.py): mutations are
durable on return, replayed on open, idempotent when replayed twice, discarded when
they fail, and survive SIGKILL."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from vitrieval.index.store import IndexStore, StoreError
from vitrieval.index.store._journal import JOURNAL_FILE, JournalIntegrityError, row_checksum

REPO = Path(__file__).resolve().parents[1]
DIM = 16


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def journal_rows(directory: Path) -> int:
    with sqlite3.connect(directory / JOURNAL_FILE) as db:
        return db.execute("SELECT COUNT(*) FROM ops").fetchone()[0]


@pytest.fixture
def saved_index(tmp_path: Path) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(0)
    x = unit(rng, 10)
    store = IndexStore.create(tmp_path / "idx", dim=DIM)
    store.add([f"k{i}" for i in range(10)], x, labels=[str(i % 2) for i in range(10)])
    store.save()
    store.close()
    return tmp_path / "idx", x


def test_unsaved_mutations_come_back_from_the_journal(saved_index) -> None:
    directory, _ = saved_index
    rng = np.random.default_rng(1)
    extra = unit(rng, 3)
    store = IndexStore.open(directory, journal=True)
    store.add(["new0", "new1", "new2"], extra, labels=["a", "b", None], metadata=[{"n": 1}] * 3)
    store.remove(["k0", "k1", "absent"])
    store.add(["k2"], extra[:1], replace=True)
    assert journal_rows(directory) == 3 + 2 + 1  # the absent key is not journalled
    store.close()  # no save: only the journal holds the changes

    reopened = IndexStore.open(directory)  # a plain open replays too
    assert len(reopened) == 10 + 3 - 2
    assert "k0" not in reopened and "k1" not in reopened
    record = reopened.get("new0")
    assert record.label == "a" and record.metadata == {"n": 1}
    np.testing.assert_array_equal(record.vector, extra[0])
    np.testing.assert_array_equal(reopened.get("k2").vector, extra[0])
    top = reopened.search(extra[1:2], 1)[0][0]
    assert top.key == "new1" and top.score == pytest.approx(1.0, abs=1e-6)
    assert reopened.info()["journal_pending"] == 6
    reopened.save()  # commits a generation holding them and empties the journal
    assert journal_rows(directory) == 0
    reopened.close()
    again = IndexStore.open(directory)
    expected = [f"k{i}" for i in range(2, 10)] + ["new0", "new1", "new2"]
    assert sorted(again.keys()) == sorted(expected)


def test_replaying_rows_already_committed_changes_nothing(saved_index) -> None:
    """A crash between a save's commit and its journal truncation replays rows that the
    generation already holds; replay is idempotent."""
    directory, x = saved_index
    store = IndexStore.open(directory, journal=True)
    store.add(["n"], x[:1] * 1.0, labels=["z"])
    store.remove(["k3"])
    with sqlite3.connect(directory / JOURNAL_FILE) as db:
        saved_rows = db.execute("SELECT * FROM ops").fetchall()
    store.save()
    store.close()
    assert journal_rows(directory) == 0
    with sqlite3.connect(directory / JOURNAL_FILE) as db:  # put the rows back
        db.executemany("INSERT INTO ops VALUES (?,?,?,?,?,?,?,?)", saved_rows)
    reopened = IndexStore.open(directory)
    assert len(reopened) == 10  # 10 + 1 - 1, not more
    assert "k3" not in reopened and reopened.get("n").label == "z"
    assert [h.key for h in reopened.search(x[:1], 2)[0]] == ["k0", "n"]


def test_failed_mutations_leave_no_journal_row(saved_index) -> None:
    directory, x = saved_index
    store = IndexStore.open(directory, journal=True)
    with pytest.raises(StoreError, match="already in the index"):
        store.add(["k5"], x[:1])
    with pytest.raises(StoreError):
        store.add(["bad"], x[:1] * 3)  # not unit norm
    assert store.remove(["nobody"]) == 0
    assert journal_rows(directory) == 0
    store.close()


def test_rebuilding_over_an_index_discards_its_journal(saved_index) -> None:
    directory, x = saved_index
    store = IndexStore.open(directory, journal=True)
    store.add(["pending"], x[:1] * 1.0)
    store.close()
    fresh = IndexStore.create(directory, dim=DIM, overwrite=True)
    fresh.add(["only"], x[1:2])
    fresh.save()
    fresh.close()
    reopened = IndexStore.open(directory)
    assert reopened.keys() == ["only"]


def test_a_damaged_journal_is_refused(saved_index) -> None:
    directory, _ = saved_index
    (directory / JOURNAL_FILE).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="journal"):
        IndexStore.open(directory)


_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from vitrieval.index.store import IndexStore

    store = IndexStore.open(sys.argv[1], journal=True)
    rng = np.random.default_rng(7)
    for i in range(100000):
        v = rng.standard_normal((1, 16))
        v = (v / np.linalg.norm(v)).astype(np.float32)
        store.add([f"a{i}"], v, labels=[str(i % 3)])
        if i % 7 == 3:
            store.remove([f"a{i - 1}"])
            print(f"removed a{i - 1}", flush=True)
        print(f"added a{i}", flush=True)
        if i % 50 == 49:
            store.save()
    """
)


def test_sigkill_keeps_every_acknowledged_mutation(saved_index) -> None:
    directory, _ = saved_index
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(directory)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    acked: list[str] = []
    for line in child.stdout:
        acked.append(line.strip())
        if len(acked) >= 230:  # past several saves, and between two
            break
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    # what the child printed before the kill and nobody read yet was acknowledged too
    acked.extend(line.strip() for line in child.stdout.read().splitlines())
    added = {line.split()[1] for line in acked if line.startswith("added")}
    removed = {line.split()[1] for line in acked if line.startswith("removed")}
    store = IndexStore.open(directory)
    keys = set(store.keys())
    missing = (added - removed) - keys
    # the only add allowed to be gone is one whose removal was in flight at the kill
    last = max(int(key[1:]) for key in added)
    in_flight_removal = {f"a{last}"} if (last + 1) % 7 == 3 else set()
    assert missing <= in_flight_removal, f"acknowledged adds missing: {sorted(missing)}"
    assert not (removed & keys), "an acknowledged remove came back"
    # at most the one in-flight add beyond what was acknowledged, and complete if present
    unacked = keys - added - {f"k{i}" for i in range(10)}
    assert len(unacked) <= 1
    for key in keys:
        record = store.get(key)
        assert record.vector.shape == (16,)
        assert abs(float(np.linalg.norm(record.vector)) - 1) < 1e-5


def test_one_journalling_writer_at_a_time(saved_index) -> None:
    """A second writer would truncate journal rows it never applied: refused."""
    directory, x = saved_index
    server = IndexStore.open(directory, journal=True)
    server.add(["by-server"], x[:1] * 1.0)
    with pytest.raises(StoreError, match="already open for writing"):
        IndexStore.open(directory, journal=True)
    cli = IndexStore.open(directory)  # reading (and replaying) is fine
    assert "by-server" in cli
    cli.add(["by-cli"], x[1:2])
    with pytest.raises(StoreError, match="already open for writing"):
        cli.save()
    cli.close()
    server.close()  # releases the folder
    again = IndexStore.open(directory, journal=True)
    assert "by-server" in again and "by-cli" not in again
    assert again.journal_pending == 1
    again.save()
    assert again.journal_pending == 0
    again.close()


# -- integrity: checksummed rows ----------------------------------------------------------


def _flip_vector_byte(directory: Path, row: int = 0) -> None:
    """Alter one byte of a journalled vector in place, as a bad disk or a hand edit would."""
    with sqlite3.connect(directory / JOURNAL_FILE) as db:
        seq, blob = db.execute(
            "SELECT seq, vector FROM ops WHERE op = 'add' ORDER BY seq"
        ).fetchall()[row]
        altered = bytearray(blob)
        altered[5] ^= 0x40
        db.execute("UPDATE ops SET vector = ? WHERE seq = ?", (bytes(altered), seq))


def test_an_altered_journal_row_stops_the_open_and_nothing_is_saved(saved_index) -> None:
    directory, x = saved_index
    store = IndexStore.open(directory, journal=True)
    store.add(["a", "b"], x[:2], labels=["p", "q"])
    store._state.detach_journal()  # a SIGKILL: nothing saved, the journal holds the adds
    store.close()
    manifest_before = (directory / "manifest.json").read_bytes()
    _flip_vector_byte(directory, row=1)
    for journal in (False, True):
        with pytest.raises(JournalIntegrityError, match=r"journal row 2 fails its checksum"):
            IndexStore.open(directory, journal=journal)
    assert (directory / "manifest.json").read_bytes() == manifest_before
    assert journal_rows(directory) == 2  # kept for the operator, not truncated


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE ops SET key = 'other' WHERE seq = 1",
        "UPDATE ops SET label = NULL WHERE seq = 1",
        "UPDATE ops SET metadata = '{\"n\": 2}' WHERE seq = 1",
        "UPDATE ops SET op = 'remove', vector = NULL WHERE seq = 1",
        "UPDATE ops SET seq = 7 WHERE seq = 1",  # moved in the replay order
        "UPDATE ops SET checksum = NULL WHERE seq = 1",
    ],
    ids=["key", "label", "metadata", "op", "seq", "checksum-dropped"],
)
def test_every_replayed_field_is_covered_by_the_checksum(saved_index, edit) -> None:
    directory, x = saved_index
    store = IndexStore.open(directory, journal=True)
    store.add(["a"], x[:1], labels=["p"], metadata=[{"n": 1}])
    store._state.detach_journal()
    store.close()
    with sqlite3.connect(directory / JOURNAL_FILE) as db:
        db.execute(edit)
    with pytest.raises(JournalIntegrityError):
        IndexStore.open(directory)


def test_a_journal_written_before_checksums_replays_once_then_is_truncated(saved_index) -> None:
    """Rows from before the checksum column replay as they always did; the next save
    truncates them; a row without a checksum written after the upgrade is refused."""
    directory, x = saved_index
    vector = np.ascontiguousarray(x[0] * 1.0, dtype="<f4").tobytes()
    with sqlite3.connect(directory / JOURNAL_FILE) as db:  # the schema of earlier releases
        db.execute(
            "CREATE TABLE ops (seq INTEGER PRIMARY KEY AUTOINCREMENT, op TEXT NOT NULL, "
            "key TEXT NOT NULL, label TEXT, path TEXT, metadata TEXT, vector BLOB)"
        )
        db.execute(
            "INSERT INTO ops (op, key, label, path, metadata, vector) VALUES (?,?,?,?,?,?)",
            ("add", "legacy", "L", None, "{}", vector),
        )
    store = IndexStore.open(directory, journal=True)
    assert store.get("legacy").label == "L" and len(store) == 11
    store.add(["new"], x[1:2])
    store.save()
    store.close()
    assert journal_rows(directory) == 0
    reopened = IndexStore.open(directory)
    assert "legacy" in reopened and "new" in reopened
    reopened.close()
    with sqlite3.connect(directory / JOURNAL_FILE) as db:  # a checksum-less row now: refused
        db.execute(
            "INSERT INTO ops (op, key, label, path, metadata, vector) VALUES (?,?,?,?,?,?)",
            ("add", "forged", None, None, "{}", vector),
        )
    with pytest.raises(JournalIntegrityError):
        IndexStore.open(directory)


def test_row_checksum_matches_a_hand_computation() -> None:
    import hashlib

    def field(data: bytes) -> bytes:
        return b"\x01" + len(data).to_bytes(8, "little") + data

    expected = hashlib.sha256(
        (3).to_bytes(8, "little")
        + field(b"add")
        + field("clé".encode())
        + b"\x00"  # label NULL
        + field(b"")  # path empty, not NULL
        + field(b"{}")
        + field(b"\x00\x00\x80\x3f")
    ).hexdigest()
    assert row_checksum(3, "add", "clé", None, "", "{}", b"\x00\x00\x80\x3f") == expected
    assert row_checksum(3, "add", "clé", "", None, "{}", b"\x00\x00\x80\x3f") != expected
