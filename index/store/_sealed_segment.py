"""Sealed segments: immutable files written once, memory-mapped, checksummed once.

One sealed segment n of an index directory is::

    seg.<n>.faiss          the segment's FAISS index (store layout, ids = item ids),
                           opened memory-mapped and read-only
    seg.<n>.items.sqlite   items(id, key, label, path, metadata, row): `row` is the
                           item's position in the vectors (rows are in id order);
                           and the field index filters read (_field_index.py); opened
                           read-only, queried on disk, never loaded whole
    seg.<n>.vectors.npy    float32 (rows, dim), memory-mapped: the exact vectors, for
                           every factory but "Flat" (whose FAISS file holds them)
    seg.<n>.columns        the indexed paths' values as columns, memory-mapped, which
                           answer most filter conditions (_columns.py; format 3: a
                           format-2 segment has none, its field index answers)
    seg.<n>.del.<g>.npy    the segment's tombstones as of generation g (sorted int64
                           ids of items removed since it was sealed); small, rewritten
                           by the save that changes them

The manifest records every file's sha256 and size. Opening checks sizes and headers
only (a 15 GB segment opens in milliseconds); `verify()` reads every byte, and the
store runs it when a segment is sealed, before a merge reads a segment, on
`vitrieval-index verify`, at open when asked, and in the service's background scrub.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import os
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from ..atomic import atomic_path
from . import _columns as cl
from . import _field_index as fx
from . import manifest as mf
from ._filter_plans import leaf_ids, positions
from ._id_order import MERGE_BATCH, check_ascending
from ._items import IN_CHUNK, ItemRecord, chunks, in_list
from ._mapped_vectors import MappedVectors
from ._memory_segment import SegmentRow
from ._vectors import VectorIndex, core_index
from .errors import StoreError, faiss_reason
from .filters import Match, Range

# FAISS maps the codes (flat codes, and an IVF's inverted lists) from the file instead
# of reading them: resident memory follows the pages searches touch. IO_FLAG_MMAP_IFC
# views the mapping as ordinary in-memory lists; IO_FLAG_MMAP would give an IVF
# OnDiskInvertedLists, whose locked list access made an IVF4096,PQ48 search at 1M
# vectors 2.2x slower than the same codes in RAM (0.36 against 2.6 ms at 100k).
MMAP_FLAGS = faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY
SQLITE_MAGIC = b"SQLite format 3\x00"
_ITEMS_SCHEMA = """
CREATE TABLE items (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL,
    label TEXT,
    path TEXT,
    metadata TEXT NOT NULL,
    row INTEGER NOT NULL
)
"""
_ITEMS_INDEXES = (
    # not unique: a segment sealed with tombstones (HNSW) can hold a removed row and its
    # replacement under one key; the store keeps keys unique among live rows
    "CREATE INDEX items_key ON items(key)",
    "CREATE INDEX items_label ON items(label)",
)


def stores_vectors_in_faiss(factory: str) -> bool:
    """Whether the FAISS file of `factory` holds the exact float32 vectors, so no
    separate vectors file is written ("Flat" only: IVF/HNSW flat storage is not
    addressable by position)."""
    return factory == "Flat"


class SealedSegment:
    """A sealed segment opened from its files; tombstones are the only thing that
    changes (`pending_tombstones` until the next save writes them)."""

    def __init__(
        self, directory: Path, entry: mf.SegmentEntry, dim: int, gpu: str, factory: str
    ) -> None:
        self.directory = directory
        self.entry = entry
        self.number = entry.number
        self._name = f"segment {self.number}"  # in log lines and errors
        self.dim = dim
        for name, expected in entry.files.items():
            _check_size(directory / name, expected)
        self.vectors = VectorIndex(self._read_faiss(mf.segment_index_file(self.number)), gpu)
        self._db = self._open_items()
        self.fields = fx.read_selection(self._db)
        self._leaf_cache = fx.LeafCache()
        columns = mf.segment_columns_file(self.number)
        has_columns = columns in entry.files
        self.columns = cl.read_columns(directory / columns) if has_columns else cl.NO_COLUMNS
        self._sorted_ids: np.ndarray | None = None  # read when needed
        self._id_span: tuple[int, int] | None = None  # _id_range, worked out when needed
        self._rows_by_id: np.ndarray | None = None  # _rows_of's, for an unmarked segment
        self._mapped: MappedVectors | None = None  # the vectors file (not for "Flat")
        self._raw = self._open_vectors(factory, self.vectors, mf.segment_vectors_file(self.number))
        self.committed_tombstones = self._read_tombstones()
        self.pending_tombstones: set[int] = set()
        self.live_count = entry.rows - len(self.committed_tombstones)
        self.damaged: str | None = None  # why a verification failed: out of service
        # what each file was when opened: a search stats them first (changed_on_disk)
        self._watch({name: file_identity(directory / name) for name in entry.listed_files()})

    # -- opening ---------------------------------------------------------------------

    def _read_faiss(self, name: str) -> faiss.Index:
        path = self.directory / name
        try:
            index = faiss.read_index(str(path), MMAP_FLAGS)
        except RuntimeError as exc:
            raise StoreError(f"{path} is not a readable FAISS index: {faiss_reason(exc)}") from None
        if index.d != self.dim or index.ntotal != self.entry.rows:
            raise StoreError(
                f"{path} holds {index.ntotal} {index.d}-d vectors; the manifest says "
                f"{self.entry.rows} of {self.dim}-d"
            )
        return index

    def _open_items(self) -> sqlite3.Connection:
        path = self.directory / mf.segment_items_file(self.number)
        with open(path, "rb") as fh:
            if fh.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
                raise StoreError(f"{path} is not an SQLite database (damaged header)")
        try:
            db = sqlite3.connect(
                f"file:{path}?mode=ro&immutable=1", uri=True, check_same_thread=False
            )
            # read through a memory map, not a read() per page: a search's hits are a
            # few random rows, and a page in the page cache is then no system call
            db.execute(f"PRAGMA mmap_size={path.stat().st_size}")
            # the schema only: counting the rows would read the whole table
            columns = [row[1] for row in db.execute("PRAGMA table_info(items)")]
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path} is not a readable item table: {exc}") from None
        if columns != ["id", "key", "label", "path", "metadata", "row"]:
            db.close()
            raise StoreError(f"{path} has no vitrieval item table (columns {columns})")
        return db

    def _open_vectors(self, factory: str, index: VectorIndex, name: str) -> np.ndarray:
        """The exact vectors of `index`: its own flat codes ("Flat"), else file `name`."""
        if stores_vectors_in_faiss(factory):
            core = core_index(index.cpu)
            if not isinstance(core, faiss.IndexFlat):
                raise StoreError(f"segment {self.number}: a Flat factory without a flat index")
            # a zero-copy view of the memory-mapped codes
            return faiss.rev_swig_ptr(core.get_xb(), core.ntotal * self.dim).reshape(
                core.ntotal, self.dim
            )
        path = self.directory / name
        try:
            self._mapped = MappedVectors(path)  # advised random: re-scoring reads rows apart
        except (OSError, ValueError) as exc:
            raise StoreError(f"{path} is not a readable vectors file: {exc}") from None
        raw = self._mapped.array
        if raw.shape != (self.entry.rows, self.dim) or raw.dtype != np.dtype("<f4"):
            raise StoreError(f"{path} holds {raw.shape} {raw.dtype}; expected float32 vectors")
        # a plain ndarray over the mapping (it keeps the map alive): numpy's memmap
        # subclass adds its own overhead to every row gather of an exact search
        return raw

    def _read_tombstones(self) -> set[int]:
        tomb = self.entry.tombstones
        if tomb is None:
            return set()
        data = mf.read_verified(self.directory, tomb.name, tomb.checksum)
        try:
            ids = np.load(io.BytesIO(data), allow_pickle=False)
        except ValueError as exc:
            raise StoreError(f"{self.directory / tomb.name} is damaged: {exc}") from None
        return set(ids.astype(np.int64).tolist())

    def verify(self, bytes_per_s: float | None = None, stop: Any = None) -> None:
        """Check every byte of the segment's files against the manifest (StoreError),
        reading at most `bytes_per_s` when given; `stop` (an Event) ends it early with
        ScrubStopped."""
        for name, expected in self.entry.files.items():
            mf.verify_file(self.directory, name, expected, bytes_per_s, stop)

    def changed_on_disk(self) -> str | None:
        """Why the segment's files are no longer the ones it opened (deleted, truncated,
        replaced: their size, inode, device or mtime differ), or None. A stat a file:
        searches call it first, as a memory-mapped file truncated under FAISS would
        kill the process (SIGBUS) at the next read of a page past its new end."""
        for path, seen in self._watched:
            try:
                now = file_identity(path)
            except FileNotFoundError:
                return f"{path} was deleted while in service"
            except OSError as exc:
                return f"cannot stat {path}: {exc.strerror or exc}"
            if now != seen:
                return (
                    f"{path} changed on disk while in service ({seen[2]} bytes when opened, "
                    f"{now[2]} now; truncated or replaced)"
                )
        return None

    def set_tombstones(self, tombstones: mf.TombstoneEntry) -> None:
        """A save wrote the segment's tombstones anew (under a new name): record it."""
        identity = dict(self._identity)  # replaced whole: searches read it unlocked
        if self.entry.tombstones is not None:
            identity.pop(self.entry.tombstones.name, None)
        identity[tombstones.name] = file_identity(self.directory / tombstones.name)
        self.entry = dataclasses.replace(self.entry, tombstones=tombstones)
        self._watch(identity)

    def _watch(self, identity: dict[str, tuple[int, int, int, int]]) -> None:
        """Record what each file was (name -> file_identity): changed_on_disk compares."""
        self._identity = identity
        # replaced whole, never changed in place: searches read it unlocked; paths as
        # strings, joined once (a join per file per search costs more than its stat)
        folder = str(self.directory)
        self._watched = tuple((os.path.join(folder, n), seen) for n, seen in identity.items())

    # -- state -----------------------------------------------------------------------

    @property
    def tombstones(self) -> set[int]:
        return self.committed_tombstones | self.pending_tombstones

    @property
    def ntotal(self) -> int:
        return self.entry.rows

    def retire(self, ids: np.ndarray) -> None:
        fresh = set(ids.tolist()) - self.tombstones
        self.pending_tombstones.update(fresh)
        self.live_count -= len(fresh)

    # -- reads -----------------------------------------------------------------------

    def _select(self, sql: str, values: Sequence) -> Iterable[tuple]:
        """The rows of `sql`, whose `{marks}` is an `IN (...)` list of `values` (one
        statement per IN_CHUNK of them)."""
        if len(values) <= IN_CHUNK:
            # a search's hits: one statement without the generators (with them and
            # the statement formatted anew, the lookup took 56-57 µs after a scan, 52 now)
            return self._db.execute(in_list(sql, len(values)), values)
        return itertools.chain.from_iterable(
            self._db.execute(in_list(sql, len(chunk)), chunk) for chunk in chunks(values)
        )

    def live_ids(self, keys: Sequence[str]) -> dict[str, int]:
        dead = self.tombstones
        sql = "SELECT key, id FROM items WHERE key IN ({marks})"
        return {key: i for key, i in self._select(sql, list(keys)) if i not in dead}

    def get(self, key: str) -> ItemRecord | None:
        dead = self.tombstones
        rows = self._db.execute(
            "SELECT id, label, path, metadata, row FROM items WHERE key = ?", (key,)
        )
        row = next((r for r in rows if r[0] not in dead), None)
        if row is None:
            return None
        _, label, path, metadata, position = row
        vector = np.array(self._raw[position], dtype=np.float32)
        return ItemRecord(key, label, path, json.loads(metadata), vector)

    def label_ids(self, label: str) -> np.ndarray:
        rows = self._db.execute("SELECT id FROM items WHERE label = ? ORDER BY id", (label,))
        dead = self.tombstones
        return np.fromiter((i for (i,) in rows if i not in dead), dtype=np.int64)

    def keys_after(self, after: str | None, limit: int) -> list[tuple[str, int]]:
        where, values = ("WHERE key > ?", (after, limit)) if after is not None else ("", (limit,))
        sql = f"SELECT key, id FROM items {where} ORDER BY key LIMIT ?"  # the key index
        return list(self._db.execute(sql, values))

    def describe(self, ids: Sequence[int]) -> dict[int, tuple[str, str | None, str | None, str]]:
        sql = "SELECT id, key, label, path, metadata FROM items WHERE id IN ({marks})"
        return {row[0]: row[1:] for row in self._select(sql, ids)}  # SQLite sorts the IN list

    def filter_ids(self, leaf: Match | Range) -> np.ndarray:
        """Sorted ids of the segment's items (tombstoned ones too) where `leaf` holds,
        from the source `filtering.leaf_ids` chooses; remembered, as a sealed
        segment's items never change (fields.LeafCache)."""
        found = self._leaf_cache.get(leaf)
        if found is None:
            found = leaf_ids(leaf, self.columns, self._db, self.fields, self._name)
            self._leaf_cache.put(leaf, found)
        return found

    def write_columns(self) -> None:
        """Give a segment of format 2 its columns file (`vitrieval-index upgrade`), from
        its field index, verified first; the next commit lists it."""
        name = mf.segment_columns_file(self.number)
        if name in self.entry.files:
            return
        self.verify()
        with atomic_path(self.directory / name) as tmp:
            cl.write_columns(self._db, tmp)
            checksum = mf.sha256_file(tmp)
        files = {**self.entry.files, name: checksum}
        self.entry = dataclasses.replace(self.entry, files=files)
        self._watch({**self._identity, name: file_identity(self.directory / name)})
        self.columns = cl.read_columns(self.directory / name)

    def exact_vectors(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, float32 (m, dim) stored vectors) of the segment's items among `ids`
        (sorted int64)."""
        base, rows = self.exact_rows(ids)
        held = rows >= 0
        return ids[held], np.asarray(base[rows[held]], dtype=np.float32).reshape(-1, self.dim)

    def exact_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the memory-mapped float32 (rows, dim) vectors file itself, int64 rows shaped
        as `ids`: each id's row in it, -1 where the segment does not hold it). No row
        is read here: a caller reads only the rows it scores."""
        first, count = self._id_range()
        if count < 0:
            return self._raw, self._rows_of(ids)
        # one unbroken id range (a segment sealed from one run of adds, the usual
        # case): an item's row is its id less the first, no search over the rows
        rows = ids - first
        # every id held: no copy (the ufuncs' own reductions: ndarray.min and .max go
        # through Python wrappers, which a search pays for)
        held = rows.size and np.minimum.reduce(rows, axis=None) >= 0
        if held and np.maximum.reduce(rows, axis=None) < count:
            return self._raw, rows
        return self._raw, np.where((rows >= 0) & (rows < count), rows, -1)

    def _id_range(self) -> tuple[int, int]:
        """(first id, rows) when the rows hold the ids first, first + 1, ... in turn,
        else (0, -1); worked out once, as a sealed segment's rows never change.

        Rows in ascending id order (what `entry.rows_in_id_order` records) hold an
        unbroken run exactly when the largest id less the smallest spans them: two
        lookups of the id key, where reading every row's id took 0.75 s at 1M rows, paid
        by the first search after opening. A segment without the mark (an older merge
        could write rows out of id order) is checked row by row once, in SQLite."""
        if self._id_span is None:
            bounds = self.id_bounds()
            rows = self.entry.rows
            if bounds is None:
                self._id_span = (0, 0)
            elif bounds[1] - bounds[0] + 1 != rows or not self._rows_in_order(bounds[0]):
                self._id_span = (0, -1)
            else:
                self._id_span = (bounds[0], rows)
        return self._id_span

    def _rows_in_order(self, first: int) -> bool:
        """Whether each of an unbroken id run's rows is its id less `first`."""
        if self.entry.rows_in_id_order:
            return True
        sql = "SELECT EXISTS (SELECT 1 FROM items WHERE row != id - ?)"
        return not self._db.execute(sql, (first,)).fetchone()[0]

    def id_bounds(self) -> tuple[int, int] | None:
        """(smallest, largest) item id the segment holds, tombstoned ones too; None when
        it holds none."""
        first, last = self._db.execute(
            "SELECT (SELECT min(id) FROM items), (SELECT max(id) FROM items)"
        ).fetchone()
        return None if first is None else (first, last)

    def _rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Each of int64 `ids`' row (-1 where the segment does not hold it): its place
        among the sorted ids when the rows are in id order, else the row read for that
        place (a segment an older merge wrote out of order; read once, 8 B a row)."""
        at = positions(self.sorted_ids(), ids)
        if self.entry.rows_in_id_order:
            return at
        if self._rows_by_id is None:
            rows = self._db.execute("SELECT row FROM items ORDER BY id")
            self._rows_by_id = np.fromiter((r for (r,) in rows), np.int64, self.entry.rows)
        return np.where(at >= 0, self._rows_by_id[at], -1)

    def sorted_ids(self) -> np.ndarray:
        """The segment's item ids (tombstoned ones too), ascending; read once in the id
        key's own order (8 B a row)."""
        if self._sorted_ids is None:
            ids = self._db.execute("SELECT id FROM items ORDER BY id")
            self._sorted_ids = np.fromiter((i for (i,) in ids), np.int64, self.entry.rows)
        return self._sorted_ids

    def dead_ids(self) -> np.ndarray:
        dead = self.tombstones
        return np.fromiter(sorted(dead), dtype=np.int64, count=len(dead))

    def searched(self) -> VectorIndex:
        """The FAISS index a search ranks with."""
        return self.vectors

    def keys_by_id(self) -> list[tuple[int, str]]:
        dead = self.tombstones
        rows = self._db.execute("SELECT id, key FROM items ORDER BY id")
        return [(i, k) for i, k in rows if i not in dead]

    def labelled(self, dim: int) -> tuple[np.ndarray, list[str], list[str], np.ndarray]:
        dead = self.tombstones
        rows = [
            row
            for row in self._db.execute(
                "SELECT id, key, label, row FROM items WHERE label IS NOT NULL ORDER BY id"
            )
            if row[0] not in dead
        ]
        positions = np.fromiter((r[3] for r in rows), dtype=np.int64, count=len(rows))
        ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        if self._mapped is not None and rows:  # most rows, in order: read ahead
            self._mapped.prefetch(int(positions.min()), int(positions.max()) + 1)
        vectors = np.asarray(self._raw[positions], dtype=np.float32).reshape(len(rows), dim)
        return ids, [r[1] for r in rows], [r[2] for r in rows], vectors

    def labelled_ids(self) -> np.ndarray:
        """Sorted ids of the live labelled items."""
        dead = self.tombstones
        rows = self._db.execute("SELECT id FROM items WHERE label IS NOT NULL ORDER BY id")
        return np.fromiter((i for (i,) in rows if i not in dead), dtype=np.int64)

    def count_labelled(self) -> int:
        dead = self.tombstones
        if not dead:
            (n,) = self._db.execute("SELECT COUNT(*) FROM items WHERE label IS NOT NULL").fetchone()
            return int(n)
        rows = self._db.execute("SELECT id FROM items WHERE label IS NOT NULL")
        return sum(1 for (i,) in rows if i not in dead)

    def live_rows(
        self, batch: int = MERGE_BATCH, dead: set[int] | None = None
    ) -> Iterator[tuple[list[SegmentRow], np.ndarray]]:
        """(rows, float32 (b, dim) vectors) of the live items in id order, in batches:
        what a merge copies into a new segment. `dead`: the tombstones to skip
        (default: the current ones)."""
        dead = self.tombstones if dead is None else dead
        cursor = self._db.execute(
            "SELECT id, key, label, path, metadata, row FROM items ORDER BY id"
        )
        while chunk := cursor.fetchmany(batch):
            live = [row for row in chunk if row[0] not in dead]
            if not live:
                continue
            positions = np.fromiter((r[5] for r in live), dtype=np.int64, count=len(live))
            low, high = int(positions.min()), int(positions.max()) + 1
            # an in-order pass: read ahead, as a file read would (not across a segment
            # whose rows an older merge wrote out of id order: that span is the file)
            if self._mapped is not None and high - low <= 2 * len(chunk):
                self._mapped.prefetch(low, high)
            vectors = np.asarray(self._raw[positions], dtype=np.float32)
            yield [row[:5] for row in live], vectors.reshape(len(live), self.dim)

    def close(self) -> None:
        self._db.close()
        self._raw = None  # type: ignore[assignment]
        self._mapped = None


def file_identity(path: str | Path) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime in ns) of `path`: what changes when a file is
    replaced, truncated or rewritten."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _check_size(path: Path, expected: mf.FileEntry) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise StoreError(f"{path} is missing; the index is incomplete") from None
    if size != expected.bytes:
        raise StoreError(
            f"{path} has {size} bytes, the manifest says {expected.bytes} (truncated or "
            "altered); refusing to load it"
        )


# -- writing --------------------------------------------------------------------------


def write_segment(
    directory: Path,
    number: int,
    template: faiss.Index,
    batches: Iterable[tuple[list[SegmentRow], np.ndarray]],
    rows: int,
    *,
    factory: str,
    fields: fx.FieldSelection,
    prebuilt: faiss.Index | None = None,
) -> mf.SegmentEntry:
    """Write sealed segment `number` from `batches` of (rows, float32 (b, dim) vectors)
    in ascending id order (StoreError otherwise: a row is found from its id, _id_order.py),
    `rows` in all; durably (temp file, fsync, rename) and checksummed.

    `template` is an empty index of the store's factory (trained, for IVF/PQ) that the
    vectors are added to; `prebuilt`, when given, is an index already holding exactly
    these vectors under these ids (a growing segment without tombstones), written as is.
    `fields`: the metadata paths the segment's field index covers (_field_index.py), and
    its columns file (_columns.py) holds.
    """
    dim = template.d
    index = prebuilt if prebuilt is not None else faiss.clone_index(template)
    keep_vectors = not stores_vectors_in_faiss(factory)
    items_name = mf.segment_items_file(number)
    vectors_name = mf.segment_vectors_file(number)
    index_name = mf.segment_index_file(number)
    columns_name = mf.segment_columns_file(number)
    files: dict[str, mf.FileEntry] = {}
    with contextlib.ExitStack() as stack:
        items_tmp = stack.enter_context(atomic_path(directory / items_name))
        columns_tmp = stack.enter_context(atomic_path(directory / columns_name))
        vectors_tmp = (
            stack.enter_context(atomic_path(directory / vectors_name)) if keep_vectors else None
        )
        index_tmp = stack.enter_context(atomic_path(directory / index_name))
        db = sqlite3.connect(items_tmp)
        raw = (
            np.lib.format.open_memmap(vectors_tmp, mode="w+", dtype="<f4", shape=(rows, dim))
            if keep_vectors
            else None
        )
        written = 0
        last_id: int | None = None
        try:
            db.execute("PRAGMA journal_mode=OFF")
            db.execute(_ITEMS_SCHEMA)
            fx.create_tables(db, fields)
            for chunk, vectors in batches:
                n = len(chunk)
                ids = np.fromiter((r[0] for r in chunk), np.int64, n)
                check_ascending(ids, last_id)
                last_id = int(ids[-1]) if n else last_id
                db.executemany(
                    "INSERT INTO items VALUES (?,?,?,?,?,?)",
                    [(*row, written + j) for j, row in enumerate(chunk)],
                )
                fx.insert_fields(db, ((row[0], row[4]) for row in chunk), fields)
                if raw is not None:
                    raw[written : written + n] = vectors
                if prebuilt is None:
                    index.add_with_ids(vectors, ids)
                written += n
            for statement in (*_ITEMS_INDEXES, fx.FIELDS_INDEX):
                db.execute(statement)
            db.commit()
            cl.write_columns(db, columns_tmp)
        finally:
            db.close()
            if raw is not None:
                raw.flush()
                del raw
        if written != rows or index.ntotal != rows:
            raise StoreError(f"segment {number}: {written} rows written, {rows} expected")
        faiss.write_index(index, str(index_tmp))
        files[items_name] = mf.sha256_file(items_tmp)
        files[index_name] = mf.sha256_file(index_tmp)
        files[columns_name] = mf.sha256_file(columns_tmp)
        if vectors_tmp is not None:
            files[vectors_name] = mf.sha256_file(vectors_tmp)
    return mf.SegmentEntry(number, rows, files, tombstones=None, rows_in_id_order=True)


def write_tombstones(
    directory: Path, number: int, generation: int, ids: set[int]
) -> mf.TombstoneEntry:
    """Write segment `number`'s tombstones as of `generation` (durably, checksummed)."""
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(sorted(ids), dtype="<i8"), allow_pickle=False)
    name = mf.tombstone_file(number, generation)
    with atomic_path(directory / name) as tmp:
        tmp.write_bytes(buffer.getvalue())
        entry = mf.sha256_file(tmp)
    return mf.TombstoneEntry(name, entry, len(ids))
