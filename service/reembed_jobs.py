"""Re-embedding over HTTP (POST /v1/collections/{name}/reembed): a background job that
builds a new collection of a collection's items with another model, the code of
`vitrieval-index reembed` (index/reembed.py) in a worker thread.

The new collection is built under the data folder's building name (DataFolder.building,
not served) and renamed into place when complete (DataFolder.adopt), so it appears
whole or not at all. The source is read as any reader reads it: the items it holds
when the job starts, journal rows included; the server goes on serving and writing it
meanwhile. A job can be cancelled (DELETE): what is embedded so far is kept in the
building folder, and a new job into the same name goes on from there, as a killed
`reembed` does. Progress is the count of images read. One job runs at a time; a
restart forgets jobs (the building folder stays: start the job again).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Literal

from vitrieval.index.collections import DataFolder
from vitrieval.index.pipeline.build_index import Stopped
from vitrieval.index.reembed import reembed
from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.store import StoreError
from vitrieval.index.store import manifest as mf

from .errors import collection_error
from .jobs import Jobs


@dataclass
class ReembedJob:
    """One re-embedding: `source` into `target` with `model`; `embedded`: images read."""

    job: str
    source: str
    target: str
    model: str
    status: Literal["running", "done", "failed", "stopped"] = "running"
    embedded: int = 0
    no_image: int = 0
    image_gone: int = 0
    started: str = field(default_factory=mf.now_iso)
    finished: str | None = None
    error: str | None = None
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)


class ReembedJobs(Jobs[ReembedJob]):
    """The server's re-embedding jobs: one running at a time, the last kept (jobs.py)."""

    def __init__(self) -> None:
        super().__init__("re-embedding")

    def start(self, folder: DataFolder, source: str, target: str, model: str) -> ReembedJob:
        """Start re-embedding collection `source` into the new collection `target` with
        the model file `model` (a 409 while another job runs, or when `target` is taken;
        a 422 for a model file that is not there)."""
        self.check_idle()
        try:
            building = folder.building(target)
            model_path = folder.model_file(model)
        except StoreError as exc:  # the name taken (409), no such model file (422)
            raise collection_error(exc) from None
        job = ReembedJob(uuid.uuid4().hex[:16], source, target, model)

        def read(n: int) -> None:
            job.embedded += n

        def work() -> str:
            report = reembed(
                folder.directory(source),
                building,
                Embedder(model_path),
                progress=False,
                on_image=read,
                should_stop=job.cancel.is_set,
            )
            job.no_image, job.image_gone = len(report.no_image), len(report.image_gone)
            folder.adopt(target)
            return "done"

        return self.run(job, work, Stopped)

    def reading(self, collection: str) -> bool:
        """Whether a running job reads `collection` (it must not be deleted)."""
        return any(j.status == "running" and j.source == collection for j in self.kept())

    async def stop(self) -> None:
        """Stop the running job after its current batch and wait for it."""
        for job in self.kept():
            job.cancel.set()
        await self.wait()
