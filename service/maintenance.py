"""The index's upkeep while the service runs, off the request path.

- Checkpoints: the journal is folded into a saved generation once it holds
  `checkpoint_every` mutations, or holds any for `checkpoint_interval_s`; a save
  seals the growing segment outside the store's search lock, so searches go on.
- Merges: after a checkpoint, when the merge policy finds small or worn segments,
  they are merged in a worker thread, one merge at a time; searches and adds go on.
- Scrub: `scrub_delay_s` after start and every `scrub_interval_s` after, every sealed
  segment is verified against its checksums at `scrub_bytes_per_s`; a damaged one is
  taken out of service, logged, and reported by /readyz and /metrics.
- At shutdown, what the journal holds is saved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

from .state import ServiceState

logger = logging.getLogger("vitrieval.service")

CHECKPOINT_POLL_S = 0.5


async def checkpoint_loop(state: ServiceState) -> None:
    """Save when due (see the module docstring), and merge after a save when due."""
    settings = state.settings
    if settings.read_only:
        return
    pending_since: float | None = None  # when the oldest unsaved mutation was seen
    merging: asyncio.Task | None = None
    try:
        while True:
            await asyncio.sleep(CHECKPOINT_POLL_S)
            pending = state.store.journal_pending
            if not pending:
                pending_since = None
                continue
            pending_since = pending_since or time.monotonic()
            due = time.monotonic() - pending_since >= settings.checkpoint_interval_s
            if pending < settings.checkpoint_every and not due:
                continue
            try:
                await asyncio.to_thread(state.store.save)
                pending_since = None
            except Exception:  # the journal still holds everything: retry later
                logger.exception("saving the index failed; mutations stay in the journal")
                pending_since = time.monotonic()
                continue
            idle = merging is None or merging.done()
            if idle and await asyncio.to_thread(state.store.due_merge):
                merging = asyncio.create_task(asyncio.to_thread(_merge, state))
    finally:
        if merging is not None:
            with contextlib.suppress(Exception):
                await merging  # a merge in a thread cannot be cancelled: let it finish


def _merge(state: ServiceState) -> None:
    try:
        merged = state.store.merge()
        if merged:
            state.metrics.merges.inc()
    except Exception:  # the last commit stands; the next checkpoint tries again
        logger.exception("merging segments failed; the index is unchanged")


async def scrub_loop(state: ServiceState) -> None:
    """Verify every sealed segment now and then, paced (see the module docstring)."""
    settings = state.settings
    if settings.scrub_interval_s <= 0:
        return
    await asyncio.sleep(settings.scrub_delay_s)
    stop = threading.Event()  # a thread cannot be cancelled: it is asked to stop
    try:
        while True:
            damaged = await asyncio.to_thread(state.store.scrub, settings.scrub_bytes_per_s, stop)
            if damaged:
                logger.error(
                    "index %s: segment(s) %s failed verification and are out of service; "
                    "restore the index from a backup",
                    settings.index,
                    ", ".join(str(number) for number, _ in damaged),
                )
            await asyncio.sleep(settings.scrub_interval_s)
    finally:
        stop.set()


def final_save(state: ServiceState) -> None:
    if state.settings.read_only or not state.store.journal_pending:
        return
    try:
        state.store.save()
    except Exception:
        logger.exception("final save failed; the journal keeps the mutations for next start")
