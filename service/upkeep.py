"""How the index's checkpoints are going: what /readyz and /metrics report of them.

A checkpoint that fails (another process holds the folder's writer lock, a full disk)
leaves every acknowledged mutation in the journal and is retried; meanwhile adds go
on and the journal grows. That is not a reason to take a single writer out of its
load balancer, so /readyz stays 200 but says "degraded" with a reason code, and
/metrics shows the backlog and when the last checkpoint succeeded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vitrieval.index.store.errors import WriterLockTimeout

WRITER_LOCK_HELD = "writer_lock_held"
SAVE_FAILED = "save_failed"
CHECKPOINT_STALLED = "checkpoint_stalled"
"""The /readyz reason code of a checkpoint that failed and is waiting for its retry."""


@dataclass
class CheckpointStatus:
    """The outcome of the last checkpoint: `failure` is None after a success, else
    the reason code of the failure (WRITER_LOCK_HELD, SAVE_FAILED)."""

    last_success: float | None = None  # Unix time of the last successful checkpoint
    failure: str | None = None
    failed_at: float | None = None  # Unix time of the first failure of this run

    def succeeded(self) -> None:
        self.last_success, self.failure, self.failed_at = time.time(), None, None

    def failed(self, exc: BaseException) -> None:
        self.failure = WRITER_LOCK_HELD if isinstance(exc, WriterLockTimeout) else SAVE_FAILED
        self.failed_at = self.failed_at or time.time()

    @property
    def stalled(self) -> bool:
        return self.failure is not None
