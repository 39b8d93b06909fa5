"""bench/compressed_search.py's timing: one search per query from one thread (latency
and recall), the whole batch on every core (QPS), and two searches timed side by side
under the same load (the store against FAISS's IndexRefineFlat).

Each side is timed answering as it answers its users (the store: described hits;
FAISS: arrays); reading the item ids out of the answer, for recall, is not timed
(`Searcher`)."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import faiss
import numpy as np
from compressed_report import CORES, K, Row  # bench/compressed_report.py
from store_scale import id_of, pct, recall

PAIR_BLOCK = 50
"""Queries each side of a paired pass runs back to back before the other takes its
turn: the store's and FAISS's searches each run as a serving process runs them, one
after another, while turns of about 0.1-0.2 s keep both under the same load. Taking
turns every query instead times each search just after the other one's has filled
the CPU caches, which neither meets in service (both are recorded: `interleaved`)."""


class Searcher(NamedTuple):
    """A search to time (`call`: queries -> its own answer) and, untimed, the item ids
    of that answer per query (`ids`): each side is timed answering as it answers its
    users (the store: described hits; FAISS: arrays), not reading ids out of them."""

    call: Any
    ids: Any


def store_searcher(store: Any, rescore: bool, oversample: int | None) -> Searcher:
    return Searcher(
        lambda q: store.search(q, K, rescore=rescore, oversample=oversample),
        lambda hits: [[id_of(h.key) for h in row] for row in hits],
    )


def refine_searcher(refine: Any) -> Searcher:
    return Searcher(lambda q: refine.search(q, K)[1], lambda ids: ids.tolist())


def single_pass(search: Searcher, q: np.ndarray, exact: np.ndarray) -> Row:
    """Every query alone from one thread: p50/p99 ms and recall@10."""
    faiss.omp_set_num_threads(1)
    lat: list[float] = []
    found: list[list[int]] = []
    for i in range(len(q)):
        t0 = time.perf_counter()
        answer = search.call(q[i : i + 1])
        lat.append(1e3 * (time.perf_counter() - t0))
        found.append(search.ids(answer)[0])
    return {
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
        "recall@10": recall(found, exact),
        "hits": [len(set(f) & set(e.tolist())) for f, e in zip(found, exact, strict=True)],
    }


def batch_qps(search: Searcher, q: np.ndarray) -> float:
    """Queries per second of the whole batch in one call on every core (best of 2)."""
    faiss.omp_set_num_threads(CORES)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        search.call(q)
        best = min(best, time.perf_counter() - t0)
        if best > 3.0:
            break
    faiss.omp_set_num_threads(1)
    return len(q) / best


def paired_pass(a: Searcher, b: Searcher, q: np.ndarray, block: int = PAIR_BLOCK) -> Row:
    """Both searches of every query from one thread, in turns of `block` queries (which
    side goes first alternates turn by turn; block 1: every query): their latencies
    side by side under the same load (a shared machine's bursts hit both), p50 and
    p99 each and as a / b ratios."""
    faiss.omp_set_num_threads(1)
    times: tuple[list[float], list[float]] = ([], [])
    for turn, start in enumerate(range(0, len(q), block)):
        for which in (0, 1) if turn % 2 == 0 else (1, 0):
            call = (a, b)[which].call
            for i in range(start, min(start + block, len(q))):
                t0 = time.perf_counter()
                call(q[i : i + 1])
                times[which].append(1e3 * (time.perf_counter() - t0))
    row = {f"{side}_{stat}_ms": pct(t, level)
           for side, t in zip("ab", times, strict=True)
           for stat, level in (("p50", 50), ("p99", 99))}  # fmt: skip
    row["p50_ratio"] = row["a_p50_ms"] / row["b_p50_ms"]
    row["p99_ratio"] = row["a_p99_ms"] / row["b_p99_ms"]
    row["block"] = block
    return row


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")
