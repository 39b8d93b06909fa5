"""Checking a store's bytes: full verification and the paced background scrub."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from . import manifest as mf
from .errors import ScrubStopped, StoreError

if TYPE_CHECKING:
    from .core import IndexStore


def verify_store(store: IndexStore) -> None:
    """Check every byte of every committed file against its checksum (StoreError)."""
    with store._lock:
        segments = list(store._sealed)
        committed = store._committed
    for segment in segments:
        segment.verify()
    model = committed.model if committed else None
    if model and model.file and model.checksum:
        mf.verify_file(store.directory, model.file, model.checksum)


def scrub_store(
    store: IndexStore, bytes_per_s: float | None, stop: threading.Event | None
) -> list[tuple[int, str]]:
    """`IndexStore.scrub`: verify the healthy sealed segments in turn, taking any that
    fails out of service; returns every damaged segment as (number, reason)."""
    with store._lock:
        segments = [s for s in store._sealed if not s.damaged]
    for segment in segments:
        if stop is not None and stop.is_set():
            break
        try:
            segment.verify(bytes_per_s, stop)
        except ScrubStopped:
            break
        except StoreError as exc:
            store.mark_damaged(segment, str(exc))
    return store.damaged_segments()
