"""StoreState: everything an open store holds, in one object with named operations.

The segment set (sealed, sealing, growing, retired, damaged), the id and segment
counters, what is unsaved (dirty flags, a model still to copy in), the committed
manifest and the generation it was read at, the journal bookkeeping, the reader
lease, and the two locks. `IndexStore` (_index_store.py) holds one; the modules that save,
open, search, report and verify a store take it, and change it only through the
methods below, each named for what it does (a save's `commit_sealed`, a merge's
`replace_merged`, ...). It imports nothing that imports it: _index_store.py sits on top.

Locking: `lock` (re-entrant) serialises mutations and reads of the segment set;
`commit_lock` keeps one save or merge at a time. Methods that change the segment set
expect the caller to hold `lock`, as their docstrings say.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from . import manifest as mf
from ._damage import changed_on_disk, with_damaged
from ._dba import DbaIndex
from ._field_index import FieldSelection
from ._items import ItemTable, Row
from ._journal import Journal, JournalOwner
from ._leases import Lease
from ._memory_segment import MemorySegment
from ._merge_policy import pick_merge
from ._sealed_segment import SealedSegment
from ._vectors import OVERSAMPLE, VectorIndex, new_faiss_index
from .errors import DamagedIndexError
from .request import DEFAULT_OVERSAMPLE
from .segment_contract import Segment


class StoreState:
    """The state of one open store (see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        *,
        factory: str,
        dim: int,
        template: faiss.Index,
        gpu: str,
        model: mf.ModelEntry | None,
        committed: mf.Manifest | None,
        sealed: list[SealedSegment] | None = None,
        growing: MemorySegment | None = None,
        filter_fields: FieldSelection | None = None,
        dba: tuple[int, float] | None = None,
        dba_index: DbaIndex | None = None,
        lease: Lease | None = None,
    ) -> None:
        self.directory = directory
        self.dim = dim
        self.factory = factory
        self.gpu = gpu
        self.dba = dba  # (neighbours, alpha) commits compute DBA vectors with (_dba.py)
        self.dba_index = dba_index  # the committed derived DBA index, when there is one
        # candidates per k a compressed segment re-scores, when set (request.py's default
        # otherwise); saved with the FAISS search settings in the manifest
        self.oversample: int | None = committed.search_params.get(OVERSAMPLE) if committed else None
        self.tuning = committed.tuning if committed else None  # index/tuning.py's record
        self.calibration = committed.calibration if committed else None  # calibration.py's
        # the metadata paths new segments index for filters (_field_index.py)
        self.filter_fields = filter_fields or FieldSelection(None)
        self._template = template  # empty (trained) index new segments start from
        self._model = model
        self._committed = committed
        self._base_generation = committed.generation if committed else None
        # the format of the index as opened: an older one is read, not written (upgrade)
        self._format = mf.FORMAT_VERSION
        self._model_source: Path | None = None  # a model still to copy in at save
        self._sealed: list[SealedSegment] = sealed or []
        self._sealing: list[MemorySegment] = []  # frozen growing segments being written
        self._growing = growing or self.new_growing()
        self._retired: list[SealedSegment] = []  # replaced in memory, still committed
        self._damaged: dict[int, str] = {}  # segments out of service: number -> why
        ids = [s.max_id() for s in self.memory_segments()] + [-1]
        self._next_id = max(committed.next_id if committed else 0, max(ids) + 1)
        numbers = [s.number for s in self._sealed] + [0]
        self._next_segment = max(numbers) + 1
        self._quantizer_dirty = False
        self._params_dirty = False
        self._created = committed.created if committed else mf.now_iso()
        self._dirty = committed is None
        self.lock = threading.RLock()
        self.commit_lock = threading.Lock()  # one save or merge at a time
        self._journal: Journal | None = None
        self._journaling = False
        self._journal_seq = 0  # last journal row reflected in memory
        self._journal_pending = 0  # rows no save has committed (read without the lock)
        self._journal_owner: JournalOwner | None = None
        self._lease = lease  # on the committed files this store reads
        self._trainable = not new_faiss_index(dim, factory).is_trained

    # -- what it holds (read-only views) ------------------------------------------------

    @classmethod
    def of_commit(
        cls,
        directory: Path,
        manifest: mf.Manifest,
        template: faiss.Index,
        gpu: str,
        **parts: Any,
    ) -> StoreState:
        """The state of a committed manifest (its factory, dim and model), with the
        segments and the rest of `parts` as `__init__` takes them."""
        return cls(
            directory,
            factory=manifest.factory,
            dim=manifest.dim,
            template=template,
            gpu=gpu,
            model=manifest.model,
            committed=manifest,
            **parts,
        )

    @property
    def template(self) -> faiss.Index:
        """The trained, empty index new segments start from."""
        return self._template

    @property
    def model(self) -> mf.ModelEntry | None:
        return self._model

    @property
    def model_source(self) -> Path | None:
        """A model file still to copy into the directory at the next save."""
        return self._model_source

    @property
    def committed(self) -> mf.Manifest | None:
        """The manifest of the generation this store last read or committed."""
        return self._committed

    @property
    def base_generation(self) -> int | None:
        """The generation on disk a save expects to replace (None: none yet)."""
        return self._base_generation

    @property
    def created(self) -> str:
        return self._created

    @property
    def writable(self) -> bool:
        """Whether the index is of the format this vitrieval writes (older formats are
        read-only until `vitrieval-index upgrade`)."""
        return self._format == mf.FORMAT_VERSION

    def opened_format(self, version: int) -> None:
        """The index was opened from a manifest of format `version` (_loading.py; format
        1: _upgrade_format1.py)."""
        self._format = version

    @property
    def trainable(self) -> bool:
        """Whether the factory trains (IVF, PQ): its quantizer is a file of its own."""
        return self._trainable

    @property
    def sealed(self) -> list[SealedSegment]:
        """The sealed segments, oldest first, damaged ones included (a copy)."""
        return list(self._sealed)

    @property
    def growing(self) -> MemorySegment:
        """The segment adds go to."""
        return self._growing

    @property
    def sealing(self) -> list[MemorySegment]:
        """Frozen growing segments a save is writing (a copy)."""
        return list(self._sealing)

    @property
    def next_id(self) -> int:
        return self._next_id

    @property
    def quantizer_dirty(self) -> bool:
        """The quantizer changed (or is new) since the last commit."""
        return self._quantizer_dirty

    @property
    def unsaved_changes(self) -> bool:
        """Anything a save would write."""
        return self._dirty or self._model_source is not None

    @property
    def journal(self) -> Journal | None:
        return self._journal

    @property
    def journaling(self) -> bool:
        """Every mutation is journalled before it applies (a server's store)."""
        return self._journaling

    @property
    def journal_seq(self) -> int:
        """The last journal row reflected in memory."""
        return self._journal_seq

    @property
    def journal_pending(self) -> int:
        """Journalled mutations no save has committed (read without the lock)."""
        return self._journal_pending

    @property
    def owns_journal(self) -> bool:
        """This store holds the folder's journal lock (it is a server's)."""
        return self._journal_owner is not None

    @property
    def fingerprint(self) -> str | None:
        return self._model.fingerprint if self._model else None

    @property
    def model_path(self) -> Path | None:
        """The model copy inside the directory, once saved (None before, or without one)."""
        if self._model and self._model.file and self._committed is not None:
            return self.directory / self._model.file
        return None

    @property
    def format_version(self) -> int:
        return self._format

    # -- segments -----------------------------------------------------------------------

    def new_growing(self) -> MemorySegment:
        """An empty memory segment starting from the template."""
        return MemorySegment(
            VectorIndex(faiss.clone_index(self._template), self.gpu),
            ItemTable.new(self.filter_fields),
        )

    def memory_segments(self) -> list[MemorySegment]:
        return [*self._sealing, self._growing]

    def segments(self) -> list[Segment]:
        """Every segment searched, oldest first (damaged ones are out of service)."""
        return [*(s for s in self._sealed if not s.damaged), *self._sealing, self._growing]

    def serving(self) -> list[Segment]:
        """`segments()` once any sealed segment whose files changed on disk is out of
        service (damage.changed_on_disk); reads call it, holding `lock`."""
        for segment, reason in changed_on_disk(self._sealed):
            self.mark_damaged(segment, reason)
        return self.segments()

    def locate(self, keys: Sequence[str]) -> list[tuple[Segment, dict[str, int]]]:
        """(segment, key -> id) for the live `keys`, per segment holding any; under `lock`."""
        found = []
        for segment in self.serving():
            ids = segment.live_ids(keys)
            if ids:
                found.append((segment, ids))
        return found

    def live_count(self) -> int:
        return sum(s.live_count for s in self.segments())

    def search_params(self) -> dict[str, int]:
        """The index's search settings (IVF: nprobe and nlist; HNSW: efSearch), and
        the oversampling its compressed segments re-score with (set or default)."""
        template = VectorIndex(self._template, "cpu")
        settings = template.search_settings()
        if not template.scores_exact:
            settings[OVERSAMPLE] = self.oversample or DEFAULT_OVERSAMPLE
        return settings

    def healthy_sealed(self) -> list[SealedSegment]:
        """The sealed segments in service."""
        return [s for s in self._sealed if not s.damaged]

    def due_merge(self) -> bool:
        with self.lock:
            return bool(pick_merge(self.healthy_sealed()))

    # -- damage -------------------------------------------------------------------------

    def mark_damaged(self, segment: SealedSegment, reason: str) -> None:
        """Take `segment` out of service, unless a merge replaced it meanwhile (its files
        are gone because they were merged, not damaged)."""
        with self.lock:
            self._damaged = with_damaged(
                self._sealed, self._damaged, segment, reason, self.directory
            )

    def damaged_segments(self) -> list[tuple[int, str]]:
        """(number, reason) of the segments out of service. Lock-free (a copy of a
        dict the scrub replaces), so probes never wait behind a search or a save."""
        return list(self._damaged.items())

    def refuse_if_damaged(self) -> None:
        """Keys of a damaged segment cannot be looked up, so a mutation could break
        their uniqueness: refuse them all until the index is restored."""
        if self._damaged:
            numbers = ", ".join(str(n) for n in self._damaged)
            raise DamagedIndexError(
                f"{self.directory}: segment(s) {numbers} failed verification; the index takes "
                "no changes until it is restored from a backup"
            )

    # -- mutations (callers hold `lock`) ------------------------------------------------

    def added(self, last_id: int) -> None:
        """Items up to id `last_id` were added."""
        self._next_id = last_id + 1
        self._dirty = True

    def changed(self, *, params: bool = False) -> None:
        """Something a save writes changed; `params`: a setting the manifest holds."""
        self._dirty = True
        self._params_dirty = self._params_dirty or params

    def set_filter_fields(self, selection: FieldSelection) -> None:
        """The metadata paths segments written from now on index (saved with it)."""
        self.filter_fields = selection
        self.changed(params=True)

    def set_dba(self, dba: tuple[int, float] | None) -> None:
        """The (neighbours, alpha) the next commits compute DBA vectors with, or None."""
        self.dba = dba
        self.changed(params=True)

    def retrain(self, template: faiss.Index) -> None:
        """A new quantizer (trained, empty `template`): every live item is re-added
        under it into a new growing segment; the sealed segments it came from stay
        committed until the next save replaces them."""
        self._template = template
        moved = self.new_growing()
        for segment in self.segments():
            for rows, batch in segment.live_rows():
                ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
                moved.insert([Row(*r, v) for r, v in zip(rows, batch, strict=True)], batch, ids)
        self._retired.extend(self._sealed)
        for segment in self.memory_segments():
            segment.close()
        self._sealed, self._sealing, self._growing = [], [], moved
        self._quantizer_dirty = self._dirty = True

    @contextlib.contextmanager
    def journalled(self, op: str, keys: Sequence[str], **columns: Any) -> Iterator[None]:
        """Journal a mutation durably before the block applies it in memory; take the
        row back out if applying fails, so replay never meets a mutation that failed."""
        if not self._journaling or self._journal is None:
            yield
            return
        before = self._journal_seq
        self._journal_seq = self._journal.append(op, keys, **columns)
        try:
            yield
        except BaseException:
            self._journal.discard(before)
            self._journal_seq = before
            raise
        self._journal_pending += len(keys)

    # -- opening and creating (_loading.py, upgrade.py, _upgrade_format1.py) ---------------

    def replacing(
        self,
        base_generation: int | None,
        next_segment: int,
        journal: Journal | None,
        model_source: Path | None,
        quantizer_dirty: bool,
    ) -> None:
        """A new store over a folder that may hold an index: the generation its save
        replaces, the first segment number it may write (never a file of the old
        index), the old journal (its rows die at save) and a model still to copy in."""
        self._base_generation = base_generation
        self._next_segment = max(self._next_segment, next_segment)
        self._journal = journal
        self._journal_seq = journal.last_seq() if journal else 0
        self._model_source = model_source
        self._quantizer_dirty = quantizer_dirty

    def own_journal(self, owner: JournalOwner) -> None:
        """This store holds the folder's journal lock from now on."""
        self._journal_owner = owner

    def replayed(self, seq: int, count: int) -> None:
        """Journal rows up to `seq` are reflected in memory, `count` of them uncommitted."""
        self._journal_seq = max(self._journal_seq, seq)
        self._journal_pending = count

    def attach_journal(self, journal: Journal, journaling: bool) -> None:
        """Keep `journal` (replayed); with `journaling`, journal every later mutation."""
        self._journal, self._journaling = journal, journaling

    def detach_journal(self) -> None:
        """Close the journal without truncating it (a process that dies unsaved)."""
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def upgrade_format(self) -> None:
        """Make the next save write this index in the current format: a format-1 index
        (its in-memory segment, _upgrade_format1.py) is sealed anew; a format-2 one has
        its segments' columns files written now; with DBA on, the save writes the
        derived DBA index (format 3 kept DBA vectors in segments, left behind)."""
        if self._format == mf.COLUMNLESS_FORMAT_VERSION:
            for segment in self._sealed:
                segment.write_columns()
        elif self._format == mf.UPGRADE_ONLY_FORMAT_VERSION:
            self._quantizer_dirty = self._trainable
        # every older format: the save computes the derived DBA index (_dba.py)
        self._format = mf.FORMAT_VERSION
        self._dirty = True

    # -- saving and merging (_persist.py; callers hold `lock`) -----------------------------

    def freeze_growing(self) -> list[tuple[MemorySegment, int]]:
        """Move the growing segment to the ones being sealed; number every one of them."""
        growing = self._growing
        if growing.live_count or growing.ntotal:
            self._growing = self.new_growing()
            if growing.live_count:
                self._sealing.append(growing)
            else:
                growing.close()
        jobs = []
        for segment in list(self._sealing):
            if segment.frozen and not segment.live_count:
                self._sealing.remove(segment)  # left by a failed save, emptied since
                segment.close()
                continue
            # a segment left frozen by a failed save is written with the removals made
            # since: the journal rows of those removals are truncated by this save
            frozen = segment.frozen
            segment.frozen_dead = set(segment.tombstones) if frozen else segment.freeze()
            segment.frozen_rows = segment.live_count
            jobs.append((segment, self.take_segment_number()))
        return jobs

    def take_segment_number(self) -> int:
        """The number of a segment about to be written (never reused)."""
        number = self._next_segment
        self._next_segment += 1
        return number

    def commit_sealed(self, opened: Sequence[tuple[MemorySegment, SealedSegment]]) -> None:
        """A save wrote the frozen segments: each is replaced by the sealed one opened
        from its files; the segments a retrain replaced are closed."""
        for segment, new in opened:
            self._sealing.remove(segment)
            self._sealed.append(new)
            segment.close()
        for retired in self._retired:
            retired.close()
        self._retired = []

    def replace_merged(self, chosen: Sequence[SealedSegment], merged: SealedSegment) -> None:
        """A merge folded `chosen` into `merged`, which takes the first one's place."""
        first = self._sealed.index(chosen[0])
        rest = [s for s in self._sealed if s not in chosen]
        self._sealed = [*rest[:first], merged, *rest[first:]]

    def items_uncommitted(self) -> bool:
        """Whether the live items differ from the last commit's (adds or removes not
        saved yet): the derived DBA index covers the committed ones only."""
        return bool(
            self._growing.live_count
            or any(s.live_count for s in self._sealing)
            or any(s.pending_tombstones for s in self._sealed)
        )

    def committed_live(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, float32 vectors) of the items the sealed segments commit (their
        committed tombstones left out), in batches: what the derived DBA index holds."""
        for segment in self._sealed:
            dead = set(segment.committed_tombstones)
            for rows, vectors in segment.live_rows(dead=dead):
                yield np.fromiter((r[0] for r in rows), np.int64, len(rows)), vectors

    def committed_ids(self) -> np.ndarray:
        """Sorted ids of the items the sealed segments commit: `committed_live`'s ids,
        without reading a vector."""
        parts = [np.empty(0, np.int64)]
        for segment in self._sealed:
            ids = segment.sorted_ids()
            dead = np.fromiter(sorted(segment.committed_tombstones), np.int64)
            parts.append(ids[~np.isin(ids, dead, assume_unique=True)] if dead.size else ids)
        return np.sort(np.concatenate(parts))

    def record_commit(
        self, manifest: mf.Manifest, lease: Lease | None, dba_index: DbaIndex | None
    ) -> None:
        """`manifest` is the committed generation now, `dba_index` its derived DBA
        index; this store reads it under `lease` (the previous lease is released)."""
        self._committed, self._base_generation = manifest, manifest.generation
        self._model = manifest.model
        if self.dba_index is not None and self.dba_index is not dba_index:
            self.dba_index.close()
        self.dba_index = dba_index
        old, self._lease = self._lease, lease
        if old is not None:
            old.release()

    def saved(self, seq: int, pending: int) -> None:
        """A save committed: what it wrote is no longer unsaved, and the journal rows up
        to `seq` (`pending` mutations) are in the commit."""
        self._model_source = None
        self._quantizer_dirty = self._params_dirty = False
        self._dirty = bool(
            self._growing.live_count
            or self._growing.ntotal
            or self._sealing
            or any(s.pending_tombstones for s in self._sealed)
        )
        if self._journal is not None:
            self._journal.truncate(seq)
            self._journal_pending -= pending

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Release files, connections, the journal lock and the lease."""
        with self.lock:
            for segment in [*self.segments(), *self._retired]:
                segment.close()
            self.detach_journal()
            if self.dba_index is not None:
                self.dba_index.close()
            if self._journal_owner is not None:
                self._journal_owner.release()
                self._journal_owner = None
            if self._lease is not None:
                self._lease.release()
                self._lease = None
