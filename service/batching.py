"""Dynamic batching: queries that arrive together are embedded in one model call.

A request puts its preprocessed image, float32 (3, S, S), on a queue and awaits a
future. One collector task takes the first waiting image, then keeps taking more
until `max_batch` are gathered or `max_wait_s` has passed since the first, and runs
the model on the stacked batch in a worker thread, so the event loop keeps accepting
requests (which queue up for the next batch) while ONNX Runtime computes.

Why: on a GPU one call on B images costs far less than B calls on one (the weights
are read once, the matrix products fill the device). The wait bounds the latency a
lone query pays for it: with one client the batch closes after `max_wait_s`; under
load batches fill up without waiting at all. On CPUs, single-thread calls side by side
served more than batches in the measurement, so the service turns batching off there
by default (service/layout.py).

With batching disabled every query calls the model on its own: one at a time by
default (`unbatched_threads=1`, the baseline the load benchmark compares against), or
several calls at once on more threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

logger = logging.getLogger("vitrieval.service")

RunModel = Callable[[np.ndarray], np.ndarray]
"""float32 (B, 3, S, S) -> float32 (B, D)."""


class DynamicBatcher:
    """Embeds single preprocessed images, batching those that arrive together."""

    def __init__(
        self,
        run: RunModel,
        *,
        enabled: bool = True,
        max_batch: int = 32,
        max_wait_s: float = 0.002,
        on_batch: Callable[[int], None] | None = None,
        unbatched_threads: int = 1,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._run = run
        self.enabled = enabled
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._on_batch = on_batch or (lambda size: None)
        self._queue: asyncio.Queue[tuple[np.ndarray, asyncio.Future[np.ndarray]]] | None = None
        self._task: asyncio.Task[None] | None = None
        # one thread: batches run one after another, each using all of ORT's threads
        self.model_calls_at_once = 1 if enabled else unbatched_threads
        self._executor = ThreadPoolExecutor(
            self.model_calls_at_once, thread_name_prefix="vitrieval-model"
        )

    async def start(self) -> None:
        if self.enabled and self._task is None:
            self._queue = asyncio.Queue()
            self._task = asyncio.create_task(self._collect(), name="vitrieval-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._executor.shutdown(wait=True, cancel_futures=True)

    @property
    def alive(self) -> bool:
        """False once the collector task has ended (only stop() ends it)."""
        return not self.enabled or (self._task is not None and not self._task.done())

    async def embed(self, image: np.ndarray) -> np.ndarray:
        """float32 (3, S, S) -> float32 (D,), unit norm."""
        loop = asyncio.get_running_loop()
        if not self.enabled:
            self._on_batch(1)
            out = await loop.run_in_executor(self._executor, self._run, image[None])
            return out[0]
        if self._queue is None:
            raise RuntimeError("the batcher is not running (start() was not awaited)")
        future: asyncio.Future[np.ndarray] = loop.create_future()
        await self._queue.put((image, future))
        return await future

    async def _collect(self) -> None:
        assert self._queue is not None
        queue = self._queue
        loop = asyncio.get_running_loop()
        while True:
            batch = [await queue.get()]
            deadline = loop.time() + self.max_wait_s
            while len(batch) < self.max_batch:
                # take whatever is already waiting without yielding to the clock
                if not queue.empty():
                    batch.append(queue.get_nowait())
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(queue.get(), remaining))
                except TimeoutError:
                    break
            # requests that timed out or disconnected while queued are dropped
            live = [(image, future) for image, future in batch if not future.done()]
            if not live:
                continue
            self._on_batch(len(live))
            try:
                out = await loop.run_in_executor(
                    self._executor, self._run, np.stack([image for image, _ in live])
                )
                if len(out) != len(live):
                    raise RuntimeError(f"the model returned {len(out)} rows for {len(live)}")
            except Exception as exc:  # every waiter gets the error; the collector lives on
                logger.exception("embedding a batch of %d failed", len(live))
                for _, future in live:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for row, (_, future) in zip(out, live, strict=True):
                if not future.done():
                    future.set_result(row)
