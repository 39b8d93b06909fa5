"""Near-duplicates over HTTP: the threshold a request means, and the background jobs of
POST /v1/duplicates (routers/duplicates.py).

A job runs `vitrieval.index.duplicates.find_duplicates`, the code of `vitrieval-index
duplicates`, in a worker thread. That code calls a store; here the store is the served
`Index` (any kind: local, sharded, a Ray cluster's), each call handed back to the event
loop (`BlockingIndex`), so a job reads the index exactly as requests do and never
holds its locks between calls. One job runs at a time; the last few are kept (jobs.py)
in memory with their groups. A job lives as long as the server: a restart forgets it
(start it again; `vitrieval-index duplicates` is the resumable way), and a shutdown
stops a running one between batches.
"""

from __future__ import annotations

import asyncio
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

from .errors import ApiError
from .jobs import Jobs

CALL_TIMEOUT_S = 600.0
"""A job's single index call that takes longer fails the job (a hung shard)."""
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


class DuplicateJobs(Jobs[DuplicateJob]):
    """The server's duplicate jobs: one running at a time, the last kept (jobs.py)."""

    def __init__(self) -> None:
        super().__init__("duplicates")
        self._stop = threading.Event()

    def start(self, index: Index, threshold: float, filter: Any, keep: str) -> DuplicateJob:
        """Start a job (a 409 `job_running` while another runs)."""
        self.check_idle()
        job = DuplicateJob(uuid.uuid4().hex[:16], threshold)
        store = BlockingIndex(index, asyncio.get_running_loop())

        def progress(searched: int) -> None:
            job.searched = searched
            if self._stop.is_set():
                raise _Stopped

        def work() -> str:
            found = find_duplicates(
                store, job.threshold, filter=filter, keep=keep, progress=progress
            )
            job.groups = [group.as_json() for group in found]
            return "done"

        return self.run(job, work, _Stopped)

    async def stop(self) -> None:
        """Stop the running job after its current batch, and wait for it (at most
        STOP_WAIT_S: a job stuck in an index call is left to its call's timeout)."""
        self._stop.set()
        await self.wait()
        self._stop = threading.Event()  # a state served again starts jobs afresh
