"""DynamicBatcher: concurrent queries share model calls, results go back to the right
caller, the batch size and the wait are bounded, and failures reach every waiter."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from vitrieval.service.batching import DynamicBatcher


class FakeModel:
    """Records each call's batch size; the 'embedding' of an image is its mean pixel
    value and the batch size, so a caller can tell whose row it got."""

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.calls: list[int] = []
        self.delay, self.fail = delay, fail
        self.threads: set[str] = set()

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        self.threads.add(threading.current_thread().name)
        self.calls.append(len(batch))
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("model exploded")
        means = batch.reshape(len(batch), -1).mean(axis=1)
        return np.stack([means, np.full(len(batch), len(batch))], axis=1).astype(np.float32)


def image(value: float) -> np.ndarray:
    return np.full((3, 4, 4), value, dtype=np.float32)


async def embed_all(batcher: DynamicBatcher, values: list[float]) -> list[np.ndarray]:
    await batcher.start()
    try:
        return await asyncio.gather(*(batcher.embed(image(v)) for v in values))
    finally:
        await batcher.stop()


def test_concurrent_queries_share_batches_and_get_their_own_rows() -> None:
    model = FakeModel(delay=0.02)
    batcher = DynamicBatcher(model, max_batch=4, max_wait_s=0.05)
    values = [float(i) for i in range(10)]
    rows = asyncio.run(embed_all(batcher, values))
    assert [row[0] for row in rows] == values  # each caller got its own image back
    assert sum(model.calls) == 10 and max(model.calls) <= 4
    assert len(model.calls) <= 4  # 10 queries in at most ceil(10 / 4) + 1 calls
    assert all(name.startswith("vitrieval-model") for name in model.threads)


def test_a_lone_query_waits_at_most_the_bound() -> None:
    model = FakeModel()
    batcher = DynamicBatcher(model, max_batch=32, max_wait_s=0.01)
    (row,) = asyncio.run(embed_all(batcher, [7.0]))
    assert row[0] == 7.0 and model.calls == [1]


def test_unbatched_mode_calls_the_model_once_per_query() -> None:
    model = FakeModel(delay=0.01)
    sizes: list[int] = []
    batcher = DynamicBatcher(model, enabled=False, on_batch=sizes.append)
    rows = asyncio.run(embed_all(batcher, [1.0, 2.0, 3.0, 4.0]))
    assert [row[0] for row in rows] == [1.0, 2.0, 3.0, 4.0]
    assert model.calls == [1, 1, 1, 1] and sizes == [1, 1, 1, 1]


def test_a_model_failure_reaches_every_waiter_and_the_batcher_survives() -> None:
    model = FakeModel(fail=True)
    batcher = DynamicBatcher(model, max_batch=8, max_wait_s=0.01)

    async def run() -> None:
        await batcher.start()
        results = await asyncio.gather(
            *(batcher.embed(image(v)) for v in (1.0, 2.0)), return_exceptions=True
        )
        assert all(isinstance(r, RuntimeError) for r in results)
        model.fail = False
        assert (await batcher.embed(image(5.0)))[0] == 5.0
        await batcher.stop()

    asyncio.run(run())


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        DynamicBatcher(FakeModel(), max_batch=0)
