"""Opening and creating an index directory: its checks, its segments, and the replay
of its journal.

`IndexStore.open` and `IndexStore.create` call these; they live apart so that the
store class keeps to what a store does once open.
"""

from __future__ import annotations

import filecmp
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..runtime.model_metadata import ModelMetadataError, read_model_metadata
from . import manifest as mf
from ._dba import DbaIndex
from ._field_index import FieldSelection, check_field_paths
from ._journal import JOURNAL_FILE, JOURNAL_LOCK_FILE, Journal, JournalOwner
from ._journal_repair import row_problem, unappliable_row
from ._leases import Lease
from ._persist import committed_files
from ._sealed_segment import SealedSegment
from ._state import StoreState
from ._vectors import VectorIndex, check_gpu_mode, new_faiss_index, start_template
from .errors import FolderNotEmptyError, StoreError

logger = logging.getLogger(__name__)
# a writer committing meanwhile can remove files this open was about to map; each try
# takes milliseconds, commits come at most a few a second
_OPEN_RETRIES = 10


def check_model(path: Path, fingerprint: str | None, dim: int) -> tuple[Path, str]:
    try:
        meta = read_model_metadata(path)
    except ModelMetadataError as exc:
        raise StoreError(str(exc)) from None
    if fingerprint is not None and fingerprint != meta.fingerprint:
        raise StoreError(
            f"model {path} has fingerprint {meta.fingerprint}, not the given {fingerprint}"
        )
    if meta.embedding_dim != dim:
        raise StoreError(f"model {path} embeds {meta.embedding_dim}-d vectors, not {dim}-d")
    return path.resolve(), meta.fingerprint


OTHER_MODEL_ADVICE = (
    "rebuild the index with this model (into a new folder), or use the model it was built with"
)
"""What to do when a model is not the one an index was built with (another
fingerprint or another dimension)."""


def check_expected(
    manifest: mf.Manifest, directory: Path, fingerprint: str | None, dim: int | None
) -> None:
    copy = (
        f" (the index keeps a copy: {directory / manifest.model.file})"
        if manifest.model and manifest.model.file
        else ""
    )
    if dim is not None and dim != manifest.dim:
        raise StoreError(
            f"{directory} holds {manifest.dim}-d vectors, but {dim}-d were expected: "
            + OTHER_MODEL_ADVICE
            + copy
        )
    if fingerprint is not None and fingerprint != manifest.fingerprint:
        built = manifest.fingerprint or "an unrecorded model"
        raise StoreError(
            f"{directory} was built with model fingerprint {built}, not {fingerprint}: "
            + OTHER_MODEL_ADVICE
            + copy
        )


class Replaying(Protocol):
    """What a journal's rows are replayed through: the store being opened."""

    def add(self, keys: Sequence[str], vectors: Any, **columns: Any) -> None: ...

    def remove(self, keys: Sequence[str]) -> int: ...

    def verify(self) -> None: ...

    def close(self) -> None: ...


S = TypeVar("S", bound=Replaying)


class MovedOn(StoreError):
    """A writer committed a newer generation while this open was taking its lease."""


def load(directory: Path, manifest: mf.Manifest, gpu: str) -> StoreState:
    # the lease first, then the check that the generation is still the committed one:
    # every commit after that check sees the lease and keeps these files (_leases.py)
    lease = Lease.take(directory, manifest.generation, committed_files(manifest))
    try:
        if mf.committed_generation(directory) != manifest.generation:
            raise MovedOn(f"{directory}: a newer generation was committed meanwhile")
        return _load(directory, manifest, gpu, lease)
    except BaseException:
        if lease is not None:
            lease.release()
        raise


def _load(directory: Path, manifest: mf.Manifest, gpu: str, lease: Lease | None) -> StoreState:
    if manifest.model and manifest.model.file and manifest.model.checksum:
        # small beside the segments, and what `search` embeds with: read in full
        mf.verify_file(directory, manifest.model.file, manifest.model.checksum)
    template = new_faiss_index(manifest.dim, manifest.factory)
    if manifest.quantizer is not None:
        data = mf.read_verified(directory, manifest.quantizer.name, manifest.quantizer.checksum)
        template = VectorIndex.from_bytes(
            data, directory / manifest.quantizer.name, manifest.dim, "cpu"
        ).cpu
    sealed: list[SealedSegment] = []
    dba_index = None
    try:
        for entry in manifest.segments:
            sealed.append(SealedSegment(directory, entry, manifest.dim, gpu, manifest.factory))
        if manifest.dba_index is not None:
            dba_index = DbaIndex(directory, manifest.dba_index, manifest.dim)
        # the saved settings before the state is made: its growing segment is a copy
        # of the template, and adds after opening (or replayed from the journal) go there
        for vectors in (VectorIndex(template, "cpu"), *(s.vectors for s in sealed)):
            vectors.set_saved_parameters(manifest.search_params)
    except BaseException:
        for segment in sealed:
            segment.close()
        raise
    state = StoreState.of_commit(
        directory,
        manifest,
        template,
        gpu,
        sealed=sealed,
        filter_fields=FieldSelection(manifest.filter_fields),
        dba=manifest.dba,
        dba_index=dba_index,
        lease=lease,  # held while the state reads these files: a writer keeps them
    )
    live = sum(s.live_count for s in sealed)
    if live != manifest.count:
        state.close()
        raise StoreError(
            f"{directory} is inconsistent: {live} live items in its segments, manifest "
            f"count {manifest.count}"
        )
    return state


def attach_journal(store: Replaying, state: StoreState, *, create: bool) -> None:
    """Replay the folder's journal through `store` (over `state`); with `create`,
    journal every later mutation."""
    path = state.directory / JOURNAL_FILE
    try:
        if create:
            state.own_journal(JournalOwner(state.directory))
        journal = (
            Journal(path, state.dim)
            if create
            else Journal.open_existing(state.directory, state.dim)
        )
    except BaseException:
        store.close()
        raise
    if journal is None:
        return
    committed = state.committed.journal if state.committed else None
    # rows the last commit holds already (its truncation may not have happened)
    held = committed[1] if committed and committed[0] == journal.id else 0
    try:
        replayed = 0
        state.replayed(held, 0)
        for entry in journal.entries():
            if entry.seq <= held:
                continue
            problem = row_problem(entry, state.dim)
            if problem is not None:
                raise unappliable_row(state.directory, entry, problem)
            if entry.op == "add":
                store.add(
                    [entry.key],
                    entry.vector[None, :],
                    labels=[entry.label],
                    paths=[entry.path],
                    metadata=[entry.metadata],
                    replace=True,
                )
            else:
                store.remove([entry.key])
            replayed += 1
            state.replayed(entry.seq, replayed)
    except BaseException:
        journal.close()
        store.close()
        raise
    state.attach_journal(journal, journaling=create)
    if replayed:
        logger.info("replayed %d journalled mutation(s) of %s", replayed, state.directory)


def create_store(
    directory: Path,
    *,
    dim: int,
    factory: str,
    fingerprint: str | None,
    model_path: Path | None,
    overwrite: bool,
    gpu: str,
    quantizer: bytes | None,
    filter_fields: Sequence[str] | None,
) -> StoreState:
    """`IndexStore.create`: a new, empty store's state (nothing written until save())."""
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise StoreError(f"dim must be a positive integer, got {dim!r}")
    if directory.exists() and not directory.is_dir():
        raise StoreError(f"{directory} exists and is not a folder")
    if directory.is_dir() and not overwrite:
        held = files_in_the_way(directory, model_path)
        if held:
            raise FolderNotEmptyError(directory, held)
    source = None
    if model_path is not None:
        source, fingerprint = check_model(Path(model_path), fingerprint, dim)
    check_gpu_mode(gpu)
    state = StoreState(
        directory,
        factory=factory,
        dim=dim,
        template=start_template(dim, factory, quantizer),
        gpu=gpu,
        model=mf.ModelEntry(fingerprint) if fingerprint is not None else None,
        committed=None,
        filter_fields=FieldSelection(check_field_paths(filter_fields)),
    )
    base = mf.committed_generation(directory) if directory.is_dir() else None
    next_segment = 0
    if base is not None and mf.stored_format_version(directory) != mf.UPGRADE_ONLY_FORMAT_VERSION:
        # never write over a file of the index this one replaces before the commit (a
        # format-1 one has no segment files)
        old = mf.read_manifest(directory)
        next_segment = max([s.number for s in old.segments] + [0]) + 1
    # rows journalled against the index this store replaces die with it at save()
    journal = Journal.open_existing(directory, dim) if directory.is_dir() else None
    state.replacing(base, next_segment, journal, source, quantizer_dirty=quantizer is not None)
    return state


def files_in_the_way(directory: Path, model_path: Path | None) -> list[str]:
    """The names in `directory` that keep a new store out of it: everything when it
    holds a manifest (a committed index, or a damaged one), else all but what the
    store itself leaves from a first save that never committed (a Ctrl-C, a kill):
    its empty lock files, the files a save writes before its commit and temporary
    files, and a `model.onnx` equal to the model this store copies in. The save
    replaces those, and removes the rest once it commits; a re-run of the stopped
    command then works."""
    names = sorted(entry.name for entry in directory.iterdir())
    if mf.MANIFEST in names:
        return names
    return [name for name in names if not _first_save_leftover(directory / name, model_path)]


def _first_save_leftover(path: Path, model_path: Path | None) -> bool:
    if not path.is_file() or path.is_symlink():
        return False
    if path.name in (mf.LOCK_FILE, JOURNAL_LOCK_FILE):
        return path.stat().st_size == 0  # the store never writes into its locks
    if path.name == mf.MODEL_COPY_FILE:
        source = Path(model_path) if model_path is not None else None
        return bool(source and source.is_file() and filecmp.cmp(path, source, shallow=False))
    return mf.is_save_debris(path.name)


def open_store(
    wrap: Callable[[StoreState], S],
    directory: Path,
    *,
    fingerprint: str | None,
    dim: int | None,
    gpu: str,
    journal: bool,
    verify: bool,
) -> S:
    """`IndexStore.open`: the committed generation, wrapped by `wrap` (the store class),
    its journal replayed. Retried when a writer commits a new generation while this
    one is being opened."""
    check_gpu_mode(gpu)
    for attempt in range(_OPEN_RETRIES):
        manifest = mf.read_manifest(directory)
        check_expected(manifest, directory, fingerprint, dim)
        try:
            if journal and manifest.format_version != mf.FORMAT_VERSION:
                raise StoreError(mf.older_format_message(directory, manifest.format_version))
            state = load(directory, manifest, gpu)
            state.opened_format(manifest.format_version)
            store = wrap(state)
            if verify:
                store.verify()
            attach_journal(store, state, create=journal)
            return store
        except StoreError:
            moved_on = mf.committed_generation(directory) != manifest.generation
            if not moved_on or attempt == _OPEN_RETRIES - 1:
                raise
    raise AssertionError("unreachable")
