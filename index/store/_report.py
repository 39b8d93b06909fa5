"""`IndexStore.info()`: the store described as it is in memory now, plus disk usage."""

from __future__ import annotations

from typing import Any

from . import manifest as mf
from ._state import StoreState


def store_info(state: StoreState) -> dict[str, Any]:
    """A manifest-like summary of the store `state` holds (see `IndexStore.info`)."""
    with state.lock:
        committed = state.committed
        files = committed.listed_files() if committed else {}
        if committed and committed.model and committed.model.checksum:
            files[committed.model.file] = committed.model.checksum
        segments = [
            {
                "number": s.number,
                "rows": s.ntotal,
                "live": s.live_count,
                "deleted": len(s.tombstones),
                **({"damaged": s.damaged} if s.damaged else {}),
            }
            for s in state.sealed
        ]
        return {
            "directory": str(state.directory),
            "format_version": state.format_version,
            "generation": committed.generation if committed else None,
            "count": state.live_count(),
            "deleted": sum(len(s.tombstones) for s in state.segments()),
            "factory": state.factory,
            "dim": state.dim,
            "metric": mf.METRIC,
            "fingerprint": state.fingerprint,
            "model_file": str(state.model_path) if state.model_path else None,
            "trained": state.template.is_trained,
            "search_params": state.search_params(),
            "tuning": state.tuning.to_json() if state.tuning else None,
            "calibration": state.calibration.to_json() if state.calibration else None,
            "filter_fields": state.filter_fields.to_json(),
            "dba": None
            if state.dba is None
            else {
                "neighbours": state.dba[0],
                "alpha": state.dba[1],
                "live_items_with_dba": state.dba_index.entry.count if state.dba_index else 0,
            },
            "gpu": state.growing.vectors.gpu_in_use,
            "segments": segments,
            "growing": state.growing.live_count + sum(s.live_count for s in state.sealing),
            "bytes_on_disk": sum(entry.bytes for entry in files.values()),
            "files": {name: entry.to_json() for name, entry in files.items()},
            "unsaved_changes": state.unsaved_changes,
            "journal_pending": state.journal_pending,
            "created": state.created,
            "updated": committed.updated if committed else None,
        }
