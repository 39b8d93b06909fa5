"""bench/compressed_search.py's comparison with FAISS's own IndexRefineFlat: the store's
one IVF-PQ segment file read into RAM, the exact vectors copied into its IndexFlat
(`k_factor` = the store's oversample), searched at the store's re-scored settings."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from compressed_report import Row  # bench/compressed_report.py
from compressed_timing import (
    batch_qps,
    paired_pass,
    refine_searcher,
    rss_mb,
    single_pass,
    store_searcher,
)
from machine import load_average  # bench/machine.py


def measure_refine(index: Path, vectors_file: Path, data: dict[str, Any], store_row: Row) -> Row:
    """IndexRefineFlat over the store's own IVF-PQ segment (read into RAM) and the float32
    (n, d) vectors the store holds (`vectors_file`, .npy): per re-scored setting of `store_row`,
    its latency, recall and QPS, then two paired passes with the store (in turns of
    PAIR_BLOCK queries, and taking turns every query)."""
    segs = sorted(index.glob("seg.*.faiss"))
    # mapped here and let go once copied: the copy in RAM is what RefineFlat adds
    vectors = np.load(vectors_file, mmap_mode="r")
    n = len(vectors)
    if len(segs) != 1:
        return {"skipped": f"{len(segs)} segments: RefineFlat needs the codes in one"}
    rss0 = rss_mb()
    t0 = time.perf_counter()
    base = faiss.read_index(str(segs[0]))
    if base.ntotal != n:
        return {"skipped": f"the segment holds {base.ntotal:,} of {n:,} vectors"}
    x = np.ascontiguousarray(vectors)
    refine = faiss.IndexRefineFlat(base, faiss.swig_ptr(x))
    del x, vectors
    load_s = time.perf_counter() - t0
    ivf = faiss.extract_index_ivf(base)
    row: Row = {"load_s": load_s, "rss_added_mb": rss_mb() - rss0, "settings": []}
    print(
        f"\n== IndexRefineFlat over {segs[0].name} ({base.ntotal:,} codes + exact vectors in "
        f"RAM): loaded in {load_s:.1f} s, RSS +{row['rss_added_mb']:,.0f} MB",
        flush=True,
    )
    from vitrieval.index.store import IndexStore

    q, exact = data["queries"], data["exact"]
    wanted = [(s["nprobe"], s["oversample"]) for s in store_row["settings"] if s["rescore"]]
    if not wanted:
        return row | {"skipped": "the store measured no re-scored setting"}
    store = IndexStore.open(index)
    # warm as the store's own passes are: this store is opened anew, and a page of its
    # mapped files that the page cache holds is still a page fault the first time this
    # mapping touches it (the vectors file is advised random: no fault-around), where
    # RefineFlat's copies were all touched when they were made. One untimed pass of
    # each at the widest setting maps what the timed passes read.
    widest = max(n for n, _ in wanted), max(o for _, o in wanted)
    ivf.nprobe, refine.k_factor = widest[0], float(widest[1])
    store.set_search_params(nprobe=widest[0])
    t0 = time.perf_counter()
    single_pass(store_searcher(store, True, widest[1]), q, exact)
    single_pass(refine_searcher(refine), q, exact)
    row["warm_pass_s"] = time.perf_counter() - t0
    for nprobe, k_factor in wanted:
        ivf.nprobe = nprobe
        refine.k_factor = float(k_factor)
        store.set_search_params(nprobe=nprobe)
        search = refine_searcher(refine)
        ours = store_searcher(store, True, k_factor)
        r = {"nprobe": nprobe, "oversample": k_factor} | single_pass(search, q, exact)
        r["qps"] = batch_qps(search, q)
        r["paired"] = paired_pass(ours, search, q)
        r["interleaved"] = paired_pass(ours, search, q, block=1)
        r["load"] = load_average()
        row["settings"].append(r)
        pair, every = r["paired"], r["interleaved"]
        print(
            f"  RefineFlat nprobe {nprobe} k_factor {k_factor}: recall@10 {r['recall@10']:.3f}, "
            f"p50/p99 {r['p50_ms']:.2f}/{r['p99_ms']:.2f} ms, {r['qps']:,.0f} QPS; paired "
            f"with the store, turns of {pair['block']} queries: p50 {pair['a_p50_ms']:.2f} "
            f"against {pair['b_p50_ms']:.2f} ms ({pair['p50_ratio']:.2f}x), p99 "
            f"{pair['p99_ratio']:.2f}x; turns every query: p50 {every['p50_ratio']:.2f}x, "
            f"p99 {every['p99_ratio']:.2f}x",
            flush=True,
        )
    store.close()
    return row  # the RefineFlat index (its RAM) goes with this frame
