"""`IndexStore.info()`: the store described as it is in memory now, plus disk usage."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import manifest as mf

if TYPE_CHECKING:
    from .core import IndexStore


def store_info(store: IndexStore) -> dict[str, Any]:
    """A manifest-like summary of `store` (see `IndexStore.info`)."""
    with store._lock:
        committed = store._committed
        files = committed.listed_files() if committed else {}
        if committed and committed.model and committed.model.checksum:
            files[committed.model.file] = committed.model.checksum
        segments = [
            {
                "number": s.number,
                "rows": s.ntotal,
                "live": s.live_count,
                "deleted": len(s.tombstones),
                **({"dba": True} if s.dba else {}),
                **({"damaged": s.damaged} if s.damaged else {}),
            }
            for s in store._sealed
        ]
        return {
            "directory": str(store.directory),
            "format_version": store.format_version,
            "generation": committed.generation if committed else None,
            "count": len(store),
            "deleted": sum(len(s.tombstones) for s in store._segments()),
            "factory": store.factory,
            "dim": store.dim,
            "metric": mf.METRIC,
            "fingerprint": store.fingerprint,
            "model_file": str(store.model_path) if store.model_path else None,
            "trained": store._template.is_trained,
            "search_params": store.search_params(),
            "filter_fields": store.filter_fields.to_json(),
            "dba": None
            if store.dba is None
            else {
                "neighbours": store.dba[0],
                "alpha": store.dba[1],
                "live_items_with_dba": sum(s.live_count for s in store._sealed if s.dba),
            },
            "gpu": store._growing.vectors.gpu_in_use,
            "segments": segments,
            "growing": store._growing.live_count + sum(s.live_count for s in store._sealing),
            "bytes_on_disk": sum(entry.bytes for entry in files.values()),
            "files": {name: entry.to_json() for name, entry in files.items()},
            "unsaved_changes": store._dirty or store._model_source is not None,
            "journal_pending": store.journal_pending,
            "created": store._created,
            "updated": committed.updated if committed else None,
        }
