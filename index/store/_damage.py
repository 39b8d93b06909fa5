"""Segments out of service: taking one out (a failed checksum, a file changed under
the process) and the short codes that report why."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._sealed_segment import SealedSegment

logger = logging.getLogger("vitrieval.index.store._index_store")


def with_damaged(
    sealed: Sequence[SealedSegment],
    damaged: dict[int, str],
    segment: SealedSegment,
    reason: str,
    directory: Path,
) -> dict[int, str]:
    """The store's damaged-segment map once `segment` is out of service for `reason`
    (logged); unchanged when `segment` is no longer among the store's `sealed` (a
    merge replaced it: its files are gone because they were merged). The caller holds
    the store's lock and keeps the map it returns."""
    if segment not in sealed:
        return damaged
    segment.damaged = reason
    logger.error(
        "segment %d of %s is damaged and out of service: %s", segment.number, directory, reason
    )
    return {**damaged, segment.number: reason}


def changed_on_disk(sealed: Sequence[SealedSegment]) -> list[tuple[SealedSegment, str]]:
    """(segment, reason) for every sealed segment in service whose files changed on disk
    since they were opened (a stat a file: SealedSegment.changed_on_disk). Read before
    each read of the sealed segments, so FAISS never reads a truncated mapping."""
    found = []
    for segment in sealed:
        if segment.damaged is None:
            reason = segment.changed_on_disk()
            if reason is not None:
                found.append((segment, reason))
    return found


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
