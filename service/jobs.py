"""Background jobs of the service (duplicates groups, re-embeddings): each runs in a
worker thread, one of a kind at a time, and the last MAX_KEPT_JOBS are kept in memory
with their outcome. A job lives as long as the server: a restart forgets it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from vitrieval.index.store import manifest as mf

from .errors import ApiError, job_error

logger = logging.getLogger(__name__)
MAX_KEPT_JOBS = 8
STOP_WAIT_S = 30.0
"""How long a shutdown waits for a running job to reach the end of its batch."""


class Job(Protocol):
    """What every job records: its id, status, end time and error."""

    job: str
    status: str
    finished: str | None
    error: str | None


J = TypeVar("J", bound=Job)


class Jobs(Generic[J]):
    """The jobs of one `kind` ("duplicates", "re-embedding"): see the module docstring."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._jobs: dict[str, J] = {}
        self._tasks: set[asyncio.Task] = set()

    def get(self, job: str) -> J | None:
        return self._jobs.get(job)

    def kept(self) -> list[J]:
        """The jobs kept, oldest first."""
        return list(self._jobs.values())

    @property
    def running(self) -> bool:
        """Whether a job is running (what it reads must stay open)."""
        return any(job.status == "running" for job in self._jobs.values())

    def check_idle(self) -> None:
        """A 409 `job_running` while a job runs."""
        running = [j.job for j in self._jobs.values() if j.status == "running"]
        if running:
            raise ApiError(409, "job_running", f"{self.kind} job {running[0]} is still running")

    def run(self, job: J, work: Callable[[], str], stopped: type[BaseException]) -> J:
        """Keep `job` and run `work` in a thread: its answer is the job's final status;
        raising `stopped` makes it "stopped", anything else "failed" (logged; the
        answer's `error` never names a server path)."""
        self._jobs[job.job] = job
        for old in list(self._jobs)[:-MAX_KEPT_JOBS]:
            del self._jobs[old]

        def guarded() -> None:
            try:
                job.status = work()
            except stopped:
                job.status = "stopped"
            except Exception as exc:  # a job must end: a failure is its answer, not a hang
                logger.exception("%s job %s failed", self.kind, job.job)
                job.status, job.error = "failed", job_error(exc)
            finally:
                job.finished = mf.now_iso()

        task = asyncio.create_task(asyncio.to_thread(guarded))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def wait(self) -> None:
        """Wait for the running job to end (at most STOP_WAIT_S)."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=STOP_WAIT_S)
