"""Opening and creating an index directory: its checks, its segments, and the replay
of its journal.

`IndexStore.open` and `IndexStore.create` call these; they live apart so that the
store class keeps to what a store does once open.
"""

from __future__ import annotations

import filecmp
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..model_metadata import ModelMetadataError, read_model_metadata
from . import manifest as mf
from .errors import FolderNotEmptyError, StoreError
from .fields import FieldSelection, check_field_paths
from .journal import JOURNAL_FILE, JOURNAL_LOCK_FILE, Journal, JournalOwner
from .journal_repair import row_problem, unappliable_row
from .leases import Lease
from .legacy import legacy_message, open_legacy
from .persist import TUNABLE_PARAMS, committed_files
from .segment import SealedSegment
from .vectors import VectorIndex, check_gpu_mode, new_faiss_index, start_template

if TYPE_CHECKING:
    from .core import IndexStore

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


class MovedOn(StoreError):
    """A writer committed a newer generation while this open was taking its lease."""


def load(cls: type[IndexStore], directory: Path, manifest: mf.Manifest, gpu: str) -> IndexStore:
    # the lease first, then the check that the generation is still the committed one:
    # every commit after that check sees the lease and keeps these files (leases.py)
    lease = Lease.take(directory, manifest.generation, committed_files(manifest))
    try:
        if mf.committed_generation(directory) != manifest.generation:
            raise MovedOn(f"{directory}: a newer generation was committed meanwhile")
        store = _load(cls, directory, manifest, gpu)
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    store._lease = lease
    return store


def _load(cls: type[IndexStore], directory: Path, manifest: mf.Manifest, gpu: str) -> IndexStore:
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
    try:
        for entry in manifest.segments:
            sealed.append(SealedSegment(directory, entry, manifest.dim, gpu, manifest.factory))
    except BaseException:
        for segment in sealed:
            segment.close()
        raise
    store = cls(
        directory,
        factory=manifest.factory,
        dim=manifest.dim,
        template=template,
        gpu=gpu,
        model=manifest.model,
        committed=manifest,
        sealed=sealed,
        filter_fields=FieldSelection(manifest.filter_fields),
        dba=manifest.dba,
    )
    for name, value in manifest.search_params.items():
        if name not in TUNABLE_PARAMS:
            continue
        VectorIndex(template, "cpu").set_parameter(name, value)
        for segment in sealed:
            segment.vectors.set_parameter(name, value)
    live = sum(s.live_count for s in sealed)
    if live != manifest.count:
        store.close()
        raise StoreError(
            f"{directory} is inconsistent: {live} live items in its segments, manifest "
            f"count {manifest.count}"
        )
    return store


def attach_journal(store: IndexStore, *, create: bool) -> None:
    """Replay the folder's journal; with `create`, journal every later mutation."""
    path = store.directory / JOURNAL_FILE
    try:
        if create:
            store._journal_owner = JournalOwner(store.directory)
        journal = (
            Journal(path, store.dim)
            if create
            else Journal.open_existing(store.directory, store.dim)
        )
    except BaseException:
        store.close()
        raise
    if journal is None:
        return
    committed = store._committed.journal if store._committed else None
    # rows the last commit holds already (its truncation may not have happened)
    held = committed[1] if committed and committed[0] == journal.id else 0
    try:
        replayed = 0
        store._journal_seq = max(store._journal_seq, held)
        for entry in journal.entries():
            if entry.seq <= held:
                continue
            problem = row_problem(entry, store.dim)
            if problem is not None:
                raise unappliable_row(store.directory, entry, problem)
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
            store._journal_seq = entry.seq
            replayed += 1
            store._journal_pending = replayed
    except BaseException:
        journal.close()
        store.close()
        raise
    store._journal, store._journaling = journal, create
    if replayed:
        logger.info("replayed %d journalled mutation(s) of %s", replayed, store.directory)


def create_store(
    cls: type[IndexStore],
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
) -> IndexStore:
    """`IndexStore.create`: a new, empty store (nothing written until save())."""
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
    store = cls(
        directory,
        factory=factory,
        dim=dim,
        template=start_template(dim, factory, quantizer),
        gpu=gpu,
        model=mf.ModelEntry(fingerprint) if fingerprint is not None else None,
        committed=None,
        filter_fields=FieldSelection(check_field_paths(filter_fields)),
    )
    store._model_source = source
    store._quantizer_dirty = quantizer is not None
    store._base_generation = mf.committed_generation(directory) if directory.is_dir() else None
    if store._base_generation is not None:
        # never write over a file of the index this one replaces before the commit
        old = mf.read_manifest(directory)
        store._next_segment = max([s.number for s in old.segments] + [0]) + 1
    if directory.is_dir():
        # rows journalled against the index this store replaces die with it at save()
        store._journal = Journal.open_existing(directory, dim)
        store._journal_seq = store._journal.last_seq() if store._journal else 0
    return store


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
    cls: type[IndexStore],
    directory: Path,
    *,
    fingerprint: str | None,
    dim: int | None,
    gpu: str,
    journal: bool,
    verify: bool,
) -> IndexStore:
    """`IndexStore.open`: the committed generation, its journal replayed. Retried when
    a writer commits a new generation while this one is being opened."""
    check_gpu_mode(gpu)
    for attempt in range(_OPEN_RETRIES):
        manifest = mf.read_manifest(directory)
        check_expected(manifest, directory, fingerprint, dim)
        try:
            if manifest.format_version == mf.LEGACY_FORMAT_VERSION:
                if journal:
                    raise StoreError(legacy_message(directory))
                store = open_legacy(cls, directory, manifest, gpu)
            else:
                store = load(cls, directory, manifest, gpu)
                if verify:
                    store.verify()
            attach_journal(store, create=journal)
            return store
        except StoreError:
            moved_on = mf.committed_generation(directory) != manifest.generation
            if not moved_on or attempt == _OPEN_RETRIES - 1:
                raise
    raise AssertionError("unreachable")
