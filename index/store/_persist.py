"""Saving and merging a segmented store: the two ways a new generation is committed.

Both follow one pattern: decide under the store's lock what to write (freezing the
growing segment, snapshotting tombstones), write the files without the lock (searches
and adds go on), then take the lock again to swap the new segments in and replace
manifest.json, the commit point. `StoreState.commit_lock` keeps saves and merges
from interleaving; the folder's writer lock and the generation check keep other
processes out. A crash anywhere before the manifest is replaced leaves the previous
commit loadable; the files written meanwhile are debris, removed by the next commit.

With DBA on, every commit also names the derived DBA index of the items it commits
(_dba.py): computed again under the lock just before the manifest when those
items changed, kept otherwise. Its files are written before the manifest like every
other, so a crash between the two leaves the previous generation and its own.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil

import faiss
import numpy as np

from ..atomic import atomic_path
from . import manifest as mf
from ._dba import DbaIndex, compute_and_write
from ._id_order import merged_by_id
from ._journal import JournalOwner
from ._leases import Lease, leased_files
from ._memory_segment import MemorySegment
from ._merge_policy import pick_merge
from ._sealed_segment import SealedSegment, write_segment, write_tombstones
from ._state import StoreState
from ._vectors import FAISS_PARAMS, OVERSAMPLE
from .errors import StoreError

logger = logging.getLogger(__name__)


def save(state: StoreState) -> bool:
    """`IndexStore.save`: commit the growing segment, tombstones and settings; False
    when nothing had changed (nothing was written)."""
    with state.commit_lock:
        with state.lock:
            if not state.writable:
                raise StoreError(mf.older_format_message(state.directory, state.format_version))
            if not state.unsaved_changes:
                return False
            state.directory.mkdir(parents=True, exist_ok=True)
            if not state.owns_journal:
                JournalOwner.check_free(state.directory)  # a server owns this index
        with mf.writer_lock(state.directory):
            with state.lock:
                generation = _next_generation(state)
                jobs = state.freeze_growing()
                tombstones = {s: set(s.tombstones) for s in state.sealed if s.pending_tombstones}
                seq, pending = state.journal_seq, state.journal_pending
            model = _write_model(state, generation)
            quantizer = _write_quantizer(state, generation)
            sealed = [
                (segment, _seal(state, segment, number, generation)) for segment, number in jobs
            ]
            for segment, ids in tombstones.items():
                _write_tombstones(state, segment, generation, ids)
            with state.lock:
                # open every new segment before changing anything: a failure here leaves
                # the frozen segments searched and sealed again by the next save
                opened = []
                try:
                    for segment, entry in sealed:
                        late = segment.tombstones - segment.frozen_dead
                        opened.append((segment, _open_sealed(state, entry, late)))
                except BaseException:
                    for _, new in opened:
                        new.close()
                    raise
                state.commit_sealed(opened)
                for segment, ids in tombstones.items():
                    segment.committed_tombstones |= ids
                    segment.pending_tombstones -= ids
                journal = (state.journal.id, seq) if state.journal is not None else None
                _commit(state, generation, model, quantizer, journal)
                state.saved(seq, pending)
    logger.debug("saved generation %d of %s", generation, state.directory)
    return True


def merge(state: StoreState, *, everything: bool = False, rewrite: bool = False) -> int:
    """`IndexStore.merge`."""
    with state.commit_lock:
        with state.lock:
            if not state.writable:
                raise StoreError(mf.older_format_message(state.directory, state.format_version))
            if not state.owns_journal:
                JournalOwner.check_free(state.directory)  # a server owns this index
            healthy = state.healthy_sealed()
            picks = pick_merge(healthy, everything=everything)
            chosen = [healthy[i] for i in picks]
            clean = len(chosen) == 1 and not chosen[0].tombstones
            if not chosen or (clean and not rewrite):
                return 0
            dead = {s.number: set(s.tombstones) for s in chosen}
            rows = sum(s.ntotal - len(dead[s.number]) for s in chosen)
            number = state.take_segment_number()
        with mf.writer_lock(state.directory):
            with state.lock:
                generation = _next_generation(state)
            for segment in chosen:  # a merge never copies unverified bytes
                try:
                    segment.verify()
                except StoreError as exc:
                    state.mark_damaged(segment, str(exc))
                    raise
            batches = merged_by_id(
                [s.live_rows(dead=dead[s.number]) for s in chosen],
                [s.id_bounds() for s in chosen],
            )
            entry = write_segment(
                state.directory,
                number,
                state.template,
                batches,
                rows,
                factory=state.factory,
                fields=state.filter_fields,
            )
            with state.lock:
                late = set().union(*(s.tombstones - dead[s.number] for s in chosen))
                merged = _open_sealed(state, entry, late)
                state.replace_merged(chosen, merged)
                committed = state.committed
                _commit(
                    state,
                    generation,
                    committed.model if committed else state.model,
                    committed.quantizer if committed else None,
                    committed.journal if committed else None,
                )
                for segment in chosen:
                    segment.close()
    logger.info("merged %d segment(s) of %s into segment %d", len(chosen), state.directory, number)
    return len(chosen)


def _next_generation(state: StoreState) -> int:
    on_disk = mf.committed_generation(state.directory)
    if on_disk != state.base_generation:
        raise StoreError(
            f"{state.directory} was saved by another writer since this store was loaded "
            f"(generation {on_disk}, expected {state.base_generation}); reopen it and "
            "apply the changes again"
        )
    return (on_disk or 0) + 1


def _write_quantizer(state: StoreState, generation: int) -> mf.NamedFile | None:
    committed = state.committed.quantizer if state.committed else None
    if not state.quantizer_dirty:
        return committed
    name = mf.quantizer_file(generation)
    with atomic_path(state.directory / name) as tmp:
        faiss.write_index(state.template, str(tmp))
        entry = mf.sha256_file(tmp)
    return mf.NamedFile(name, entry)


def _open_sealed(state: StoreState, entry: mf.SegmentEntry, late: set[int]) -> SealedSegment:
    """A segment just written, opened from its files; `late`: ids removed from it since
    its rows were snapshotted (pending tombstones, written by the next save)."""
    segment = SealedSegment(state.directory, entry, state.dim, state.gpu, state.factory)
    segment.vectors.set_saved_parameters(state.search_params())
    if late:
        segment.retire(np.fromiter(late, dtype=np.int64))
    return segment


def saved_search_params(state: StoreState) -> dict[str, int]:
    """The search settings a commit records: FAISS's nprobe / efSearch, and the
    oversampling when one was set (the default is not written, so that it follows
    the release that opens the index)."""
    params = {k: v for k, v in state.search_params().items() if k in FAISS_PARAMS}
    if state.oversample is not None:
        params[OVERSAMPLE] = state.oversample
    return params


def _commit(
    state: StoreState,
    generation: int,
    model: mf.ModelEntry | None,
    quantizer: mf.NamedFile | None,
    journal: tuple[int, int] | None,
) -> None:
    """Replace manifest.json with the store's sealed segments as committed now;
    `journal`: (journal id, last journal row the commit holds)."""
    entries = tuple(s.entry for s in state.sealed)
    dba_index = _derived_dba(state, generation)
    manifest = mf.Manifest(
        generation=generation,
        dim=state.dim,
        factory=state.factory,
        count=sum(e.live for e in entries),
        model=model,
        created=state.created,
        updated=mf.now_iso(),
        segments=entries,
        quantizer=quantizer,
        next_id=state.next_id,
        search_params=saved_search_params(state),
        tuning=state.tuning,
        calibration=state.calibration,
        filter_fields=state.filter_fields.paths_tuple(),
        format_version=mf.FORMAT_VERSION,
        dba=state.dba,
        dba_index=dba_index.entry if dba_index else None,
        journal=journal,
    )
    try:
        mf.write_manifest(state.directory, manifest)
    except BaseException:
        if dba_index is not None and dba_index is not state.dba_index:
            dba_index.close()
        raise
    keep = committed_files(manifest)
    # this store reads the new generation from now on: its lease follows it
    state.record_commit(manifest, Lease.take(state.directory, generation, keep), dba_index)
    leased = leased_files(state.directory)
    if leased is None:  # a live reader's lease could not be read: delete nothing now
        logger.warning("%s: a reader lease is unreadable; stale files kept", state.directory)
        return
    removed = mf.remove_stale(state.directory, keep | leased)
    logger.debug("committed generation %d; removed %s", generation, removed)


def _derived_dba(state: StoreState, generation: int) -> DbaIndex | None:
    """The derived DBA index of the items this commit holds (None: DBA off): the
    current one when it holds exactly those items with these settings (ids are never
    reused, vectors never change), else computed and written now, uncommitted."""
    if state.dba is None:
        return None
    current = state.dba_index
    if (
        current is not None
        and current.settings == state.dba
        and np.array_equal(current.ids, state.committed_ids())
    ):
        return current
    entry = compute_and_write(
        state.directory, generation, state.dba, state.committed_live(), state.dim
    )
    logger.info("computed the DBA vectors of %d item(s) in %s", entry.count, state.directory)
    return DbaIndex(state.directory, entry, state.dim)


def committed_files(manifest: mf.Manifest) -> set[str]:
    """Every file a generation consists of, the model copy included: what a reader of
    it leases and what its commit keeps."""
    model = manifest.model
    return set(manifest.listed_files()) | ({model.file} if model and model.file else set())


def _write_model(state: StoreState, generation: int) -> mf.ModelEntry | None:
    """Copy a pending model in (keeping the committed one intact until the commit)."""
    if state.model_source is None:
        return state.model
    committed = _committed_model_file(state)
    name = mf.MODEL_COPY_FILE if committed != mf.MODEL_COPY_FILE else mf.model_file(generation)
    with atomic_path(state.directory / name) as tmp:
        shutil.copyfile(state.model_source, tmp)
        entry = mf.sha256_file(tmp)
    return mf.ModelEntry(state.fingerprint, name, entry)


def _committed_model_file(state: StoreState) -> str | None:
    try:
        model = mf.read_manifest(state.directory).model
    except StoreError:
        return None
    return model.file if model else None


def _write_tombstones(
    state: StoreState, segment: SealedSegment, generation: int, ids: set[int]
) -> None:
    segment.set_tombstones(write_tombstones(state.directory, segment.number, generation, ids))


def _seal(
    state: StoreState, segment: MemorySegment, number: int, generation: int
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
        state.directory,
        number,
        state.template,
        rows,
        count,
        factory=state.factory,
        fields=state.filter_fields,
        prebuilt=segment.vectors.cpu,
    )
    if not dead:
        return entry
    tombstones = write_tombstones(state.directory, number, generation, dead)
    return dataclasses.replace(entry, tombstones=tombstones)
