"""Checking a store's bytes: full verification and the paced background scrub."""

from __future__ import annotations

import json
import threading

from . import manifest as mf
from ._state import StoreState
from .errors import ScrubStopped, StoreError
from .filters import find_outside_int64
from .validation import key_problem


def verify_store(state: StoreState) -> None:
    """Check every byte of every committed file against its checksum (StoreError)."""
    with state.lock:
        segments = state.sealed
        committed = state.committed
        dba_index = state.dba_index
    for segment in segments:
        segment.verify()
    if dba_index is not None:
        dba_index.verify(state.directory)
    model = committed.model if committed else None
    if model and model.file and model.checksum:
        mf.verify_file(state.directory, model.file, model.checksum)


def scrub_store(
    state: StoreState, bytes_per_s: float | None, stop: threading.Event | None
) -> list[tuple[int, str]]:
    """`IndexStore.scrub`: verify the healthy sealed segments in turn, taking any that
    fails out of service; returns every damaged segment as (number, reason)."""
    with state.lock:
        segments = state.healthy_sealed()
    for segment in segments:
        if stop is not None and stop.is_set():
            break
        try:
            segment.verify(bytes_per_s, stop)
        except ScrubStopped:
            break
        except StoreError as exc:
            state.mark_damaged(segment, str(exc))
    return state.damaged_segments()


def legacy_items(state: StoreState, chunk: int = 10_000) -> list[tuple[str, str]]:
    """(key, what) for the items written before this version refused them: metadata
    holding an integer outside int64 (kept and returned as written; filters do not see
    it), keys HTTP clients cannot address (checks.key_problem). They stay searchable,
    and `remove` deletes them."""
    with state.lock:
        # serving(): an item table is memory-mapped, and one truncated since it was
        # opened would kill the process (SIGBUS) at the first read past its new end
        segments = state.serving()
    found = []
    for segment in segments:
        ids = [item_id for item_id, _ in segment.keys_by_id()]
        for start in range(0, len(ids), chunk):
            described = segment.describe(ids[start : start + chunk])
            for key, _label, _path, metadata in described.values():
                place = find_outside_int64(json.loads(metadata or "{}"), "metadata")
                if place is not None:
                    found.append((key, f"{place} is an integer outside int64"))
                if key_problem(key) is not None:
                    found.append((key, "a key HTTP clients rewrite (an empty, '.' or '..' part)"))
    return found
