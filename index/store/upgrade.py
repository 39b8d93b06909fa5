"""`vitrieval-index upgrade`: a format-1 index directory converted to format 2 in place."""

from __future__ import annotations

from pathlib import Path

from . import manifest as mf
from .core import IndexStore


def upgrade(directory: str | Path) -> tuple[int, int]:
    """Convert a format-1 index directory to format 2 in place; returns (format found,
    items). Journalled mutations are replayed and included. A no-op for format 2."""
    store = IndexStore.open(directory)
    try:
        if store.format_version != mf.LEGACY_FORMAT_VERSION:
            return mf.FORMAT_VERSION, len(store)
        store.upgrade_format()
        store.save()
        return mf.LEGACY_FORMAT_VERSION, len(store)
    finally:
        store.close()
