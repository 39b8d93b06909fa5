"""Search latency while a server-style store checkpoints: do saves stop searches?

A journalling store (as the service opens it) takes adds of 1,000 items at a time and
saves after each batch, in a background thread, while the main thread times single
searches. Printed side by side: search p50/p99 with no save running, during saves,
and the duration of one save. Searches wait for a save only for its short
in-memory swap (the files are written outside the store's lock), so the p99 during
saves stays near idle and far below a save's duration.

    python bench/checkpoint_search.py --n 200000 --dim 384
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from vitrieval.index.store import IndexStore


def unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def percentiles(samples: list[float]) -> tuple[float, float]:
    ms = np.asarray(samples) * 1000
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000, help="items in the index")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--factory", default="Flat")
    parser.add_argument("--saves", type=int, default=8, help="checkpoints of 1,000 adds")
    parser.add_argument("--searches", type=int, default=300, help="idle searches timed")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        directory = Path(tmp) / "index"
        x = unit(rng, args.n, args.dim)
        store = IndexStore.create(directory, dim=args.dim, factory=args.factory)
        if store.needs_training():
            store.train(x[:50_000])
        store.add([str(i) for i in range(args.n)], x)
        store.save()
        store.close()
        store = IndexStore.open(directory, journal=True)
        queries = unit(rng, 64, args.dim)

        def timed_search(i: int) -> float:
            started = time.perf_counter()
            store.search(queries[i % len(queries)][None], 10)
            return time.perf_counter() - started

        for i in range(20):  # warm the page cache and the code paths
            timed_search(i)
        idle = [timed_search(i) for i in range(args.searches)]
        save_times: list[float] = []
        done = threading.Event()

        def checkpoints() -> None:
            for s in range(args.saves):
                batch = unit(rng, 1000, args.dim)
                store.add([f"new-{s}-{i}" for i in range(1000)], batch)
                started = time.perf_counter()
                store.save()
                save_times.append(time.perf_counter() - started)
            done.set()

        during: list[float] = []
        worker = threading.Thread(target=checkpoints)
        worker.start()
        i = 0
        while not done.is_set():
            during.append(timed_search(i))
            i += 1
        worker.join()
        store.close()
    idle_p50, idle_p99 = percentiles(idle)
    busy_p50, busy_p99 = percentiles(during)
    save_ms = 1000 * float(np.median(save_times))
    print(f"# {args.n:,} x {args.dim} {args.factory}, {platform.processor() or platform.machine()}")
    print("| | p50 ms | p99 ms |")
    print("|---|---|---|")
    print(f"| search, idle ({len(idle)}) | {idle_p50:.2f} | {idle_p99:.2f} |")
    print(f"| search during saves ({len(during)}) | {busy_p50:.2f} | {busy_p99:.2f} |")
    print(f"| one save of 1,000 adds (median of {len(save_times)}) | {save_ms:.1f} | |")
    print(
        f"p99 during saves / idle: {busy_p99 / idle_p99:.2f}x; "
        f"p99 during saves / save duration: {busy_p99 / save_ms:.2f}"
    )


if __name__ == "__main__":
    main()
