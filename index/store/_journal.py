"""Write-ahead journal: mutations made durable one by one, between two saves.

`IndexStore.save()` writes a whole generation, which is right for a batch build but
far too slow to run after every single add of a live server. A store opened with
`journal=True` therefore writes each add or remove to INDEX/journal.sqlite first
(one SQLite transaction, synchronous=FULL, so the commit has reached the disk when
`add()` returns) and applies it in memory; a later save() commits a generation that
contains everything journalled so far and then deletes those journal rows.

Every `IndexStore.open()` replays the rows still in the journal on top of the
committed generation, whoever opens the folder (the server after a crash, or the
`vitrieval-index` CLI). Replay is idempotent: an add is replayed as add-or-replace
and a remove of an absent key is a no-op, so rows that a crash left behind after
their generation was already committed apply cleanly a second time.

Every row carries a SHA-256 checksum over everything replay uses (its seq, op, key,
label, path, metadata and vector bytes). Replay verifies each row before applying
anything from it, and a row that fails stops the open with `JournalIntegrityError`:
a journal altered on disk (a flipped bit, a hand edit) must never be served, nor
saved into a checksummed generation by the next save. Journals written before rows
carried checksums are upgraded in place on open: their rows up to
`meta.legacy_upto` replay without one, once; the next save truncates them.

Tables::

    ops(seq INTEGER PRIMARY KEY AUTOINCREMENT, op TEXT ('add' | 'remove'),
        key TEXT NOT NULL, label TEXT, path TEXT, metadata TEXT (JSON object),
        vector BLOB (dim little-endian float32; NULL for 'remove'),
        checksum TEXT (hex SHA-256 of the row, see `row_checksum`))
    meta(name TEXT PRIMARY KEY, value INTEGER)   -- legacy_upto, journal_id

The manifest records the journal's id and the last row its commit holds ("journal":
{"id", "upto"}); replay skips those rows, so a crash between a commit and the
truncation of the rows it holds (or a new index saved over an old one with a
journal) never applies them twice, or to the wrong index.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import StoreError

JOURNAL_FILE = "journal.sqlite"
JOURNAL_LOCK_FILE = ".journal.lock"

_OPS_TABLE = """
CREATE TABLE IF NOT EXISTS ops (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    op TEXT NOT NULL CHECK (op IN ('add', 'remove')),
    key TEXT NOT NULL,
    label TEXT,
    path TEXT,
    metadata TEXT,
    vector BLOB,
    checksum TEXT
)
"""
_META_TABLE = "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)"
_COLUMNS = "seq, op, key, label, path, metadata, vector, checksum"


def row_checksum(
    seq: int,
    op: str,
    key: str,
    label: str | None,
    path: str | None,
    metadata: str | None,
    vector: bytes | None,
) -> str:
    """Hex SHA-256 of one journal row: each field length-prefixed (NULL distinct from
    empty), so no two different rows share an encoding."""
    digest = hashlib.sha256(seq.to_bytes(8, "little", signed=True))
    for field in (op, key, label, path, metadata, vector):
        if field is None:
            digest.update(b"\x00")
            continue
        data = field if isinstance(field, bytes) else field.encode("utf-8")
        digest.update(b"\x01" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


@dataclass(frozen=True)
class JournalEntry:
    """One journalled mutation; `vector` is float32 (dim,) for adds, None for removes."""

    seq: int
    op: str
    key: str
    label: str | None
    path: str | None
    metadata: dict
    vector: np.ndarray | None


class JournalIntegrityError(StoreError):
    """A journal row fails its checksum: the file was altered after it was written."""


class JournalWriteError(StoreError):
    """The journal could not be written (a full or failing disk): the server's fault,
    not the client's."""


class JournalOwner:
    """An exclusive lock on INDEX/.journal.lock, held for the whole life of a store
    that journals (a server): a second journalling store, or a plain store's save(),
    would otherwise truncate rows it never applied. The kernel drops the lock when the
    holder dies, so a crash never leaves the index locked."""

    def __init__(self, directory: Path) -> None:
        self._fd: int | None = os.open(directory / JOURNAL_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise StoreError(
                f"{directory} is already open for writing by another process (a running "
                "vitrieval-serve?); stop it first"
            ) from None

    @staticmethod
    def check_free(directory: Path) -> None:
        """StoreError if another process owns the folder's journal right now."""
        path = directory / JOURNAL_LOCK_FILE
        if not path.exists():
            return
        JournalOwner(directory).release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Journal:
    """INDEX/journal.sqlite (see the module docstring). Not thread-safe by itself: the
    store calls it under its own lock."""

    def __init__(self, path: Path, dim: int) -> None:
        self.path = path
        self.dim = dim
        try:
            # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            # FULL: a commit is on the disk (WAL fsynced) before it returns
            self._db.execute("PRAGMA synchronous=FULL")
            self.legacy_upto = self._prepare_schema()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path}: cannot open the mutation journal ({exc})") from None

    def _prepare_schema(self) -> int:
        """Create the tables, or add the checksum column to a journal written before
        rows had one; returns the last seq allowed to lack a checksum."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute(_OPS_TABLE)
            db.execute(_META_TABLE)
            columns = {row[1] for row in db.execute("PRAGMA table_info(ops)")}
            if "checksum" not in columns:
                db.execute("ALTER TABLE ops ADD COLUMN checksum TEXT")
                (legacy,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM ops").fetchone()
                db.execute("INSERT OR REPLACE INTO meta VALUES ('legacy_upto', ?)", (legacy,))
            row = db.execute("SELECT value FROM meta WHERE name = 'legacy_upto'").fetchone()
            # names this journal file: a manifest records which journal's rows it holds
            db.execute(
                "INSERT OR IGNORE INTO meta VALUES ('journal_id', ?)",
                (secrets.randbits(62),),
            )
            (self.id,) = db.execute("SELECT value FROM meta WHERE name = 'journal_id'").fetchone()
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return int(row[0]) if row else 0

    @classmethod
    def open_existing(cls, directory: Path, dim: int) -> Journal | None:
        """The folder's journal if the file exists (None otherwise; nothing is created)."""
        path = directory / JOURNAL_FILE
        return cls(path, dim) if path.is_file() else None

    def append(
        self,
        op: str,
        keys: Sequence[str],
        *,
        vectors: np.ndarray | None = None,
        labels: Sequence[str | None] | None = None,
        paths: Sequence[str | None] | None = None,
        metadata: Sequence[str] | None = None,
    ) -> int:
        """Write one row per key in a single durable transaction; returns the last seq.

        For op="add", `vectors` is float32 (n, dim) and `metadata` JSON text per key.
        """
        n = len(keys)
        if op == "add":
            assert vectors is not None and vectors.shape == (n, self.dim)
            fields = [
                (
                    op,
                    keys[i],
                    labels[i] if labels else None,
                    paths[i] if paths else None,
                    metadata[i] if metadata else "{}",
                    np.ascontiguousarray(vectors[i], dtype="<f4").tobytes(),
                )
                for i in range(n)
            ]
        elif op == "remove":
            fields = [(op, key, None, None, None, None) for key in keys]
        else:
            raise ValueError(f"unknown journal op {op!r}")
        try:
            self._db.execute("BEGIN IMMEDIATE")
            # seq is assigned here, not by SQLite, so that the checksum covers it: a row
            # moved to another place in the replay order fails its check
            first = self._next_seq()
            rows = [
                (first + i, *row, row_checksum(first + i, *row)) for i, row in enumerate(fields)
            ]
            self._db.executemany(f"INSERT INTO ops ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)", rows)
            last = first + n - 1
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise JournalWriteError(
                f"{self.path}: cannot write the mutation journal ({exc})"
            ) from None
        return int(last)

    def _next_seq(self) -> int:
        """The seq AUTOINCREMENT would give next (never reuses a truncated row's)."""
        (used,) = self._db.execute(
            "SELECT MAX(COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'ops'), 0),"
            " COALESCE((SELECT MAX(seq) FROM ops), 0))"
        ).fetchone()
        return int(used) + 1

    def discard(self, after: int) -> None:
        """Delete rows with seq > `after` (a mutation that failed after being journalled)."""
        self._db.execute("DELETE FROM ops WHERE seq > ?", (after,))

    def delete(self, seqs: Sequence[int]) -> None:
        """Delete the rows `seqs` in one durable transaction (rows set aside)."""
        self._db.execute("BEGIN IMMEDIATE")
        self._db.executemany("DELETE FROM ops WHERE seq = ?", [(int(s),) for s in seqs])
        self._db.execute("COMMIT")

    def last_seq(self) -> int:
        (last,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM ops").fetchone()
        return int(last)

    def __len__(self) -> int:
        (count,) = self._db.execute("SELECT COUNT(*) FROM ops").fetchone()
        return int(count)

    def entries(self) -> Iterator[JournalEntry]:
        """Every row in seq order (the order the mutations were acknowledged in), each
        verified against its checksum before it is yielded (JournalIntegrityError)."""
        try:
            cursor = self._db.execute(f"SELECT {_COLUMNS} FROM ops ORDER BY seq")
            for seq, op, key, label, path, metadata, blob, checksum in cursor:
                self._verify(seq, op, key, label, path, metadata, blob, checksum)
                vector = None
                if op == "add":
                    vector = np.frombuffer(blob, dtype="<f4").astype(np.float32)
                    if vector.shape != (self.dim,):
                        raise StoreError(
                            f"{self.path}: journal row {seq} holds a {vector.size}-d vector, "
                            f"the index is {self.dim}-d"
                        )
                yield JournalEntry(seq, op, key, label, path, json.loads(metadata or "{}"), vector)
        except (sqlite3.DatabaseError, ValueError) as exc:
            raise StoreError(f"{self.path}: the mutation journal is damaged ({exc})") from None

    def _verify(self, seq: Any, *fields: Any) -> None:
        *row, checksum = fields
        if checksum is None and isinstance(seq, int) and seq <= self.legacy_upto:
            return  # written before rows carried checksums; replayed once, as then
        try:
            expected = row_checksum(seq, *row)
        except (TypeError, AttributeError, OverflowError, UnicodeEncodeError):
            expected = None  # a field of the wrong type: altered too
        if checksum is None or expected != checksum:
            raise JournalIntegrityError(
                f"{self.path}: journal row {seq} fails its checksum (altered after it was "
                "written); the index was not opened, nothing was served or saved. To "
                "recover, see 'a damaged journal' in docs/index.md"
            )

    def truncate(self, upto: int) -> None:
        """Delete rows with seq <= `upto`: they are in a committed generation now."""
        self._db.execute("DELETE FROM ops WHERE seq <= ?", (upto,))
        if len(self) == 0:
            # keep the WAL file from growing without bound on a busy server
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        self._db.close()
