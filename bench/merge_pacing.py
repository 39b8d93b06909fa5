"""Search latency while the index merges, with the merge thread paced or not.

The service merges segments in a thread of its own (service/maintenance.py): paced,
that thread runs FAISS on `merge_threads` threads (half the cores by default) at nice
+10, so it takes the cores the searches leave idle. This bench builds one index
(N clustered unit vectors, IVF by default, merged into one segment), then, in one
run:

- idle: single searches (batch 1, k 10, one FAISS thread, as the service issues them)
  back to back, p50 / p99;
- per round and mode, `merge(everything=True, rewrite=True)` of the whole index in a
  thread, "unpaced" (a plain thread: FAISS on every core, the service's priority) or
  "paced" (`pace_this_thread`, the service's merge thread), the main thread searching
  back to back until the merge ends: p50 / p99 during the merge, the merge's duration.
  The modes alternate over `--rounds` rounds, so a change in the machine's load
  falls on both.

Printed side by side: per mode the median over rounds of p50, p99, p99 / idle and the
merge's seconds, and the paced / unpaced ratios. The load average before and after.

    PYTHONPATH=. python bench/merge_pacing.py [--n 500000] [--dim 128]
        [--factory IVF1024,Flat] [--rounds 2] [--merge-threads N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import faiss
import numpy as np

from bench.machine import cpu_model, git, load_average
from vitrieval.index.store import IndexStore
from vitrieval.service.maintenance import MERGE_NICE, default_merge_threads, pace_this_thread

K = 10
ADD_BATCH = 50_000
CLUSTERS = 2_048


def clustered(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    """n unit vectors around CLUSTERS random centres (IVF's lists then mean something)."""
    centres = rng.standard_normal((CLUSTERS, dim)).astype(np.float32)
    x = centres[rng.integers(CLUSTERS, size=n)]
    x += 0.6 * rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def timed_searches(
    store: IndexStore, queries: np.ndarray, until: Callable[[list[float]], bool]
) -> list[float]:
    """Single searches back to back until `until(latencies so far)`: latencies in ms."""
    out: list[float] = []
    while not until(out):
        t0 = time.perf_counter()
        store.search(queries[len(out) % len(queries)][None], K)
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def merge_under_search(
    store: IndexStore, queries: np.ndarray, paced: bool, merge_threads: int
) -> dict[str, float]:
    """One whole-index merge in a thread, timed searches meanwhile."""
    done = threading.Event()
    took: dict[str, float] = {}

    def merge() -> None:
        t0 = time.perf_counter()
        try:
            store.merge(everything=True, rewrite=True)
        finally:
            took["s"] = time.perf_counter() - t0
            done.set()

    if paced:
        pool = ThreadPoolExecutor(1, initializer=pace_this_thread, initargs=(merge_threads,))
        future = pool.submit(merge)
    else:
        worker = threading.Thread(target=merge)
        worker.start()
    # at least one search, should the merge end before the first one starts
    busy = timed_searches(store, queries, lambda got: done.is_set() and bool(got))
    if paced:
        future.result()
        pool.shutdown()
    else:
        worker.join()
    return {
        "p50_ms": pct(busy, 50),
        "p99_ms": pct(busy, 99),
        "searches": len(busy),
        "merge_s": took["s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=500_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--factory", default="IVF1024,Flat")
    ap.add_argument("--rounds", type=int, default=2, help="merges per mode, alternating")
    ap.add_argument("--merge-threads", type=int, default=None,
                    help="the paced merge's FAISS threads (default: the service's)")  # fmt: skip
    ap.add_argument("--idle-searches", type=int, default=2_000)
    ap.add_argument("--workdir", default=None, help="parent of the temporary folder")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    merge_threads = default_merge_threads() if args.merge_threads is None else args.merge_threads
    if min(args.rounds, args.idle_searches, merge_threads) < 1:
        ap.error("--rounds, --idle-searches and --merge-threads must be at least 1")
    faiss.omp_set_num_threads(1)  # this thread's searches only: OpenMP's count is per thread
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "faiss": faiss.__version__,
        "commit": git("rev-parse", "--short", "HEAD"),
        "load_before": load_average(),
        "merge_threads": merge_threads,
        "merge_nice": MERGE_NICE,
    }
    print("  ".join(f"{k}: {v}" for k, v in info.items()), flush=True)
    rng = np.random.default_rng(0)
    x = clustered(rng, args.n, args.dim)
    queries = clustered(rng, 200, args.dim)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        store = IndexStore.create(Path(tmp) / "index", dim=args.dim, factory=args.factory)
        if store.needs_training():
            store.train(x[:50_000])
        t0 = time.perf_counter()
        for start in range(0, args.n, ADD_BATCH):
            stop = min(start + ADD_BATCH, args.n)
            store.add([str(i) for i in range(start, stop)], x[start:stop])
            store.save()
        print(f"built {args.n:,} x {args.dim} {args.factory} in {time.perf_counter() - t0:.1f} s",
              flush=True)  # fmt: skip
        # one segment before timing anything: every timed merge then rewrites the
        # same index, and idle searches meet the segments the merges leave
        store.merge(everything=True, rewrite=True)
        for i in range(50):  # warm-up: first touches of the mapped files, untimed
            store.search(queries[i % len(queries)][None], K)
        idle = timed_searches(store, queries, lambda got: len(got) >= args.idle_searches)
        idle_p50, idle_p99 = pct(idle, 50), pct(idle, 99)
        print(f"idle: p50 {idle_p50:.2f} ms, p99 {idle_p99:.2f} ms", flush=True)
        rounds: dict[str, list[dict[str, float]]] = {"unpaced": [], "paced": []}
        for r in range(args.rounds):
            for mode in ("unpaced", "paced") if r % 2 == 0 else ("paced", "unpaced"):
                row = merge_under_search(store, queries, mode == "paced", merge_threads)
                rounds[mode].append(row)
                print(f"  round {r + 1} {mode:8s} merge {row['merge_s']:6.1f} s  search p50 "
                      f"{row['p50_ms']:.2f} ms  p99 {row['p99_ms']:.2f} ms  "
                      f"({row['searches']:,} searches)", flush=True)  # fmt: skip
        store.close()
    info["load_after"] = load_average()
    summary = {
        mode: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        for mode, rows in rounds.items()
    }
    print(f"\nN = {args.n:,}, d = {args.dim}, {args.factory}, {args.rounds} round(s); "
          f"load before {info['load_before']}, after {info['load_after']}\n")  # fmt: skip
    print("| merge thread | merge s | search p50 ms | search p99 ms | p99 / idle |")
    print("|---|---|---|---|---|")
    print(f"| none (idle) | – | {idle_p50:.2f} | {idle_p99:.2f} | 1.00x |")
    for mode, label in (
        ("unpaced", "unpaced (every core, same priority)"),
        ("paced", f"paced ({merge_threads} FAISS thread(s), nice +{MERGE_NICE})"),
    ):
        s = summary[mode]
        print(f"| {label} | {s['merge_s']:.1f} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | "
              f"{s['p99_ms'] / idle_p99:.2f}x |")  # fmt: skip
    paced, unpaced = summary["paced"], summary["unpaced"]
    print(f"| paced / unpaced | {paced['merge_s'] / unpaced['merge_s']:.2f}x | "
          f"{paced['p50_ms'] / unpaced['p50_ms']:.2f}x | "
          f"{paced['p99_ms'] / unpaced['p99_ms']:.2f}x | – |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    **info,
                    **{"n": args.n, "dim": args.dim, "factory": args.factory},
                    **{"idle_p50_ms": idle_p50, "idle_p99_ms": idle_p99},
                    **{"rounds": rounds, "summary": summary},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
