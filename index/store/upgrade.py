"""`vitrieval-index upgrade`: an index directory of format 1, 2 or 3 converted to the
current format (4) in place."""

from __future__ import annotations

from pathlib import Path

from . import manifest as mf
from ._index_store import IndexStore


def upgrade(directory: str | Path) -> tuple[int, int]:
    """Convert an index directory of an older format to the current one in place;
    returns (format found, items). Format 1 is sealed into segments (journalled
    mutations replayed and included); format 2 gets its segments' columns files; with
    DBA on, the derived DBA index is computed (format 3 kept DBA vectors inside
    segments, which the commit drops). A no-op for the current format. The manifest
    is the commit point: a failure before it leaves the index as it was (the files
    written meanwhile are debris)."""
    directory = Path(directory)
    if mf.stored_format_version(directory) == mf.UPGRADE_ONLY_FORMAT_VERSION:
        # imported here, so that importing the store never loads the format-1 reader
        from ._upgrade_format1 import upgrade_format1

        return mf.UPGRADE_ONLY_FORMAT_VERSION, upgrade_format1(directory)
    store = IndexStore.open(directory)
    try:
        found = store.format_version
        if found == mf.FORMAT_VERSION:
            return found, len(store)
        store.upgrade_format()
        store.save()
        return found, len(store)
    finally:
        store.close()
