"""Opening an index directory: its checks, its segments, and the replay of its journal.

`IndexStore.open` and `IndexStore.create` call these; they live apart so that the
store class keeps to what a store does once open.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ..model_metadata import ModelMetadataError, read_model_metadata
from . import manifest as mf
from .errors import StoreError
from .fields import FieldSelection
from .journal import JOURNAL_FILE, Journal, JournalOwner
from .persist import TUNABLE_PARAMS
from .segment import SealedSegment
from .vectors import VectorIndex, build_index

if TYPE_CHECKING:
    from .core import IndexStore

logger = logging.getLogger(__name__)


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


def check_expected(
    manifest: mf.Manifest, directory: Path, fingerprint: str | None, dim: int | None
) -> None:
    if dim is not None and dim != manifest.dim:
        raise StoreError(f"{directory} holds {manifest.dim}-d vectors, but {dim}-d were expected")
    if fingerprint is not None and fingerprint != manifest.fingerprint:
        built = manifest.fingerprint or "an unrecorded model"
        raise StoreError(
            f"{directory} was built with model fingerprint {built}, not {fingerprint}: "
            "rebuild the index with this model (into a new folder), or use the model it "
            "was built with"
            + (
                f" (the index keeps a copy: {directory / manifest.model.file})"
                if manifest.model and manifest.model.file
                else ""
            )
        )


def load(cls: type[IndexStore], directory: Path, manifest: mf.Manifest, gpu: str) -> IndexStore:
    if manifest.model and manifest.model.file and manifest.model.checksum:
        # small beside the segments, and what `search` embeds with: read in full
        mf.verify_file(directory, manifest.model.file, manifest.model.checksum)
    template = build_index(manifest.dim, manifest.factory)
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
