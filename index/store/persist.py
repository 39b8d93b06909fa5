"""Saving and merging a segmented store: the two ways a new generation is committed.

Both follow one pattern: decide under the store's lock what to write (freezing the
growing segment, snapshotting tombstones), write the files without the lock (searches
and adds go on), then take the lock again to swap the new segments in and replace
manifest.json, the commit point. `IndexStore._commit_lock` keeps saves and merges
from interleaving; the folder's writer lock and the generation check keep other
processes out. A crash anywhere before the manifest is replaced leaves the previous
commit loadable; the files written meanwhile are debris, removed by the next commit.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from typing import TYPE_CHECKING

import faiss
import numpy as np

from ..atomic import atomic_path
from . import manifest as mf
from .augment import dba_augment
from .errors import StoreError
from .journal import JournalOwner
from .leases import Lease, leased_files
from .legacy import legacy_message
from .memory_segment import MemorySegment
from .merge import pick_merge
from .segment import SealedSegment, write_segment, write_tombstones

if TYPE_CHECKING:
    from .core import IndexStore

TUNABLE_PARAMS = ("nprobe", "efSearch")

logger = logging.getLogger(__name__)


def save(store: IndexStore) -> None:
    with store._commit_lock:
        with store._lock:
            if store._legacy:
                raise StoreError(legacy_message(store.directory))
            if not store._dirty and store._model_source is None:
                return
            store.directory.mkdir(parents=True, exist_ok=True)
            if store._journal_owner is None:
                JournalOwner.check_free(store.directory)  # a server owns this index
        with mf.writer_lock(store.directory):
            with store._lock:
                generation = _next_generation(store)
                jobs = _freeze(store)
                tombstones = {s: set(s.tombstones) for s in store._sealed if s.pending_tombstones}
                seq, pending = store._journal_seq, store._journal_pending
            model = _write_model(store, generation)
            quantizer = _write_quantizer(store, generation)
            sealed = [
                (segment, _seal(store, segment, number, generation)) for segment, number in jobs
            ]
            for segment, ids in tombstones.items():
                _write_tombstones(store, segment, generation, ids)
            with store._lock:
                # open every new segment before changing anything: a failure here leaves
                # the frozen segments searched and sealed again by the next save
                opened = []
                try:
                    for segment, entry in sealed:
                        late = segment.tombstones - segment.frozen_dead
                        opened.append((segment, _open_sealed(store, entry, late)))
                except BaseException:
                    for _, new in opened:
                        new.close()
                    raise
                for segment, new in opened:
                    store._sealing.remove(segment)
                    store._sealed.append(new)
                    segment.close()
                for segment, ids in tombstones.items():
                    segment.committed_tombstones |= ids
                    segment.pending_tombstones -= ids
                for retired in store._retired:
                    retired.close()
                store._retired = []
                journal = (store._journal.id, seq) if store._journal is not None else None
                _commit(store, generation, model, quantizer, journal)
                store._model_source = None
                store._quantizer_dirty = store._params_dirty = False
                store._dirty = bool(
                    store._growing.live_count
                    or store._growing.ntotal
                    or store._sealing
                    or any(s.pending_tombstones for s in store._sealed)
                )
                if store._journal is not None:
                    store._journal.truncate(seq)
                    store._journal_pending -= pending
    logger.debug("saved generation %d of %s", generation, store.directory)
    if store.due_merge() and not store._journaling:
        # a batch writer (CLI, build) merges at once; a server merges in the background
        store.merge()


def merge(store: IndexStore, *, everything: bool = False, rewrite: bool = False) -> int:
    with store._commit_lock:
        with store._lock:
            if store._legacy:
                raise StoreError(legacy_message(store.directory))
            if store._journal_owner is None:
                JournalOwner.check_free(store.directory)  # a server owns this index
            healthy = [s for s in store._sealed if not s.damaged]
            picks = pick_merge(healthy, everything=everything)
            chosen = [healthy[i] for i in picks]
            clean = len(chosen) == 1 and not chosen[0].tombstones
            if not chosen or (clean and not rewrite):
                return 0
            dead = {s.number: set(s.tombstones) for s in chosen}
            rows = sum(s.ntotal - len(dead[s.number]) for s in chosen)
            number = store._next_segment
            store._next_segment += 1
        with mf.writer_lock(store.directory):
            with store._lock:
                generation = _next_generation(store)
            for segment in chosen:  # a merge never copies unverified bytes
                try:
                    segment.verify()
                except StoreError as exc:
                    store.mark_damaged(segment, str(exc))
                    raise
            batches = itertools.chain.from_iterable(
                s.live_rows(dead=dead[s.number]) for s in chosen
            )
            entry = write_segment(
                store.directory,
                number,
                store._template,
                batches,
                rows,
                factory=store.factory,
                fields=store.filter_fields,
                augment=None if store.dba is None else dba_augment(store, *store.dba),
            )
            with store._lock:
                late = set().union(*(s.tombstones - dead[s.number] for s in chosen))
                merged = _open_sealed(store, entry, late)
                first = store._sealed.index(chosen[0])
                rest = [s for s in store._sealed if s not in chosen]
                store._sealed = [*rest[:first], merged, *rest[first:]]
                committed = store._committed
                _commit(
                    store,
                    generation,
                    committed.model if committed else store._model,
                    committed.quantizer if committed else None,
                    committed.journal if committed else None,
                )
                for segment in chosen:
                    segment.close()
    logger.info("merged %d segment(s) of %s into segment %d", len(chosen), store.directory, number)
    return len(chosen)


def _next_generation(store: IndexStore) -> int:
    on_disk = mf.committed_generation(store.directory)
    if on_disk != store._base_generation:
        raise StoreError(
            f"{store.directory} was saved by another writer since this store was loaded "
            f"(generation {on_disk}, expected {store._base_generation}); reopen it and "
            "apply the changes again"
        )
    return (on_disk or 0) + 1


def _freeze(store: IndexStore) -> list[tuple[MemorySegment, int]]:
    """Move the growing segment to the ones being sealed; number every one of them."""
    growing = store._growing
    if growing.live_count or growing.ntotal:
        store._growing = store._new_growing()
        if growing.live_count:
            store._sealing.append(growing)
        else:
            growing.close()
    jobs = []
    for segment in list(store._sealing):
        if segment.frozen and not segment.live_count:
            store._sealing.remove(segment)  # left by a failed save, emptied since
            segment.close()
            continue
        # a segment left frozen by a failed save is written with the removals made
        # since: the journal rows of those removals are truncated by this save
        segment.frozen_dead = segment.freeze() if not segment.frozen else set(segment.tombstones)
        segment.frozen_rows = segment.live_count
        jobs.append((segment, store._next_segment))
        store._next_segment += 1
    return jobs


def _write_quantizer(store: IndexStore, generation: int) -> mf.NamedFile | None:
    committed = store._committed.quantizer if store._committed else None
    if not store._quantizer_dirty:
        return committed
    name = mf.quantizer_file(generation)
    with atomic_path(store.directory / name) as tmp:
        faiss.write_index(store._template, str(tmp))
        entry = mf.sha256_file(tmp)
    return mf.NamedFile(name, entry)


def _open_sealed(store: IndexStore, entry: mf.SegmentEntry, late: set[int]) -> SealedSegment:
    """A segment just written, opened from its files; `late`: ids removed from it since
    its rows were snapshotted (pending tombstones, written by the next save)."""
    segment = SealedSegment(store.directory, entry, store.dim, store._gpu, store.factory)
    for name, value in store.search_params().items():
        if name in TUNABLE_PARAMS:
            segment.vectors.set_parameter(name, value)
    if late:
        segment.retire(np.fromiter(late, dtype=np.int64))
    return segment


def _commit(
    store: IndexStore,
    generation: int,
    model: mf.ModelEntry | None,
    quantizer: mf.NamedFile | None,
    journal: tuple[int, int] | None,
) -> None:
    """Replace manifest.json with the store's sealed segments as committed now;
    `journal`: (journal id, last journal row the commit holds)."""
    entries = tuple(s.entry for s in store._sealed)
    manifest = mf.Manifest(
        generation=generation,
        dim=store.dim,
        factory=store.factory,
        count=sum(e.live for e in entries),
        model=model,
        created=store._created,
        updated=mf.now_iso(),
        segments=entries,
        quantizer=quantizer,
        next_id=store._next_id,
        search_params={k: v for k, v in store.search_params().items() if k in TUNABLE_PARAMS},
        filter_fields=store.filter_fields.paths_tuple(),
        dba=store.dba,
        journal=journal,
    )
    mf.write_manifest(store.directory, manifest)
    store._committed, store._base_generation, store._model = manifest, generation, model
    keep = committed_files(manifest)
    # this store reads the new generation from now on: its lease follows it
    old_lease, store._lease = store._lease, Lease.take(store.directory, generation, keep)
    if old_lease is not None:
        old_lease.release()
    leased = leased_files(store.directory)
    if leased is None:  # a live reader's lease could not be read: delete nothing now
        logger.warning("%s: a reader lease is unreadable; stale files kept", store.directory)
        return
    removed = mf.remove_stale(store.directory, keep | leased)
    logger.debug("committed generation %d; removed %s", generation, removed)


def committed_files(manifest: mf.Manifest) -> set[str]:
    """Every file a generation consists of, the model copy included: what a reader of
    it leases and what its commit keeps."""
    model = manifest.model
    return set(manifest.listed_files()) | ({model.file} if model and model.file else set())


def _write_model(store: IndexStore, generation: int) -> mf.ModelEntry | None:
    """Copy a pending model in (keeping the committed one intact until the commit)."""
    if store._model_source is None:
        return store._model
    committed = _committed_model_file(store)
    name = mf.MODEL_COPY_FILE if committed != mf.MODEL_COPY_FILE else mf.model_file(generation)
    with atomic_path(store.directory / name) as tmp:
        shutil.copyfile(store._model_source, tmp)
        entry = mf.sha256_file(tmp)
    return mf.ModelEntry(store.fingerprint, name, entry)


def _committed_model_file(store: IndexStore) -> str | None:
    try:
        model = mf.read_manifest(store.directory).model
    except StoreError:
        return None
    return model.file if model else None


def _write_tombstones(
    store: IndexStore, segment: SealedSegment, generation: int, ids: set[int]
) -> None:
    segment.set_tombstones(write_tombstones(store.directory, segment.number, generation, ids))


def _seal(
    store: IndexStore, segment: MemorySegment, number: int, generation: int
) -> mf.SegmentEntry:
    """Write a frozen memory segment as sealed segment `number`. Its FAISS index is
    written as it is: without tombstones it holds exactly the live rows; with them
    (HNSW, which cannot remove) every row goes out and the tombstones with it, so
    the graph searched after the save is the one searched before."""
    dead = segment.frozen_dead
    if not dead:
        rows, count = segment.live_rows(dead=set()), segment.frozen_rows
    else:
        rows, count = segment.all_rows(), segment.ntotal
    entry = write_segment(
        store.directory,
        number,
        store._template,
        rows,
        count,
        factory=store.factory,
        fields=store.filter_fields,
        prebuilt=segment.vectors.cpu,
    )
    if not dead:
        return entry
    tombstones = write_tombstones(store.directory, number, generation, dead)
    return mf.SegmentEntry(number, entry.rows, entry.files, tombstones)
