"""Format-1 index directories: read as they are, converted by `upgrade`.

Format 1 kept one generation as two files, index.<g>.faiss and items.<g>.sqlite (with
every vector as a blob), each fully verified and loaded at open. Such a directory
opens read-only here: its generation becomes the store's in-memory segment, so
search, get and evaluation work as before, while save() and a journalling open ask
for `vitrieval-index upgrade DIR`. The upgrade seals that segment into format-2
files and replaces the manifest: the manifest is the commit point, so a crash before
it leaves the format-1 index as it was, and its old files are removed only after.

Format 2 (segments without columns files) is handled the same way: it opens
read-only (loading.py), its field index answering every filter, and the upgrade
writes each segment's columns file and commits a manifest of format 3.
"""

from __future__ import annotations

from pathlib import Path

import faiss

from . import manifest as mf
from .errors import StoreError
from .items import ItemTable
from .memory_segment import MemorySegment
from .store_state import StoreState
from .vectors import VectorIndex


def open_legacy(directory: Path, manifest: mf.Manifest, gpu: str) -> StoreState:
    """A format-1 generation as a read-only store's state (every file verified, as
    format 1 did)."""
    g = manifest.generation
    if manifest.model and manifest.model.file and manifest.model.checksum:
        mf.verify_file(directory, manifest.model.file, manifest.model.checksum)
    index_name, items_name = mf.index_file(g), mf.items_file(g)
    vectors = VectorIndex.from_bytes(
        mf.read_verified(directory, index_name, manifest.files[index_name]),
        directory / index_name,
        manifest.dim,
        gpu,
    )
    items = ItemTable.from_bytes(
        mf.read_verified(directory, items_name, manifest.files[items_name]),
        directory / items_name,
    )
    template = faiss.clone_index(vectors.cpu)
    template.reset()  # trained, empty: what new segments start from
    segment = MemorySegment(vectors, items)
    state = StoreState(
        directory,
        factory=manifest.factory,
        dim=manifest.dim,
        template=template,
        gpu=gpu,
        model=manifest.model,
        committed=manifest,
        growing=segment,
        legacy=True,
    )
    rows = segment.live_count + len(segment.tombstones)
    if rows != vectors.ntotal or segment.live_count != manifest.count:
        state.close()
        raise StoreError(
            f"{directory} is inconsistent: {vectors.ntotal} vectors, {rows} item rows, "
            f"manifest count {manifest.count}"
        )
    return state  # committed and unchanged: nothing unsaved


def older_format_message(directory: Path, version: int) -> str:
    """Why an index of an older format (1, or 2: segments without columns files) is
    not written: what a save, a merge and a journalling open say."""
    return (
        f"{directory} is an index of format {version}, which this vitrieval reads but "
        f"does not write: convert it with `vitrieval-index upgrade {directory}`"
    )
