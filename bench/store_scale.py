"""The segmented index store at catalogue scale, beside Milvus Lite on the same workload.

Per factory ("flat": Flat, "ivf-flat": IVF{nlist},Flat, "ivf-pq": IVF{nlist},PQ48, and
on request "ivf-sq8": IVF{nlist},SQ8, Milvus Lite's nearest compressed index; nlist is
the power of two nearest 4 sqrt(N), at most 4096, as `--factory auto` picks it), over N
synthetic 384-d unit vectors from bench/search_qps.py's clustered mixture:

- build: `vitrieval-index build --embeddings EMB --model M.onnx --factory F --out INDEX`
  in a child process, from a Parquet embeddings folder this script writes (parts of
  100,000 rows, index/pipeline/embeddings_folder.py's writer; the model is a tiny ONNX graph whose
  embedding_dim is 384, written here too). Wall time, and the child's peak RSS (its
  rusage from wait4). Disk bytes per vector: every file of INDEX over N.
- open: `IndexStore.open` in a fresh process (median of 3): seconds, RSS before and
  after, and the first search; `vitrieval-index info INDEX` wall time (median of 3).
- save after 1,000 adds: a fresh process opens INDEX, adds 1,000 vectors, times save();
  against the full rewrite: `merge(everything=True)` of the whole index with nothing
  else running (every vector read, verified and written anew), and the build.
- add one vector: a fresh process times open + add(1) + save() (what `vitrieval-index
  add` does, embedding aside), and the real `vitrieval-index add INDEX --images DIR`
  with one image (wall time, interpreter start and model load included); against the
  build time (the goal: under 5%).
- search: single queries (k = 10) from the main thread on the opened index, p50/p99
  idle, then while `merge(everything=True)` runs in a thread (searches and single adds
  alternate back to back until it ends): p50/p99 during the merge, the merge's
  duration, add p99 idle and during the merge; recall@10 against exact brute force
  (numpy) over every vector the index holds.
- threads: the timed searches and adds run with `--search-threads` FAISS/BLAS threads
  (default 1, in both engines): a single query gains nothing from more (FAISS
  parallelises a search over its queries), and on a busy machine every OpenMP region
  waits for its slowest, descheduled thread. Merges and builds use every core.
- Milvus Lite (`--milvus-python PY`: a Python with pymilvus and milvus-lite, run in a
  child process so their pins stay out of this environment): the same vectors inserted
  once into a local collection (batches of 5,000; insert rate; flush), then per factory
  the matching index (FLAT, IVF_FLAT, IVF_PQ; same nlist and nprobe) created and
  loaded; in a fresh process the reconnect + load time, RSS, search p50/p99 and
  recall@10 on the same queries, disk bytes per vector. Side by side as ratios
  vitrieval / Milvus. Without `--milvus-python`, or if it cannot import pymilvus, the
  comparison is skipped and the reason printed.

The machine is shared: run it under `nice -n 10`; the load average is printed before
and after. Above 1M vectors the default factories are "ivf-pq" only, and vectors are
generated part by part (nothing holds all N in memory).

Run:  .venv/bin/python bench/store_scale.py --n 1000000 --json out.json
      [--factories flat,ivf-flat,ivf-pq] [--queries 200] [--workdir DIR] [--keep]
      [--milvus-python /path/to/venv/bin/python] [--search-threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import faiss
import numpy as np
from machine import describe, git, load_average, work_directory  # bench/machine.py
from search_qps import CLUSTERS, SEED, D, make_mixture

REPO = Path(__file__).resolve().parent.parent
K = 10
PART_ROWS = 100_000
ADD_BATCH = 1000
MILVUS_BATCH = 5000
Row = dict[str, Any]


def chosen_factories(names: str, specs: dict, refuse: Callable[[str], NoReturn]) -> list[str]:
    """`--factories`' comma-separated names, each one of `specs` (else `refuse`)."""
    chosen = [s.strip() for s in names.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in specs]
    if unknown:
        refuse(f"unknown factories {unknown}; choose from {', '.join(specs)}")
    return chosen


def nlist_for(n: int) -> int:
    return min(4096, 2 ** round(math.log2(4 * math.sqrt(n))))


def factories(n: int) -> dict[str, tuple[str, str, dict[str, int]]]:
    """name -> (FAISS factory, Milvus index type, Milvus build params)."""
    nlist = nlist_for(n)
    return {
        "flat": ("Flat", "FLAT", {}),
        "ivf-flat": (f"IVF{nlist},Flat", "IVF_FLAT", {"nlist": nlist}),
        "ivf-pq": (f"IVF{nlist},PQ48", "IVF_PQ", {"nlist": nlist, "m": 48, "nbits": 8}),
        "ivf-sq8": (f"IVF{nlist},SQ8", "IVF_SQ8", {"nlist": nlist}),
    }


# -- data ------------------------------------------------------------------------------


def mixture_params() -> tuple[np.ndarray, np.ndarray]:
    """The centres and rotation of bench/search_qps.py's mixture (same seeds)."""
    meta = np.random.default_rng(SEED)
    centres = meta.standard_normal((CLUSTERS, D), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    rot = np.linalg.qr(meta.standard_normal((D, D)))[0].astype(np.float32)
    return centres, rot


class TopK:
    """Exact top-k inner products of `queries`, fed database chunks in order."""

    def __init__(self, queries: np.ndarray, k: int = K) -> None:
        self.q = queries
        self.scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        self.ids = np.full((len(queries), k), -1, dtype=np.int64)

    def update(self, x: np.ndarray, first_id: int) -> None:
        k = self.scores.shape[1]
        sc = self.q @ x.T
        part = np.argpartition(-sc, min(k, sc.shape[1]) - 1, axis=1)[:, :k]
        cand_s = np.concatenate([self.scores, np.take_along_axis(sc, part, 1)], axis=1)
        cand_i = np.concatenate([self.ids, part + first_id], axis=1)
        top = np.argsort(-cand_s, axis=1, kind="stable")[:, :k]
        self.scores = np.take_along_axis(cand_s, top, 1)
        self.ids = np.take_along_axis(cand_i, top, 1)

    def copy(self) -> TopK:
        other = TopK(self.q, self.scores.shape[1])
        other.scores, other.ids = self.scores.copy(), self.ids.copy()
        return other


def key_of(i: int) -> str:
    return f"{i:010d}"


def id_of(key: str) -> int:
    return int(key) if key.isdigit() else -1


def write_model(path: Path) -> str:
    """A tiny vitrieval ONNX model: images (B, 3, 16, 16) -> 384-d unit embeddings."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from vitrieval.index.runtime.model_metadata import ModelMetadata

    w = np.random.default_rng(7).standard_normal((3 * 16 * 16, D)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", ["images"], ["flat"], axis=1),
            helper.make_node("MatMul", ["flat", "w"], ["raw"]),
            helper.make_node("LpNormalization", ["raw"], ["embeddings"], axis=1, p=2),
        ],
        "store_scale",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["B", 3, 16, 16])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["B", D])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    fingerprint = hashlib.sha256(w.tobytes()).hexdigest()
    meta = ModelMetadata(
        input_size=(3, 16, 16),
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        interpolation="bilinear",
        crop_pct=1.0,
        embedding_dim=D,
        backbone="random-projection",
        pooling="none",
        fingerprint=fingerprint,
    )
    for key, value in meta.to_properties().items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(path))
    return fingerprint


def write_data(work: Path, n: int, queries: int, milvus: bool) -> dict[str, Any]:
    """The embeddings folder, queries, vectors to add, and exact top-k (database only,
    and with the 1,001 vectors the benchmark adds)."""
    from PIL import Image

    from vitrieval.index.pipeline.embeddings_folder import META_FILE, part_name, write_part

    t0 = time.perf_counter()
    emb = work / "emb"
    emb.mkdir()
    model = work / "model.onnx"
    fingerprint = write_model(model)
    centres, rot = mixture_params()
    q = make_mixture(queries, centres, rot, SEED + 20 + n)
    adds = make_mixture(ADD_BATCH + 1, centres, rot, SEED + 30 + n)
    during = make_mixture(4000, centres, rot, SEED + 40 + n)
    np.save(work / "queries.npy", q)
    np.save(work / "adds.npy", adds)
    np.save(work / "during.npy", during)
    raw = (
        np.lib.format.open_memmap(work / "vectors.npy", "w+", np.float32, (n, D))
        if milvus
        else None
    )
    exact = TopK(q)
    for p, start in enumerate(range(0, n, PART_ROWS)):
        m = min(PART_ROWS, n - start)
        x = make_mixture(m, centres, rot, SEED + 10 + n + 1000 * p)
        write_part(emb / part_name(p), [key_of(i) for i in range(start, start + m)], x)
        exact.update(x, start)
        if raw is not None:
            raw[start : start + m] = x
        print(f"  part {p}: {start + m:,} of {n:,} vectors written", end="\r", flush=True)
    if raw is not None:
        raw.flush()
        del raw
    (emb / META_FILE).write_text(json.dumps({"dim": D, "model_fingerprint": fingerprint}))
    with_adds = exact.copy()
    with_adds.update(adds, n)
    one = work / "one_image"
    one.mkdir()
    pixels = np.random.default_rng(3).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(one / "added.png")
    seconds = time.perf_counter() - t0
    print(f"  data: {n:,} vectors in {n // PART_ROWS + (n % PART_ROWS > 0)} parts, {seconds:.0f} s")
    return {
        "emb": emb,
        "model": model,
        "queries": q,
        "exact_db": exact.ids,
        "exact_all": with_adds.ids,
        "one_image": one,
        "data_s": seconds,
    }


# -- child processes -------------------------------------------------------------------

MEM = """
def mem():
    f = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return int(f["VmRSS"].split()[0]) / 1024, int(f["VmHWM"].split()[0]) / 1024
"""

CHILD_OPEN = (
    MEM
    + """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from vitrieval.index.store import IndexStore
imported = time.perf_counter() - t0
before = mem()[0]
t0 = time.perf_counter()
store = IndexStore.open(sys.argv[1])
open_s = time.perf_counter() - t0
after = mem()[0]
q = np.load(sys.argv[2])[:1]
t0 = time.perf_counter()
store.search(q, 10)
first = time.perf_counter() - t0
rss = mem()[0]
segments = len(store.info()["segments"])
print(json.dumps({"import_s": imported, "open_s": open_s, "rss_before_open_mb": before,
                  "rss_after_open_mb": after, "first_search_ms": 1e3 * first,
                  "rss_after_first_search_mb": rss, "segments": segments}))
"""
)

CHILD_SAVE = """
import json, sys, time
import numpy as np
from vitrieval.index.store import IndexStore
directory, adds = sys.argv[1], np.load(sys.argv[2])
start, count = int(sys.argv[3]), int(sys.argv[4])
t0 = time.perf_counter()
store = IndexStore.open(directory)
t1 = time.perf_counter()
store.add([f"{i:010d}" for i in range(start, start + count)], adds[:count])
t2 = time.perf_counter()
store.save()
t3 = time.perf_counter()
segments = len(store.info()["segments"])
store.close()
print(json.dumps({"open_s": t1 - t0, "add_s": t2 - t1, "save_s": t3 - t2, "total_s": t3 - t0,
                  "segments": segments}))
"""


def run_json(args: list[str], env: dict[str, str] | None = None) -> tuple[dict[str, Any], float]:
    """Run a child, return (its last stdout line as JSON, wall seconds)."""
    t0 = time.perf_counter()
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{args[:3]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), wall


def py_child(code: str, *args: str) -> tuple[dict[str, Any], float]:
    return run_json([sys.executable, "-c", code, *args])


def cli() -> list[str]:
    script = Path(sys.executable).with_name("vitrieval-index")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vitrieval.index.cli"]


def timed_cli(args: list[str], log: Path) -> tuple[float, int, str]:
    """Run `vitrieval-index ARGS`; (wall seconds, peak RSS in MB of the child, last line)."""
    with open(log, "a") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cli() + args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = log.read_text().strip().splitlines()
    if proc.returncode != 0:
        raise RuntimeError(f"vitrieval-index {args[0]} failed: {lines[-5:]}")
    return wall, usage.ru_maxrss // 1024, lines[-1] if lines else ""


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def pct(values: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(values), p)) if values else float("nan")


def recall(found: list[list[int]], exact: np.ndarray) -> float:
    hits = [len(set(f) & set(e.tolist())) for f, e in zip(found, exact, strict=True)]
    return float(np.mean(hits)) / K


# -- vitrieval ---------------------------------------------------------------------------


def bench_vitrieval(name: str, factory: str, data: dict[str, Any], work: Path, n: int) -> Row:
    from vitrieval.index.store import IndexStore

    index = work / f"index-{name}"
    log = work / f"{name}.log"
    row: Row = {"factory": factory}
    print(f"\n== {name}: {factory}", flush=True)
    args = ["build", "--embeddings", str(data["emb"]), "--model", str(data["model"])]
    build_s, peak, line = timed_cli([*args, "--factory", factory, "--out", str(index)], log)
    row |= {"build_s": build_s, "build_peak_rss_mb": peak, "build_line": line}
    print(f"  build {build_s:.1f} s, peak RSS {peak:,} MB: {line}", flush=True)
    row["disk_bytes_per_vector"] = dir_bytes(index) / n

    queries = str(work / "queries.npy")
    opens = [py_child(CHILD_OPEN, str(index), queries)[0] for _ in range(3)]
    opens.sort(key=lambda r: r["open_s"])
    row |= {f"{k}": v for k, v in opens[1].items() if k != "segments"}
    infos = sorted(timed_cli(["info", str(index)], log)[0] for _ in range(3))
    row["info_s"] = infos[1]
    print(
        f"  {row['disk_bytes_per_vector']:.0f} B/vector; open {row['open_s']:.3f} s, RSS "
        f"{row['rss_before_open_mb']:.0f} -> {row['rss_after_open_mb']:.0f} MB; first search "
        f"{row['first_search_ms']:.1f} ms; `info` {row['info_s']:.2f} s",
        flush=True,
    )

    adds = str(work / "adds.npy")
    saved, _ = py_child(CHILD_SAVE, str(index), adds, str(n), str(ADD_BATCH))
    row["save_after_1000_adds_s"] = saved["save_s"]
    one, one_wall = py_child(CHILD_SAVE, str(index), str(work / "one.npy"), str(n + ADD_BATCH), "1")
    row |= {"add_one_open_s": one["open_s"], "add_one_add_s": one["add_s"],
            "add_one_save_s": one["save_s"], "add_one_s": one["total_s"],
            "add_one_process_s": one_wall}  # fmt: skip
    cli_add, _, line = timed_cli(["add", str(index), "--images", str(data["one_image"])], log)
    row["cli_add_one_s"] = cli_add
    row["add_one_vs_build"] = one["total_s"] / build_s
    row["cli_add_one_vs_build"] = cli_add / build_s
    print(
        f"  save after {ADD_BATCH:,} adds {saved['save_s']:.2f} s; open+add(1)+save "
        f"{one['total_s']:.2f} s (open {one['open_s']:.2f}, save {one['save_s']:.2f}); "
        f"`vitrieval-index add` of one image {cli_add:.2f} s: {line}",
        flush=True,
    )

    store = IndexStore.open(index)
    row["search_params"] = store.search_params()
    row["segments_searched"] = len(store.info()["segments"])
    q = data["queries"]
    for i in range(min(5, len(q))):  # warm-up
        store.search(q[i : i + 1], K)
    idle: list[float] = []
    found: list[list[int]] = []
    for i in range(len(q)):
        t0 = time.perf_counter()
        hits = store.search(q[i : i + 1], K)[0]
        idle.append(1e3 * (time.perf_counter() - t0))
        found.append([id_of(h.key) for h in hits])
    row["recall@10"] = recall(found, data["exact_all"])
    during_x = np.load(work / "during.npy")
    base = n + ADD_BATCH + 1
    add_idle: list[float] = []
    for j in range(100):
        t0 = time.perf_counter()
        store.add([key_of(base + j)], during_x[j : j + 1])
        add_idle.append(1e3 * (time.perf_counter() - t0))
    store.save()  # those 100 adds: a segment more, so that the merge always has work
    row["segments_merged_under_search"] = len(store.info()["segments"])

    merged: dict[str, float] = {}
    done = threading.Event()

    def merge() -> None:
        t0 = time.perf_counter()
        try:
            merged["segments"] = store.merge(everything=True)
        finally:
            merged["s"] = time.perf_counter() - t0
            done.set()

    busy: list[float] = []
    add_busy: list[float] = []
    worker = threading.Thread(target=merge)
    worker.start()
    j = 100
    while not done.is_set():
        t0 = time.perf_counter()
        store.search(q[len(busy) % len(q)][None], K)
        busy.append(1e3 * (time.perf_counter() - t0))
        if j < len(during_x):
            t0 = time.perf_counter()
            store.add([key_of(base + j)], during_x[j : j + 1])
            add_busy.append(1e3 * (time.perf_counter() - t0))
            j += 1
    worker.join()
    row |= {
        "search_p50_idle_ms": pct(idle, 50),
        "search_p99_idle_ms": pct(idle, 99),
        "search_p50_during_merge_ms": pct(busy, 50),
        "search_p99_during_merge_ms": pct(busy, 99),
        "searches_during_merge": len(busy),
        "merge_during_searches_s": merged["s"],
        "merged_segments": merged.get("segments", 0),
        "add_p99_idle_ms": pct(add_idle, 99),
        "add_p99_during_merge_ms": pct(add_busy, 99),
    }
    row["p99_merge_vs_idle"] = row["search_p99_during_merge_ms"] / row["search_p99_idle_ms"]
    print(
        f"  search p50/p99 idle {row['search_p50_idle_ms']:.2f}/{row['search_p99_idle_ms']:.2f}"
        f" ms, during merge {row['search_p50_during_merge_ms']:.2f}/"
        f"{row['search_p99_during_merge_ms']:.2f} ms ({len(busy)} searches, merge of "
        f"{row['merged_segments']} segments {merged['s']:.1f} s); add p99 idle "
        f"{row['add_p99_idle_ms']:.2f}, during merge {row['add_p99_during_merge_ms']:.2f} ms; "
        f"recall@10 {row['recall@10']:.3f}",
        flush=True,
    )
    store.save()  # the adds made during the merge: a second segment to rewrite
    rewrite: dict[str, float] = {}

    def full_rewrite() -> None:  # in a thread of its own, as the merge above: every core
        t0 = time.perf_counter()
        rewrite["segments"] = store.merge(everything=True)
        rewrite["s"] = time.perf_counter() - t0

    worker = threading.Thread(target=full_rewrite)
    worker.start()
    worker.join()
    rewritten = rewrite["segments"]
    row["full_rewrite_s"] = rewrite["s"]
    row["save_vs_full_rewrite"] = row["save_after_1000_adds_s"] / row["full_rewrite_s"]
    store.close()
    print(
        f"  full rewrite (merge of {rewritten} segments, idle) {row['full_rewrite_s']:.1f} s; "
        f"save after {ADD_BATCH:,} adds = {100 * row['save_vs_full_rewrite']:.2f}% of it",
        flush=True,
    )
    return row


# -- Milvus Lite -------------------------------------------------------------------------

MILVUS_CHILD = (
    MEM
    + """
import json, os, sys, time
args = json.loads(sys.argv[1])
t0 = time.perf_counter()
import numpy as np
from pymilvus import DataType, MilvusClient
import milvus_lite
from milvus_lite.server_manager import server_manager_instance
out = {"import_s": time.perf_counter() - t0, "milvus_lite": milvus_lite.__version__}
name, db, phase = "vectors", args["db"], args["phase"]
t0 = time.perf_counter()
client = MilvusClient(db)
out["connect_s"] = time.perf_counter() - t0
if phase == "insert":
    x = np.load(args["vectors"], mmap_mode="r")
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=x.shape[1])
    client.create_collection(name, schema=schema)
    t0 = time.perf_counter()
    for s in range(0, len(x), args["batch"]):
        chunk = np.asarray(x[s : s + args["batch"]])
        client.insert(name, [{"id": s + i, "vector": v} for i, v in enumerate(chunk)])
    out["insert_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    client.flush(name)
    out["flush_s"] = time.perf_counter() - t0
elif phase == "index":
    def drop():  # the previous factory's index (list_indexes may not show it in a new process)
        for step in (client.release_collection, client.drop_index):
            try:
                step(name, *(["vector"] if step == client.drop_index else []))
            except Exception:
                pass
    drop()
    def build(kind, params):
        ip = client.prepare_index_params()
        ip.add_index(field_name="vector", index_type=kind, metric_type="IP", params=params)
        # pymilvus sends build parameters as one key each, milvus-lite reads only a JSON
        # "params" key (without this, nlist silently falls back to its default of 128)
        ip[0]._configs["params"] = params
        t0 = time.perf_counter()
        try:
            client.create_index(name, ip)
        except Exception as exc:  # pymilvus retries a create_index the server applied
            if "already exists" not in str(exc):
                raise
        client.load_collection(name)
        return time.perf_counter() - t0
    out["index_type"] = kind = args["index_type"]
    if args.get("fallback"):  # try the index on a small side collection first
        schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("id", DataType.INT64, is_primary=True)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=args["dim"])
        client.create_collection("probe", schema=schema)
        sample = np.load(args["vectors"], mmap_mode="r")[:20000]
        client.insert("probe", [{"id": i, "vector": v} for i, v in enumerate(sample)])
        client.flush("probe")
        ip = client.prepare_index_params()
        ip.add_index(field_name="vector", index_type=kind, metric_type="IP", params=args["params"])
        ip[0]._configs["params"] = args["params"]
        try:
            client.create_index("probe", ip)
            client.load_collection("probe")
        except Exception as exc:
            out["refused"] = str(exc).splitlines()[0][:300]
            out["index_type"] = kind = args["fallback"]
            args["params"] = args["fallback_params"]
        client.drop_collection("probe")
    out["index_s"] = build(kind, args["params"])
elif phase == "serve":
    before = mem()[0]
    t0 = time.perf_counter()
    client.load_collection(name)
    out["load_s"] = time.perf_counter() - t0
    out["open_s"] = out["connect_s"] + out["load_s"]
    out["rss_after_open_mb"] = mem()[0]
    out["rss_before_open_mb"] = before
    q = np.load(args["queries"])
    sp = {"metric_type": "IP", "params": args["search"]}
    for i in range(min(5, len(q))):
        client.search(name, data=[q[i].tolist()], limit=10, search_params=sp)
    lat, ids = [], []
    for i in range(len(q)):
        t0 = time.perf_counter()
        res = client.search(name, data=[q[i].tolist()], limit=10, search_params=sp)
        lat.append(1e3 * (time.perf_counter() - t0))
        ids.append([int(h["id"]) for h in res[0]])
    out["latencies_ms"], out["ids"] = lat, ids
    out["index"] = client.describe_index(name, "vector")
t0 = time.perf_counter()
server_manager_instance.release_all()  # drains background compaction and index builds
out["close_s"] = time.perf_counter() - t0
out["rss_peak_mb"] = mem()[1]
print(json.dumps(out, default=str))
"""
)


def milvus_usable(python: str | None) -> tuple[bool, str]:
    if not python:
        return False, "no --milvus-python given"
    try:
        done = subprocess.run(
            [python, "-c", "import pymilvus, milvus_lite; print(milvus_lite.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{python} cannot run: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"{python} cannot import pymilvus and milvus_lite ({last})"
    return True, f"milvus-lite {done.stdout.strip()}"


def milvus_child(python: str, threads: int = 0, **args: Any) -> dict[str, Any]:
    env = None
    if threads:  # FAISS (OpenMP) and numpy (BLAS) threads of every thread in the child
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
    return run_json([python, "-c", MILVUS_CHILD, json.dumps(args)], env)[0]


def bench_milvus_insert(python: str, work: Path, n: int) -> dict[str, Any]:
    db = work / "milvus.db"
    print(f"\n== Milvus Lite: inserting {n:,} vectors into {db.name}", flush=True)
    out = milvus_child(python, phase="insert", db=str(db), vectors=str(work / "vectors.npy"),
                       batch=MILVUS_BATCH)  # fmt: skip
    out["insert_rate"] = n / out["insert_s"]
    out["durable_s"] = out["insert_s"] + out["flush_s"] + out["close_s"]
    print(
        f"  insert {out['insert_s']:.1f} s ({out['insert_rate']:,.0f} vectors/s), flush "
        f"{out['flush_s']:.1f} s, close (background work drained) {out['close_s']:.1f} s",
        flush=True,
    )
    return out


def bench_milvus_factory(
    python: str, work: Path, name: str, spec: tuple[str, str, dict[str, int]], nprobe: int,
    data: dict[str, Any], inserted: dict[str, Any], n: int, threads: int,
) -> Row:  # fmt: skip
    db = work / "milvus.db"
    _, kind, params = spec
    extra: dict[str, Any] = {}
    if kind == "IVF_PQ":  # the closest compressed IVF index where IVF_PQ is not available
        extra = {"fallback": "IVF_SQ8", "fallback_params": {"nlist": params["nlist"]}}
    built = milvus_child(python, phase="index", db=str(db), index_type=kind, params=params,
                         vectors=str(work / "vectors.npy"), dim=D, **extra)  # fmt: skip
    search = {"nprobe": nprobe} if kind != "FLAT" else {}
    queries = str(work / "queries.npy")
    served = milvus_child(
        python, threads, phase="serve", db=str(db), queries=queries, search=search
    )
    lat = served["latencies_ms"]
    row = {
        "index_type": built["index_type"],
        "index_refused": built.get("refused"),
        "insert_s": inserted["insert_s"],
        "insert_rate": inserted["insert_rate"],
        "flush_s": inserted["flush_s"],
        "index_s": built["index_s"],
        "ingest_s": inserted["insert_s"] + inserted["flush_s"] + built["index_s"],
        "open_s": served["open_s"],
        "rss_after_open_mb": served["rss_after_open_mb"],
        "search_p50_ms": pct(lat, 50),
        "search_p99_ms": pct(lat, 99),
        "recall@10": recall(served["ids"], data["exact_db"]),
        "disk_bytes_per_vector": dir_bytes(db) / n,
        "search_params": search,
        "build_params": served["index"].get("params", {}),
        "milvus_lite": served["milvus_lite"],
    }
    note = f" (IVF_PQ refused: {row['index_refused']})" if row["index_refused"] else ""
    print(
        f"  Milvus {row['index_type']} {row['build_params']}{note}: index + load "
        f"{row['index_s']:.1f} s; reopen "
        f"{row['open_s']:.2f} s, RSS {row['rss_after_open_mb']:.0f} MB; search p50/p99 "
        f"{row['search_p50_ms']:.2f}/{row['search_p99_ms']:.2f} ms; recall@10 "
        f"{row['recall@10']:.3f}; {row['disk_bytes_per_vector']:.0f} B/vector",
        flush=True,
    )
    return row


# -- report ------------------------------------------------------------------------------


def f1(v: float) -> str:
    return f"{v:,.1f}"


def f2(v: float) -> str:
    return f"{v:,.2f}"


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def markdown(results: dict[str, Row], n: int) -> str:
    vit = {k: v["vitrieval"] for k, v in results.items()}
    parts = [
        f"N = {n:,}, d = {D}",
        "",
        table(
            [
                "factory",
                "build s",
                "build peak RSS MB",
                "disk B/vector",
                "open s",
                "RSS after open MB",
                "`info` s",
                "save after 1,000 adds s",
                "full rewrite s",
                "save / rewrite",
                "open+add(1)+save s",
                "`add` 1 image s",
                "add(1) / build",
            ],
            [
                [
                    r["factory"],
                    f1(r["build_s"]),
                    f"{r['build_peak_rss_mb']:,}",
                    f"{r['disk_bytes_per_vector']:,.0f}",
                    f"{r['open_s']:.3f}",
                    f"{r['rss_after_open_mb']:,.0f}",
                    f2(r["info_s"]),
                    f2(r["save_after_1000_adds_s"]),
                    f1(r["full_rewrite_s"]),
                    f"{100 * r['save_vs_full_rewrite']:.2f}%",
                    f2(r["add_one_s"]),
                    f2(r["cli_add_one_s"]),
                    f"{100 * r['add_one_vs_build']:.2f}% ({100 * r['cli_add_one_vs_build']:.2f}%)",
                ]
                for r in vit.values()
            ],
        ),
        "",
        table(
            [
                "factory",
                "search p50 idle ms",
                "p99 idle ms",
                "p50 during merge ms",
                "p99 during merge ms",
                "p99 merge / idle",
                "merge s (searches)",
                "add p99 idle ms",
                "add p99 during merge ms",
                "recall@10",
            ],
            [
                [
                    r["factory"],
                    f2(r["search_p50_idle_ms"]),
                    f2(r["search_p99_idle_ms"]),
                    f2(r["search_p50_during_merge_ms"]),
                    f2(r["search_p99_during_merge_ms"]),
                    f"{r['p99_merge_vs_idle']:.2f}x",
                    f"{r['merge_during_searches_s']:.1f} ({r['searches_during_merge']:,})",
                    f2(r["add_p99_idle_ms"]),
                    f2(r["add_p99_during_merge_ms"]),
                    f"{r['recall@10']:.3f}",
                ]
                for r in vit.values()
            ],
        ),
    ]
    compared = {k: v for k, v in results.items() if v.get("milvus", {}).get("index_type")}
    if compared:
        # (label, vitrieval field, Milvus field, higher is better)
        metrics = [
            ("ingest s (vitrieval: build; Milvus: insert + flush + index + load)",
             "build_s", "ingest_s", False),
            ("ingest vectors/s", None, None, True),
            ("open s (fresh process)", "open_s", "open_s", False),
            ("RSS after open MB", "rss_after_open_mb", "rss_after_open_mb", False),
            ("search p50 ms", "search_p50_idle_ms", "search_p50_ms", False),
            ("search p99 ms", "search_p99_idle_ms", "search_p99_ms", False),
            ("recall@10", "recall@10", "recall@10", True),
            ("disk B/vector", "disk_bytes_per_vector", "disk_bytes_per_vector", False),
        ]  # fmt: skip
        rows = []
        for key, res in compared.items():
            v, m = res["vitrieval"], res["milvus"]
            label = f"{key} ({m['index_type']})"
            for name, vf, mf, higher in metrics:
                a, b = (n / v["build_s"], n / m["ingest_s"]) if vf is None else (v[vf], m[mf])
                ratio = a / b if b else float("nan")
                ahead = ratio > 1 if higher else ratio < 1
                fmt = f"{{:,.{3 if name == 'recall@10' else 2}f}}"
                verdict = "yes" if ahead else ("equal" if ratio == 1 else "**no**")
                rows.append([label, name, fmt.format(a), fmt.format(b), f"{ratio:.2f}", verdict])
        parts += [
            "",
            table(
                [
                    "factory (Milvus index)",
                    "metric",
                    "vitrieval",
                    "Milvus Lite",
                    "vitrieval / Milvus",
                    "vitrieval ahead",
                ],
                rows,
            ),
        ]
    return "\n".join(parts) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--factories", default=None, help="flat,ivf-flat,ivf-pq (default: all "
                    "three up to 1M vectors, ivf-pq above; also ivf-sq8)")  # fmt: skip
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--workdir", default=None, help="default: a new temporary folder")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--milvus-python", default=None, help="a Python with pymilvus + milvus-lite")
    ap.add_argument("--search-threads", type=int, default=1, help="FAISS/BLAS threads of the "
                    "timed searches and adds, in both engines (0: the libraries' default); merges "
                    "and builds use every core")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.search_threads:
        faiss.omp_set_num_threads(args.search_threads)  # this thread only: not the merge's
    specs = factories(args.n)
    default = "flat,ivf-flat,ivf-pq" if args.n <= 1_000_000 else "ivf-pq"
    chosen = chosen_factories(args.factories or default, specs, ap.error)
    use_milvus, why = milvus_usable(args.milvus_python)
    info = describe(
        search_threads=args.search_threads or "default",
        faiss=faiss.__version__,
        numpy=np.__version__,
        **{
            "index/store": "modified"
            if git("status", "--porcelain", "index/store")
            else "as committed"
        },
        milvus=why if use_milvus else f"skipped: {why}",
    )
    print("  ".join(f"{k}: {v}" for k, v in info.items()), flush=True)
    if not use_milvus:
        print(f"Milvus Lite comparison skipped: {why}", flush=True)
    work = work_directory(args.workdir, "store_scale", ap.error)
    started = time.perf_counter()
    results: dict[str, Row] = {}
    try:
        data = write_data(work, args.n, args.queries, use_milvus)
        np.save(work / "one.npy", np.load(work / "adds.npy")[ADD_BATCH:])
        inserted = None
        milvus_rows: dict[str, Row] = {}  # by (index type, build params): built once
        for name in chosen:
            row = bench_vitrieval(name, specs[name][0], data, work, args.n)
            results[name] = {"vitrieval": row}
            if use_milvus:
                if inserted is None:
                    try:
                        inserted = bench_milvus_insert(args.milvus_python, work, args.n)
                    except RuntimeError as exc:
                        print(f"Milvus Lite comparison skipped: {str(exc)[-800:]}", flush=True)
                        info["milvus"] = f"skipped: insert failed ({str(exc)[-300:]})"
                        use_milvus = False
                        continue
                nprobe = row["search_params"].get("nprobe", 0)
                same = json.dumps([specs[name][1], specs[name][2], nprobe])
                if same not in milvus_rows:
                    try:
                        milvus_rows[same] = bench_milvus_factory(
                            args.milvus_python, work, name, specs[name], nprobe, data, inserted,
                            args.n, args.search_threads,
                        )  # fmt: skip
                    except RuntimeError as exc:  # Milvus failed: keep vitrieval's figures
                        print(f"  Milvus {specs[name][1]} failed: {str(exc)[-800:]}", flush=True)
                        milvus_rows[same] = {"error": str(exc)[-2000:]}
                    built = milvus_rows[same]
                    if built.get("index_type", specs[name][1]) != specs[name][1]:  # substitute
                        substitute = [built["index_type"], built["build_params"], nprobe]
                        milvus_rows[json.dumps(substitute)] = built
                else:
                    print(f"  Milvus {specs[name][1]}: measured above", flush=True)
                results[name]["milvus"] = milvus_rows[same]
            if not args.keep:
                shutil.rmtree(work / f"index-{name}", ignore_errors=True)
        info["data_s"] = round(data["data_s"], 1)
    finally:
        info["load_after"] = load_average()
        info["total_s"] = round(time.perf_counter() - started, 1)
        if args.keep:
            print(f"\nkept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        report(results, info, args)  # what was measured, also when a step failed


def report(results: dict[str, Row], info: dict[str, Any], args: argparse.Namespace) -> None:
    md = markdown(results, args.n)
    print("\n" + "  ".join(f"{k}: {v}" for k, v in info.items()) + "\n\n" + md)
    if args.json:
        payload = {"n": args.n, "d": D, "k": K, "queries": args.queries, "machine": info,
                   "factories": {k: v["vitrieval"] | {"milvus": v.get("milvus")}
                                 for k, v in results.items()}}  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str))


if __name__ == "__main__":
    main()
