"""ViT-S/16 at 224 px served: thread and process layout, and the service against the
offline Embedder on the same JPEG files.

The model is the CPU default bench/real_shape.py led to: `vitrieval-train export
--init-only` (vit_small_patch16_224 + GGeM, random weights: speed does not depend on
them), then `vitrieval-index optimize` (fused attention) and `vitrieval-index quantize`
(INT8 dynamic). `--variant plain` serves the exported graph instead. The catalogue is
real photos (real_shape.write_catalogue: crops of the scikit-image photos, 500-2000 px
JPEG), indexed (Flat) with the same model.

1. Layout, on tensors decoded beforehand (the model alone): one ONNX Runtime session
   with T intra-op threads against T sessions of one thread each driven by T Python
   threads (replicas), at batch 1 and batch `--batch`; T = the machine's cores.
2. The offline Embedder (`Embedder.embed_sources` on the files, its defaults): the
   reference rate.
3. The service: real `vitrieval-serve --read-only` processes on loopback, closed-loop
   clients (1/4/16) each posting the catalogue's files one after another to
   POST /v1/search (k 10), per server layout:
   - `batching`: dynamic batching, one session on every core's thread (the default on
     a GPU);
   - `replicas`: batching off, T model calls at once, one intra-op thread each
     (`VITRIEVAL_INTRA_OP_THREADS=1`, `VITRIEVAL_UNBATCHED_CONCURRENCY=T`: the default
     on CPUs, chosen from this measurement);
   - `serial`: batching off, one call at a time on T threads (the load benchmark's
     baseline; bench/serve_http.py's Server sets it for a server that is not batching).
   Cells are interleaved across servers (the order rotated every round) so other load
   on a shared machine falls on all alike; images/s is answered requests / window.

Printed side by side, as ratios against the offline Embedder; the load averages and the
CPU other processes took are printed with them.

Run:  .venv/bin/python bench/real_shape_service.py [--images 64] [--clients 1,4,16]
      [--duration 20] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from machine import cpu_model  # bench/machine.py (scripts run from bench/)
from real_shape import write_catalogue
from serve_http import Server, machine_busy_seconds
from serve_load import run_cell

from vitrieval.index.pipeline.build_index import build_index
from vitrieval.index.pipeline.sources import walk_images
from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.runtime.images import open_image
from vitrieval.index.runtime.model_metadata import read_model_metadata
from vitrieval.index.runtime.optimize import optimize_model
from vitrieval.index.runtime.preprocess import Preprocessor
from vitrieval.index.runtime.quantize import quantize_model
from vitrieval.training.cli import main as train_cli

SERVER_LAYOUTS: dict[str, tuple[list[str], Callable[[int], dict[str, str]]]] = {
    # name -> (vitrieval-serve flags, environment for T cores)
    "batching": (["--batching"], lambda cores: {}),
    "replicas": (
        ["--no-batching"],
        lambda cores: {
            "VITRIEVAL_INTRA_OP_THREADS": "1",
            "VITRIEVAL_UNBATCHED_CONCURRENCY": str(cores),
        },
    ),
    "serial": (["--no-batching"], lambda cores: {}),
}


def build_model(tmp: Path, variant: str, check_paths: list[Path]) -> Path:
    plain = tmp / "model.onnx"
    export = ["export", "--init-only", "--backbone", "vit_small_patch16_224", "--pool", "ggem"]
    if train_cli([*export, "--out", str(plain)]) != 0:
        sys.exit("export failed")
    if variant == "plain":
        return plain
    fused = tmp / "model.opt.onnx"
    print(optimize_model(plain, fused).summary())
    if variant == "fused":
        return fused
    from PIL import Image

    int8 = tmp / "model.opt.int8.onnx"
    quantize_model(fused, int8, check_images=[Image.open(p).convert("RGB") for p in check_paths])
    return int8


def ort_session(model: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


def layout_cases(model: Path, decoded: np.ndarray, cores: int, batch: int) -> dict[str, Callable]:
    """name -> a function embedding every decoded image once."""
    one = ort_session(model, cores)
    replicas = [ort_session(model, 1) for _ in range(cores)]
    name = one.get_inputs()[0].name

    def sequential(session: ort.InferenceSession, rows: np.ndarray, size: int) -> None:
        for start in range(0, len(rows), size):
            session.run(None, {name: rows[start : start + size]})

    def spread(size: int) -> None:
        shares = np.array_split(decoded, cores)
        threads = [
            threading.Thread(target=sequential, args=(s, rows, size))
            for s, rows in zip(replicas, shares, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return {
        f"1 session x {cores} threads, batch 1": lambda: sequential(one, decoded, 1),
        f"1 session x {cores} threads, batch {batch}": lambda: sequential(one, decoded, batch),
        f"{cores} sessions x 1 thread, batch 1": lambda: spread(1),
        f"{cores} sessions x 1 thread, batch {batch}": lambda: spread(batch),
    }


def timed(cases: dict[str, Callable], rounds: int, count: int) -> dict[str, dict[str, float]]:
    """Median images/s of each case over interleaved rounds, with the CPU others took."""
    for run in cases.values():  # warm-up: thread pools, allocators
        run()
    times: dict[str, list[float]] = {n: [] for n in cases}
    others: dict[str, list[float]] = {n: [] for n in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            busy0, own0, t0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
            run()
            wall = time.perf_counter() - t0
            other = machine_busy_seconds() - busy0 - (time.process_time() - own0)
            times[name].append(wall)
            others[name].append(max(0.0, other) / wall)
    return {
        n: {"images_per_s": count / statistics.median(t), "other_cores": statistics.mean(o)}
        for n, t in times.items()
        for o in [others[n]]
    }


async def serve_cells(
    servers: dict[str, Server], clients: list[int], files: list[bytes], args: argparse.Namespace
) -> list[dict[str, Any]]:
    cells = []
    order = list(servers)
    for round_ in range(args.rounds):
        for count in clients:
            for name in order[round_ % len(order) :] + order[: round_ % len(order)]:
                cell = await run_cell(
                    servers[name], count, args.warmup, args.duration, files, 10, "raw"
                )
                cell |= {"layout": name, "round": round_}
                cells.append(cell)
                print(
                    f"  {name:9s} {count:3d} clients: {cell['rps']:6.2f} img/s, p50 "
                    f"{cell['p50_ms']:.0f} ms, p99 {cell['p99_ms']:.0f} ms, mean batch "
                    f"{cell['mean_batch']:.1f}, errors {cell['errors'] or 0}",
                    flush=True,
                )
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("plain", "fused", "fused-int8"), default="fused-int8")
    parser.add_argument("--images", type=int, default=64, help="JPEG files in the catalogue")
    parser.add_argument("--batch", type=int, default=8, help="the batched layout cases' batch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--duration", type=float, default=20.0, help="measured s per cell")
    parser.add_argument("--warmup", type=float, default=4.0, help="unmeasured s per cell")
    parser.add_argument("--layouts", default=",".join(SERVER_LAYOUTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    layouts = [name.strip() for name in args.layouts.split(",")]
    if unknown := set(layouts) - set(SERVER_LAYOUTS):
        parser.error(f"unknown layouts {sorted(unknown)}; choose from {', '.join(SERVER_LAYOUTS)}")
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="real_shape_service_") as name:
        tmp = Path(name)
        paths = write_catalogue(tmp / "photos", args.images, 500, 2000)
        model = build_model(tmp, args.variant, paths[:16])
        meta = read_model_metadata(model)
        build_index(walk_images(tmp / "photos"), tmp / "index", Embedder(model), progress=False)
        decoded = Preprocessor(meta).batch([open_image(p) for p in paths])
        files = [p.read_bytes() for p in paths]

        embedder = Embedder(model)
        offline = timed(
            {"offline Embedder (files)": lambda: embedder.embed_sources(paths)},
            args.rounds,
            len(paths),
        )
        layout = timed(layout_cases(model, decoded, cores, args.batch), args.rounds, len(paths))

        servers: dict[str, Server] = {}
        try:
            for layout_name in layouts:
                flags, env = SERVER_LAYOUTS[layout_name]
                servers[layout_name] = _server(layout_name, model, tmp, flags, env(cores))
            for server in servers.values():
                server.wait_ready(300)
            cells = asyncio.run(serve_cells(servers, clients, files, args))
        finally:
            for server in servers.values():
                server.stop()
    load_after = os.getloadavg()
    report(args, cores, offline, layout, cells, layouts, clients, load_before, load_after)


def _server(name: str, model: Path, tmp: Path, flags: list[str], env: dict[str, str]) -> Server:
    server = Server("on" if "--batching" in flags else "off", model, tmp / "index", tmp, [], env)
    server.mode = name
    return server


def report(
    args: argparse.Namespace,
    cores: int,
    offline: dict[str, dict[str, float]],
    layout: dict[str, dict[str, float]],
    cells: list[dict[str, Any]],
    layouts: list[str],
    clients: list[int],
    load_before: tuple[float, ...],
    load_after: tuple[float, ...],
) -> None:
    base = next(iter(offline.values()))["images_per_s"]
    print(
        f"\nmachine: {cpu_model()}, {cores} cores, Python {platform.python_version()}, "
        f"onnxruntime {ort.__version__}; load average before "
        f"{'/'.join(f'{v:.2f}' for v in load_before)}, after "
        f"{'/'.join(f'{v:.2f}' for v in load_after)}"
    )
    print(
        f"model vit_small_patch16_224 + GGeM, {args.variant}; {args.images} JPEG files "
        f"(500-2000 px); {args.rounds} round(s)\n"
    )
    print("| case | images/s | / offline Embedder | other processes' cores |")
    print("|---|---:|---:|---:|")
    for name, row in {**offline, **layout}.items():
        print(
            f"| {name} | {row['images_per_s']:.2f} | {row['images_per_s'] / base:.2f} | "
            f"{row['other_cores']:.2f} |"
        )
    print("\n| service layout | clients | images/s | / offline Embedder | p50 ms | p99 ms "
          "| mean batch | errors |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    summary = []
    for name in layouts:
        for count in clients:
            mine = [c for c in cells if c["layout"] == name and c["clients"] == count]
            rate = statistics.mean(c["rps"] for c in mine)
            lat = np.concatenate([c["latencies_ms"] for c in mine]) if mine else np.zeros(0)
            errors = sum(sum(c["errors"].values()) for c in mine)
            batch = statistics.mean(c["mean_batch"] for c in mine)
            p50, p99 = (float(np.percentile(lat, q)) if len(lat) else np.nan for q in (50, 99))
            summary.append({"layout": name, "clients": count, "images_per_s": rate,
                            "vs_offline": rate / base, "p50_ms": p50, "p99_ms": p99,
                            "mean_batch": batch, "errors": errors})  # fmt: skip
            print(
                f"| {name} | {count} | {rate:.2f} | {rate / base:.2f} | {p50:.0f} | {p99:.0f} "
                f"| {batch:.1f} | {errors} |"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": cpu_model(),
                    "cores": cores,
                    "load_before": load_before,
                    "load_after": load_after,
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "offline": offline,
                    "layout": layout,
                    "service": summary,
                    "cells": [{k: v for k, v in c.items() if k != "latencies_ms"} for c in cells],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
