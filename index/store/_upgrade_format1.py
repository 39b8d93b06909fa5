"""Format-1 index directories, read only to be converted by `vitrieval-index upgrade`.

Format 1 kept one generation as two files, index.<g>.faiss and items.<g>.sqlite (with
every vector as a blob), listed with their checksums in manifest.json::

    {"format_version": 1, "generation": g, "model": {...} | null, "dim": D,
     "metric": "inner_product", "factory": "Flat", "count": <live items>,
     "files": {"index.<g>.faiss": {"sha256": ..., "bytes": ...},
               "items.<g>.sqlite": {...}},
     "created": "<ISO 8601 UTC>", "updated": "<ISO 8601 UTC>"}

The store itself does not open such a directory (manifest.py refuses it, naming the
upgrade), and no module that opening, searching or saving imports imports this one:
the format-1 reader lives only here, loaded by upgrade.py. The upgrade verifies both
files in full, loads the generation as the store's in-memory segment, replays the
journal the folder holds, and saves: the growing segment is sealed into segments of
the current format and the manifest replaced. The manifest is the commit point, so a
crash before it leaves the format-1 index as it was; its old files are removed after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import faiss

from . import manifest as mf
from ._index_store import IndexStore
from ._items import ItemTable
from ._loading import attach_journal
from ._memory_segment import MemorySegment
from ._state import StoreState
from ._vectors import VectorIndex, check_gpu_mode
from .errors import StoreError


def index_file(generation: int) -> str:
    return f"index.{generation}.faiss"


def items_file(generation: int) -> str:
    return f"items.{generation}.sqlite"


def parse_format1(data: Any, where: Path) -> tuple[mf.Manifest, dict[str, mf.FileEntry]]:
    """A format-1 manifest's JSON as a manifest without segments, and its two files."""
    if not isinstance(data, dict) or data.get("format_version") != mf.UPGRADE_ONLY_FORMAT_VERSION:
        raise StoreError(f"{where} is not a manifest of format 1")
    if data.get("metric") != mf.METRIC:
        raise StoreError(f"{where} has metric {data.get('metric')!r}; only {mf.METRIC!r} is known")
    generation = mf.require_field(data, "generation", int, where)
    listed = mf.require_field(data, "files", dict, where)
    files = {}
    for name in (index_file(generation), items_file(generation)):
        if name not in listed:
            raise StoreError(f"{where} is invalid: it does not list {name}")
        files[name] = mf.parse_file_entry(listed[name], name, where)
    manifest = mf.Manifest(
        generation=generation,
        dim=mf.require_field(data, "dim", int, where),
        factory=mf.require_field(data, "factory", str, where),
        count=mf.require_field(data, "count", int, where),
        model=mf.parse_model_entry(data.get("model"), where),
        created=str(data.get("created", "")),
        updated=str(data.get("updated", "")),
        format_version=mf.UPGRADE_ONLY_FORMAT_VERSION,
    )
    return manifest, files


def open_format1(directory: Path, gpu: str = "auto") -> IndexStore:
    """A format-1 generation as a store (every file verified, as format 1 did), its
    journal replayed: what the upgrade saves in the current format."""
    check_gpu_mode(gpu)
    manifest, files = parse_format1(mf.read_manifest_json(directory), directory / mf.MANIFEST)
    g = manifest.generation
    if manifest.model and manifest.model.file and manifest.model.checksum:
        mf.verify_file(directory, manifest.model.file, manifest.model.checksum)
    index_name, items_name = index_file(g), items_file(g)
    vectors = VectorIndex.from_bytes(
        mf.read_verified(directory, index_name, files[index_name]),
        directory / index_name,
        manifest.dim,
        gpu,
    )
    items = ItemTable.from_bytes(
        mf.read_verified(directory, items_name, files[items_name]),
        directory / items_name,
    )
    template = faiss.clone_index(vectors.cpu)
    template.reset()  # trained, empty: what new segments start from
    segment = MemorySegment(vectors, items)
    state = StoreState.of_commit(directory, manifest, template, gpu, growing=segment)
    state.opened_format(mf.UPGRADE_ONLY_FORMAT_VERSION)
    rows = segment.live_count + len(segment.tombstones)
    if rows != vectors.ntotal or segment.live_count != manifest.count:
        state.close()
        raise StoreError(
            f"{directory} is inconsistent: {vectors.ntotal} vectors, {rows} item rows, "
            f"manifest count {manifest.count}"
        )
    store = IndexStore(state)
    attach_journal(store, state, create=False)  # mutations journalled before the upgrade
    return store


def upgrade_format1(directory: Path) -> int:
    """Convert the format-1 index in `directory` to the current format in place;
    returns its items (journalled mutations included)."""
    store = open_format1(directory)
    try:
        store.upgrade_format()
        store.save()
        return len(store)
    finally:
        store.close()
