"""Compressed codes with re-scoring: recall, latency, QPS and memory per oversample and nprobe.

Per factory ("flat": Flat, N <= 1M only; "ivf-flat": IVF{nlist},Flat; "ivf-sq8":
IVF{nlist},SQ8; "ivf-pq": IVF{nlist},PQ48; on request "ivf-pq96": IVF{nlist},PQ96 (the
codes `--factory auto` picks for 10M x 384 under 1 GB), "ivf-sq4": IVF{nlist},SQ4 and
"opq": OPQ48,IVF{nlist},PQ48; nlist as bench/store_scale.py's `nlist_for`), over N
synthetic 384-d unit vectors of bench/search_qps.py's clustered mixture, generated part
by part as store_scale.py generates them (parts of 100,000 rows into one memory-mapped
vectors.npy in the work folder, so 10M never sits in memory), k = 10, `--queries`
held-out queries drawn as store_scale.py draws them, exact truth by brute force (numpy,
store_scale.py's `TopK`, fed part by part):

- build, the same way for every factory, through the Python API: `IndexStore.create`
  with the factory, `train` on the first min(N, 200,000) vectors (rows are independent
  draws of the mixture: a uniform sample), `add` in batches of 100,000, `save()` every
  1,000,000 vectors and at the end (`vitrieval-index build --embeddings`'s default
  `--save-every`; segment merges as the store does them). Seconds, segments, disk bytes
  per vector (all of INDEX over N; and its FAISS files alone, its vectors.npy alone).
- memory, in a fresh process: RSS after `IndexStore.open`, then after `--rss-searches`
  single searches (default 10,000, cycling over the queries, the index's default
  settings: re-scoring on at its saved oversample; stopped early after `--rss-seconds`,
  the count said), one FAISS thread.
- latency, per setting: every query searched alone from one thread
  (`faiss.omp_set_num_threads(1)`), p50 and p99, recall@10 (|found & exact| / k, as
  store_scale.py computes it). The search call alone is timed, answering as it answers
  its users (the store: described hits; FAISS: arrays); reading the item ids out of the
  answer for recall is not (`Searcher`). Page cache: **cold** for the first pass at the default
  setting after `sync; echo 1 > /proc/sys/vm/drop_caches` (when that file is writable,
  else said), then **warm**: one untimed pass at the widest setting (largest nprobe and
  oversample) before the timed passes, so every timed column but "cold" is warm.
- QPS with all cores: the whole query batch in one `search` call, FAISS threads = cores
  (best of 2 runs, one when a run takes over 3 s).
- settings: the store's default nprobe and `--nprobe-factor` x it (default 2); for a
  compressed factory, without re-scoring (`rescore=False`) and with it at every
  `--oversamples` value (default 1,2,4,8,16,32,64; past 16 only while recall@10 still
  climbs by `--climb` or more, default 0.002).
- FAISS's own `IndexRefineFlat` over the same IVF-PQ codes (the store's one segment's
  FAISS file read into RAM, the exact vectors copied into its IndexFlat; `k_factor` is
  the oversample) at the same nprobes and oversamples, N <= 1M and one segment only
  (after one untimed pass of each at the widest setting, the store opened anew for it
  and warm as its own passes are: its mappings touched, not only the page cache): the
  same latency, recall and QPS columns, and the store's p50 / RefineFlat's p50 at the
  same setting (the same candidates, so the same recall); then two **paired** passes,
  the store's and RefineFlat's searches timed side by side under the same load (each
  side runs turns of 50 queries back to back, which goes first alternating; and again
  taking turns every query: bench/compressed_timing.py's PAIR_BLOCK says why both), so
  that the ratios compare latencies measured under the same load
  (bench/compressed_refine.py).
- Milvus Lite (`--milvus-python PY`, a Python with pymilvus and milvus-lite, in child
  processes as store_scale.py runs it): the N vectors inserted once, then its
  `--milvus-index` (default IVF_SQ8, its compressed IVF index; milvus-lite has no
  IVF_PQ) at the same nlist and default nprobe, reopened in a fresh process, the first
  `--milvus-queries` queries (default 200) searched singly on one thread: p50/p99,
  recall@10, RSS after open, disk bytes per vector; beside the store's figures on the
  same queries. Without it, or if it fails, the reason is printed and recorded.

- `--target-recall R` (default 0.95; 0 skips it): each compressed index tuned to R
  as `vitrieval-index tune` tunes it (index/tuning.py: recall on the index's own items,
  a held-out half beside), then the chosen setting's recall@10 on the bench's queries,
  a fresh sample from the mixture that the tuning never saw.

The machine is shared: run it under `nice -n 10`; load averages are recorded before and
after every factory. Results go to stdout as Markdown tables and to `--json OUT`
(rewritten after every factory, so a stopped run keeps what it measured). Disk: the
work folder holds vectors.npy (N x 1,536 B) and one store at a time (deleted after it is
measured unless --keep): at 10M with ivf-sq8,ivf-pq about 35 GB at the peak (15.4 GB of
vectors.npy, the store's own 15.4 GB copy and its codes); IVF-Flat's FAISS file adds
another 15.4 GB, and Milvus Lite its own copy of the vectors.

Run:  .venv/bin/python bench/compressed_search.py --n 1000000 --json out.json
      [--factories flat,ivf-flat,ivf-sq8,ivf-pq] [--queries 1000] [--workdir DIR] [--keep]
      [--oversamples 1,2,4,8,16,32,64] [--nprobe-factor 2] [--rss-searches 10000]
      [--milvus-python /path/to/venv/bin/python] [--no-cold] [--no-refine]
      [--target-recall 0.95]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from compressed_refine import measure_refine  # bench/compressed_refine.py
from compressed_report import CORES, K, Row, markdown, write_json  # bench/compressed_report.py
from compressed_timing import batch_qps, single_pass, store_searcher  # bench/compressed_timing.py
from machine import describe, load_average, work_directory  # bench/machine.py
from search_qps import SEED, D, make_mixture
from store_scale import (
    MEM,
    PART_ROWS,
    TopK,
    bench_milvus_factory,
    bench_milvus_insert,
    chosen_factories,
    dir_bytes,
    key_of,
    milvus_usable,
    mixture_params,
    nlist_for,
    run_json,
)

TRAIN_MAX = 200_000
SAVE_EVERY = 1_000_000
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def factories(n: int) -> dict[str, str]:
    nlist = nlist_for(n)
    return {
        "flat": "Flat",
        "ivf-flat": f"IVF{nlist},Flat",
        "ivf-sq8": f"IVF{nlist},SQ8",
        "ivf-pq": f"IVF{nlist},PQ48",
        "ivf-pq96": f"IVF{nlist},PQ96",
        "ivf-sq4": f"IVF{nlist},SQ4",
        "opq": f"OPQ48,IVF{nlist},PQ48",
    }


# -- data ------------------------------------------------------------------------------


def write_data(work: Path, n: int, queries: int) -> dict[str, Any]:
    """vectors.npy (memory-mapped, part by part), the queries and their exact top k."""
    t0 = time.perf_counter()
    centres, rot = mixture_params()
    q = make_mixture(queries, centres, rot, SEED + 20 + n)
    np.save(work / "queries_all.npy", q)
    raw = np.lib.format.open_memmap(vectors_file(work), "w+", np.float32, (n, D))
    exact = TopK(q, K)
    for p, start in enumerate(range(0, n, PART_ROWS)):
        m = min(PART_ROWS, n - start)
        x = make_mixture(m, centres, rot, SEED + 10 + n + 1000 * p)
        raw[start : start + m] = x
        exact.update(x, start)
        print(f"  part {p}: {start + m:,} of {n:,} vectors written", end="\r", flush=True)
    raw.flush()
    del raw
    seconds = time.perf_counter() - t0
    print(f"  data: {n:,} vectors and {queries:,} queries with exact top {K}, {seconds:.0f} s")
    return {"queries": q, "exact": exact.ids, "data_s": seconds}


def vectors_file(work: Path) -> Path:
    return work / "vectors.npy"


def vectors(work: Path) -> np.ndarray:
    return np.load(vectors_file(work), mmap_mode="r")


# -- build -----------------------------------------------------------------------------


def build(name: str, factory: str, work: Path, n: int) -> Row:
    from vitrieval.index.store import IndexStore

    faiss.omp_set_num_threads(CORES)
    index = work / f"index-{name}"
    x = vectors(work)
    row: Row = {"factory": factory}
    t0 = time.perf_counter()
    store = IndexStore.create(index, dim=D, factory=factory)
    if store.needs_training():
        store.train(np.ascontiguousarray(x[: min(n, TRAIN_MAX)]))
    row["train_s"] = time.perf_counter() - t0
    since_save = 0
    for start in range(0, n, PART_ROWS):
        stop = min(n, start + PART_ROWS)
        store.add([key_of(i) for i in range(start, stop)], np.ascontiguousarray(x[start:stop]))
        since_save += stop - start
        if since_save >= SAVE_EVERY:
            store.save()
            since_save = 0
        print(f"  {name}: {stop:,} of {n:,} added", end="\r", flush=True)
    store.save()
    row["build_s"] = time.perf_counter() - t0
    row["segments"] = len(store.info()["segments"])
    row["search_params"] = store.search_params()
    store.close()
    files = [f for f in index.rglob("*") if f.is_file()]
    row["disk_bytes_per_vector"] = dir_bytes(index) / n
    row["faiss_bytes_per_vector"] = sum(f.stat().st_size for f in files if f.suffix == ".faiss") / n
    row["vectors_bytes_per_vector"] = (
        sum(f.stat().st_size for f in files if f.name.endswith(".vectors.npy")) / n
    )
    print(
        f"  {name}: build {row['build_s']:.1f} s (train {row['train_s']:.1f}), "
        f"{row['segments']} segment(s), {row['disk_bytes_per_vector']:,.0f} B/vector on disk "
        f"(FAISS {row['faiss_bytes_per_vector']:,.0f}, vectors "
        f"{row['vectors_bytes_per_vector']:,.0f}); {row['search_params']}",
        flush=True,
    )
    return row


# -- memory, in a fresh process ---------------------------------------------------------

CHILD_RSS = (
    MEM
    + """
def split():
    # anonymous memory (the codes FAISS holds, Python's heap) apart from file pages
    # (the memory-mapped vectors and segments, which the kernel reclaims at will)
    f = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return {k: int(f[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile")}
import json, sys, time
import faiss
import numpy as np
from vitrieval.index.store import IndexStore
faiss.omp_set_num_threads(1)
directory, queries = sys.argv[1], np.load(sys.argv[2])
searches, budget = int(sys.argv[3]), float(sys.argv[4])
before = mem()[0]
t0 = time.perf_counter()
store = IndexStore.open(directory)
open_s = time.perf_counter() - t0
after = mem()[0]
after_split = split()
t0 = time.perf_counter()
done = 0
while done < searches and time.perf_counter() - t0 < budget:
    store.search(queries[done % len(queries)][None], 10)
    done += 1
seconds = time.perf_counter() - t0
rss, hwm = mem()
print(json.dumps({"open_s": open_s, "rss_before_open_mb": before, "rss_after_open_mb": after,
                  "rss_after_searches_mb": rss, "rss_peak_mb": hwm, "searches": done,
                  "searches_s": seconds, "after_open": after_split,
                  "after_searches": split()}))
"""
)


def fresh_rss(index: Path, work: Path, searches: int, budget: float) -> Row:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    args = [sys.executable, "-c", CHILD_RSS, str(index), str(work / "queries_all.npy")]
    out, _ = run_json([*args, str(searches), str(budget)], env)
    return out


# -- latency ---------------------------------------------------------------------------


def drop_caches() -> str | None:
    """Empty the page cache; None when done, else why not."""
    try:
        os.sync()
        DROP_CACHES.write_text("1\n")
        return None
    except OSError as exc:
        return f"could not write {DROP_CACHES}: {exc.strerror or exc}"


def nprobes_for(params: dict[str, int], factor: int) -> list[int]:
    if "nprobe" not in params:
        return [0]
    default = params["nprobe"]
    wider = min(params["nlist"], default * factor)
    return [default, wider] if wider != default else [default]


def climbing(rows: list[Row], climb: float) -> bool:
    """Whether re-scoring's recall still rose by `climb` at the last oversample step."""
    rescored = [r for r in rows if r["rescore"]]
    if len(rescored) < 2:
        return True
    return rescored[-1]["recall@10"] - rescored[-2]["recall@10"] >= climb


def measure_store(
    name: str, index: Path, data: dict[str, Any], args: argparse.Namespace, cold_ok: bool
) -> Row:
    from vitrieval.index.store import IndexStore

    q, exact = data["queries"], data["exact"]
    store = IndexStore.open(index)
    params = store.search_params()
    compressed = "oversample" in params
    default_os = params.get("oversample")
    nprobes = nprobes_for(params, args.nprobe_factor)
    oversamples = args.oversamples if compressed else []
    out: Row = {"compressed": compressed, "default_params": params, "settings": []}

    def set_nprobe(nprobe: int) -> None:
        if nprobe:
            store.set_search_params(nprobe=nprobe)

    set_nprobe(nprobes[0])
    default_search = store_searcher(store, compressed, None)
    if cold_ok:
        why = drop_caches()
        if why is None:
            cold = single_pass(default_search, q, exact)
            out["cold"] = {k: v for k, v in cold.items() if k != "hits"}
            out["cold"] |= {"nprobe": nprobes[0], "rescore": compressed, "oversample": default_os}
            print(
                f"  cold (page cache dropped), default setting: p50/p99 {cold['p50_ms']:.2f}/"
                f"{cold['p99_ms']:.2f} ms, recall@10 {cold['recall@10']:.3f}",
                flush=True,
            )
        else:
            out["cold"] = {"skipped": why}
    set_nprobe(nprobes[-1])
    t0 = time.perf_counter()
    single_pass(store_searcher(store, compressed, max(oversamples, default=None)), q, exact)
    out["warm_pass_s"] = time.perf_counter() - t0
    for nprobe in nprobes:
        set_nprobe(nprobe)
        rows: list[Row] = []
        variants: list[tuple[bool, int | None]] = [(False, None)]
        variants += [(True, o) for o in oversamples]
        for rescore, oversample in variants:
            if rescore and oversample and oversample > 16 and not climbing(rows, args.climb):
                break
            search = store_searcher(store, rescore, oversample)
            row = {"nprobe": nprobe, "rescore": rescore, "oversample": oversample}
            row |= single_pass(search, q, exact)
            row["qps"] = batch_qps(search, q)
            row["load"] = load_average()
            rows.append(row)
            label = f"rescore x{oversample}" if rescore else "codes only"
            if not compressed:
                label = "exact scores"
            print(
                f"  {name} nprobe {nprobe or '-'} {label}: recall@10 {row['recall@10']:.3f}, "
                f"p50/p99 {row['p50_ms']:.2f}/{row['p99_ms']:.2f} ms, {row['qps']:,.0f} QPS",
                flush=True,
            )
            if not compressed:
                break
        out["settings"] += rows
    store.close()
    return out


# -- building to a target recall -------------------------------------------------------


def measure_tuning(index: Path, data: dict[str, Any], target: float) -> Row:
    """`vitrieval-index tune INDEX --target-recall R` through the Python API (index/tuning.py:
    recall measured on the index's own items), then the chosen setting's recall@10 on
    the bench's queries: a fresh sample, drawn from the mixture, not from the index."""
    from vitrieval.index.store import IndexStore
    from vitrieval.index.tuning import tune

    store = IndexStore.open(index)
    try:
        t0 = time.perf_counter()
        entry = tune(store, target, report=lambda line: print(f"    {line}", flush=True))
        seconds = time.perf_counter() - t0
        fresh = single_pass(store_searcher(store, True, None), data["queries"], data["exact"])
    finally:
        store.close()
    row = {"target_recall": target, "tune_s": seconds, "chosen": entry.params,
           "tuning_recall": entry.recall, "held_out_recall": entry.held_out_recall,
           "expected_latency_ms": entry.latency_ms, "fresh_recall": fresh["recall@10"],
           "fresh_p50_ms": fresh["p50_ms"], "fresh_p99_ms": fresh["p99_ms"]}  # fmt: skip
    print(
        f"  tuned to recall {target} in {seconds:.0f} s: {entry.params}, recall@10 "
        f"{entry.recall:.4f} (held out {entry.held_out_recall:.4f}); on the bench's fresh "
        f"queries {fresh['recall@10']:.4f}, p50/p99 {fresh['p50_ms']:.2f}/"
        f"{fresh['p99_ms']:.2f} ms",
        flush=True,
    )
    return row


# -- Milvus Lite -------------------------------------------------------------------------


def bench_milvus(args: argparse.Namespace, work: Path, data: dict[str, Any]) -> Row:
    nlist = nlist_for(args.n)
    kind = args.milvus_index
    params = {"nlist": nlist} if kind.startswith("IVF") else {}
    nprobe = max(8, nlist // 16) if kind.startswith("IVF") else 0
    mq = min(args.milvus_queries, len(data["queries"]))
    np.save(work / "queries.npy", data["queries"][:mq])  # what store_scale's children read
    inserted = bench_milvus_insert(args.milvus_python, work, args.n)
    spec = ("", kind, params)
    sub = {"exact_db": data["exact"][:mq]}
    row = bench_milvus_factory(
        args.milvus_python, work, kind, spec, nprobe, sub, inserted, args.n, 1
    )
    return row | {"queries": mq, "nprobe": nprobe, "insert": inserted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--factories", default=None, help="default: flat (N <= 1M), ivf-flat, "
                    "ivf-sq8, ivf-pq; also ivf-sq4, opq")  # fmt: skip
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--oversamples", default="1,2,4,8,16,32,64")
    ap.add_argument("--climb", type=float, default=0.002)
    ap.add_argument("--nprobe-factor", type=int, default=2)
    ap.add_argument("--rss-searches", type=int, default=10_000)
    ap.add_argument("--rss-seconds", type=float, default=150.0)
    ap.add_argument("--no-cold", action="store_true", help="do not drop the page cache")
    ap.add_argument("--no-refine", action="store_true", help="skip FAISS IndexRefineFlat")
    ap.add_argument("--workdir", default=None, help="default: a new temporary folder")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--milvus-python", default=None, help="a Python with pymilvus + milvus-lite")
    ap.add_argument("--milvus-index", default="IVF_SQ8")
    ap.add_argument("--milvus-queries", type=int, default=200)
    ap.add_argument("--target-recall", type=float, default=0.95,
                    help="tune each compressed index to it, then check on the bench's "
                    "queries (0: skip)")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.oversamples = sorted({int(o) for o in args.oversamples.split(",") if o.strip()})
    specs = factories(args.n)
    names = args.factories or (
        "flat,ivf-flat,ivf-sq8,ivf-pq" if args.n <= 1_000_000 else "ivf-flat,ivf-sq8,ivf-pq"
    )
    chosen = chosen_factories(names, specs, ap.error)
    use_milvus, why = milvus_usable(args.milvus_python)
    cold_ok = not args.no_cold and os.access(DROP_CACHES, os.W_OK)
    cold = "drop_caches" if cold_ok else f"not measured ({DROP_CACHES} not writable or --no-cold)"
    info: Row = describe(
        faiss=faiss.__version__,
        numpy=np.__version__,
        cold=cold,
        milvus=why if use_milvus else f"skipped: {why}",
    )
    print("  ".join(f"{k}: {v}" for k, v in info.items()), flush=True)
    work = work_directory(args.workdir, "compressed_search", ap.error)
    info["free_disk_gb"] = round(shutil.disk_usage(work).free / 1e9)
    res: Row = {"n": args.n, "d": D, "k": K, "queries": args.queries, "machine": info,
                "factories": {}}  # fmt: skip
    started = time.perf_counter()
    try:
        data = write_data(work, args.n, args.queries)
        info["data_s"] = round(data["data_s"], 1)
        for name in chosen:
            print(f"\n== {name}: {specs[name]}  (load {load_average()})", flush=True)
            row: Row = {"load_before": load_average()}
            res["factories"][name] = row
            row |= build(name, specs[name], work, args.n)
            index = work / f"index-{name}"
            row["rss"] = fresh_rss(index, work, args.rss_searches, args.rss_seconds)
            r = row["rss"]
            print(
                f"  fresh process: open {r['open_s']:.3f} s, RSS {r['rss_before_open_mb']:.0f} -> "
                f"{r['rss_after_open_mb']:.0f} MB, after {r['searches']:,} single searches "
                f"({r['searches_s']:.0f} s) {r['rss_after_searches_mb']:.0f} MB",
                flush=True,
            )
            row |= measure_store(name, index, data, args, cold_ok)
            if name == "ivf-pq" and not args.no_refine and args.n <= 1_000_000:
                row["refine"] = measure_refine(index, vectors_file(work), data, row)
            if row["compressed"] and args.target_recall:
                row["tuned"] = measure_tuning(index, data, args.target_recall)
            row["load_after"] = load_average()
            write_json(res, args.json)
            if not args.keep:
                shutil.rmtree(index, ignore_errors=True)
        if use_milvus:
            try:
                res["milvus"] = bench_milvus(args, work, data)
            except Exception as exc:  # Milvus failed: keep the store's figures
                print(f"Milvus Lite failed: {str(exc)[-1500:]}", flush=True)
                res["milvus"] = {"error": str(exc)[-3000:]}
        else:
            res["milvus"] = {"skipped": why}
    finally:
        info["load_after"] = load_average()
        info["total_s"] = round(time.perf_counter() - started, 1)
        if args.keep:
            print(f"\nkept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        print("\n" + "  ".join(f"{k}: {v}" for k, v in info.items()) + "\n\n" + markdown(res))
        write_json(res, args.json)


if __name__ == "__main__":
    main()
