"""Near-duplicates over HTTP: the threshold a request means, and the background jobs of
POST /v1/duplicates (routers/duplicates.py).

A job runs `vitrieval.index.duplicates.find_duplicates`, the code of `vitrieval-index
duplicates`, in a worker thread. That code calls a store; here the store is the served
`Index` (any kind: local, sharded, a Ray cluster's), each call handed back to the event
loop (`BlockingIndex`), so a job reads the index exactly as requests do and never
holds its locks between calls. One job runs at a time; the last MAX_KEPT_JOBS are kept
in memory with their groups. A job lives as long as the server: a restart forgets it
(start it again; `vitrieval-index duplicates` is the resumable way), and a shutdown
stops a running one between batches.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from vitrieval.index.calibration import threshold_for
from vitrieval.index.contract import Index
from vitrieval.index.duplicates import find_duplicates
from vitrieval.index.store import StoreError
from vitrieval.index.store import manifest as mf
from vitrieval.index.store.request import Query, Ranked

from .errors import ApiError, store_error

logger = logging.getLogger(__name__)
MAX_KEPT_JOBS = 8
CALL_TIMEOUT_S = 600.0
"""A job's single index call that takes longer fails the job (a hung shard)."""
STOP_WAIT_S = 30.0
"""How long a shutdown waits for a running job to reach the end of its batch."""
T = TypeVar("T")


async def chosen_threshold(index: Index, threshold: float | None, precision: float | None) -> float:
    """`threshold` when given, else the index's calibrated one (of `precision`, or of
    the level it was calibrated for); a 422 when there is none."""
    if threshold is not None:
        return threshold
    raw = (await index.info()).get("calibration")
    try:
        return threshold_for(None if raw is None else mf.CalibrationEntry.from_json(raw), precision)
    except StoreError as exc:
        raise ApiError(422, "invalid_request", str(exc)) from None


class BlockingIndex:
    """The calls `find_duplicates` makes of a store, answered by an `Index` on the
    event loop `loop`: for code in a worker thread only (it waits for each call)."""

    def __init__(self, index: Index, loop: asyncio.AbstractEventLoop) -> None:
        self._index, self._loop = index, loop

    def _wait(self, call: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(call, self._loop).result(CALL_TIMEOUT_S)

    def info(self) -> dict[str, Any]:
        return self._wait(self._index.info())

    def scroll(self, filter: Any, limit: int, after: str | None) -> Any:
        return self._wait(self._index.scroll(filter, limit, after))

    def ranked_search(self, query: Query) -> Ranked:
        return self._wait(self._index.ranked_search(query))

    def get(self, key: str) -> Any:
        return self._wait(self._index.get(key))

    def __contains__(self, key: str) -> bool:
        return self._wait(self._index.contains(key))


class _Stopped(Exception):
    pass


@dataclass
class DuplicateJob:
    """One run: its state, the items searched so far, and when done its groups."""

    job: str
    threshold: float
    status: Literal["running", "done", "failed", "stopped"] = "running"
    searched: int = 0
    started: str = field(default_factory=mf.now_iso)
    finished: str | None = None
    groups: list[dict[str, Any]] | None = None
    error: str | None = None


class DuplicateJobs:
    """The server's duplicate jobs: one running at a time, the last MAX_KEPT_JOBS kept."""

    def __init__(self) -> None:
        self._jobs: dict[str, DuplicateJob] = {}
        self._tasks: set[asyncio.Task] = set()
        self._stop = threading.Event()

    def get(self, job: str) -> DuplicateJob | None:
        return self._jobs.get(job)

    @property
    def running(self) -> bool:
        """Whether a job is running (its index must stay open)."""
        return any(job.status == "running" for job in self._jobs.values())

    def start(self, index: Index, threshold: float, filter: Any, keep: str) -> DuplicateJob:
        """Start a job (a 409 `job_running` while another runs)."""
        running = [j.job for j in self._jobs.values() if j.status == "running"]
        if running:
            raise ApiError(409, "job_running", f"duplicates job {running[0]} is still running")
        job = DuplicateJob(uuid.uuid4().hex[:16], threshold)
        self._jobs[job.job] = job
        for old in list(self._jobs)[:-MAX_KEPT_JOBS]:
            del self._jobs[old]
        store = BlockingIndex(index, asyncio.get_running_loop())
        task = asyncio.create_task(asyncio.to_thread(self._run, job, store, filter, keep))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def _run(self, job: DuplicateJob, store: BlockingIndex, filter: Any, keep: str) -> None:
        def progress(searched: int) -> None:
            job.searched = searched
            if self._stop.is_set():
                raise _Stopped

        try:
            groups = find_duplicates(
                store, job.threshold, filter=filter, keep=keep, progress=progress
            )
            job.groups, job.status = [group.as_json() for group in groups], "done"
        except _Stopped:
            job.status = "stopped"
        except Exception as exc:  # a job must end: a failure is its answer, not a hang
            logger.exception("duplicates job %s failed", job.job)
            job.status = "failed"
            job.error = (
                store_error(exc, 500, "failed").detail  # its public words, never a path
                if isinstance(exc, StoreError)
                else f"{type(exc).__name__} (the server's log has the details)"
            )
        finally:
            job.finished = mf.now_iso()

    async def stop(self) -> None:
        """Stop the running job after its current batch, and wait for it (at most
        STOP_WAIT_S: a job stuck in an index call is left to its call's timeout)."""
        self._stop.set()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=STOP_WAIT_S)
        self._stop = threading.Event()  # a state served again starts jobs afresh
