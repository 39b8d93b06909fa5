"""The index's upkeep while the service runs, off the request path.

- Checkpoints: the journal is folded into a saved generation once it holds
  `checkpoint_every` mutations, or holds any for `checkpoint_interval_s`; a save
  seals the growing segment outside the store's search lock, so searches go on.
- Merges: after a checkpoint, when the merge policy finds small or worn segments,
  they are merged in a thread of their own, one merge at a time; searches and adds go
  on. That thread is paced: FAISS runs its parallel work there on `merge_threads`
  threads (half the cores by default; OpenMP's thread count is per calling thread,
  so the searches keep theirs) at a lower CPU priority (nice +`MERGE_NICE`), so a
  merge takes the cores the searches leave idle rather than half of each search's.
- Scrub: `scrub_delay_s` after start and every `scrub_interval_s` after, every sealed
  segment is verified against its checksums at `scrub_bytes_per_s`; a damaged one is
  taken out of service, logged, and reported by /readyz and /metrics.
- A checkpoint that cannot take the folder's writer lock within
  `vitrieval.index.store.manifest.WRITER_LOCK_WAIT_S` (another process holds it) fails like any
  failed save: the journal keeps everything, it is retried `checkpoint_interval_s`
  later, and /readyz says "degraded" meanwhile (service/upkeep.py).
- At shutdown, what the journal holds is saved (a save that cannot take the lock gives
  up after the same bound: the journal keeps it for the next start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import faiss

from vitrieval.index.store.errors import WriterLockTimeout

from .layout import cpu_count
from .state import ServiceState

logger = logging.getLogger("vitrieval.service")

CHECKPOINT_POLL_S = 0.5
MERGE_NICE = 10
"""How much lower than the service's the merge thread's CPU priority is (Linux nice)."""


def default_merge_threads() -> int:
    """`merge_threads` unset: half the cores this process may run on, at least one."""
    return max(1, cpu_count() // 2)


def pace_this_thread(threads: int) -> None:
    """Make the calling thread a background one: FAISS parallel regions started from it
    use `threads` threads, and it runs MERGE_NICE lower in CPU priority. For a thread
    that does nothing else (an unprivileged process cannot raise a priority back)."""
    faiss.omp_set_num_threads(threads)
    with contextlib.suppress(OSError, AttributeError):  # no per-thread nice: unpaced CPU
        thread = threading.get_native_id()  # Linux: a thread's id sets its own nice
        niceness = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, niceness + MERGE_NICE))


async def checkpoint_loop(state: ServiceState) -> None:
    """Save when due (see the module docstring), and merge after a save when due."""
    settings = state.settings
    if settings.read_only:
        return
    pending_since: float | None = None  # when the oldest unsaved mutation was seen
    merging: asyncio.Future | None = None
    merge_thread = ThreadPoolExecutor(
        1,
        thread_name_prefix="vitrieval-merge",
        initializer=pace_this_thread,
        initargs=(settings.merge_threads or default_merge_threads(),),
    )
    loop = asyncio.get_running_loop()
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
                state.checkpoints.succeeded()
                state.metrics.last_checkpoint.set(state.checkpoints.last_success or 0)
            except Exception as exc:  # the journal still holds everything: retry later
                first = not state.checkpoints.stalled
                state.checkpoints.failed(exc)
                state.metrics.checkpoint_failures.inc()
                if isinstance(exc, WriterLockTimeout):  # one line: not a bug of ours
                    log = logger.error if first else logger.warning
                    log("checkpoint stalled, mutations stay in the journal: %s", exc)
                else:
                    logger.exception("saving the index failed; mutations stay in the journal")
                pending_since = time.monotonic()
                continue
            idle = merging is None or merging.done()
            if idle and await asyncio.to_thread(state.store.due_merge):
                merging = loop.run_in_executor(merge_thread, _merge, state)
    finally:
        if merging is not None:
            with contextlib.suppress(Exception):
                await merging  # a merge in a thread cannot be cancelled: let it finish
        merge_thread.shutdown(wait=False)


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
            damaged = await asyncio.to_thread(_scrub, state, settings.scrub_bytes_per_s, stop)
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


def _scrub(state: ServiceState, bytes_per_s: float, stop: threading.Event) -> list:
    """One scrub of the store answering now (a read-only server's moves with commits)."""
    follower = getattr(state, "follower", None)
    if follower is None:
        return state.store.scrub(bytes_per_s, stop)
    return follower.read(lambda store: store.scrub(bytes_per_s, stop))


def final_save(state: ServiceState) -> None:
    if state.settings.read_only or not state.store.journal_pending:
        return
    try:
        state.store.save()
    except WriterLockTimeout as exc:
        logger.error("final save gave up; the journal keeps the mutations for next start: %s", exc)
    except Exception:
        logger.exception("final save failed; the journal keeps the mutations for next start")


@contextlib.asynccontextmanager
async def maintained(state: ServiceState) -> AsyncIterator[None]:
    """The upkeep of one served index (module docstring) while the block runs; after
    it, stop its duplicate jobs and upkeep, save what the journal holds, close it."""
    tasks = [
        asyncio.create_task(checkpoint_loop(state), name="vitrieval-checkpoint"),
        asyncio.create_task(scrub_loop(state), name="vitrieval-scrub"),
    ]
    if state.follower is not None:  # read-only: answer from each new commit
        tasks.append(asyncio.create_task(state.follower.follow(), name="vitrieval-follow"))
    try:
        yield
    finally:
        await state.duplicate_jobs.stop()  # before the index closes: a job reads it
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.to_thread(final_save, state)
        state.close()
