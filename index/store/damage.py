"""Segments out of service: taking one out (a failed checksum, a file changed under
the process) and the short codes that report why."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import IndexStore
    from .segment import SealedSegment

logger = logging.getLogger("index.store.core")


def mark_damaged(store: IndexStore, segment: SealedSegment, reason: str) -> None:
    """`IndexStore.mark_damaged`: take `segment` out of service and log why."""
    with store._lock:
        if segment not in store._sealed:
            return
        segment.damaged = reason
        store._damaged = {**store._damaged, segment.number: reason}
    logger.error(
        "segment %d of %s is damaged and out of service: %s",
        segment.number,
        store.directory,
        reason,
    )


def take_out_changed(store: IndexStore) -> None:
    """Take out of service every sealed segment whose files changed on disk since they
    were opened (SealedSegment.changed_on_disk): called under the store's lock before
    each read of the sealed segments, so FAISS never reads a truncated mapping."""
    for segment in store._sealed:
        if segment.damaged is None:
            reason = segment.changed_on_disk()
            if reason is not None:
                mark_damaged(store, segment, reason)


DAMAGE_CODES = (
    ("was deleted", "deleted"),
    ("is missing", "missing"),
    ("changed on disk", "changed_on_disk"),
    ("checksum mismatch", "checksum_mismatch"),
)
"""(phrase of a reason, its code): the reasons are the store's own error messages."""


def damage_code(reason: str) -> str:
    """A damaged segment's reason as a short code (what /readyz shows; the reason
    itself names files and goes to the log)."""
    return next((code for phrase, code in DAMAGE_CODES if phrase in reason), "unreadable")
