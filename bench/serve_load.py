"""The search service under load: throughput and latency with dynamic batching off and on.

Two real `vitrieval-serve` processes (`python -m service.cli ... --read-only`), one with
`--no-batching` and one with `--batching`, are started on loopback (127.0.0.1, free
ports) and waited for on /readyz. Then, per client count (default 1, 4, 16, 64) and per
server, N closed-loop clients each send POST /v1/search (a multipart JPEG upload, k = 10)
one after another for `--warmup` + `--duration` seconds. The two servers are interleaved
cell by cell (off then on, the order swapped every round), so load from other work on a
shared machine falls on both alike. Reported per cell:

- req/s: requests answered 200 that completed inside the measured window / its length;
- p50 / p99 latency (ms) of those requests, seen by the client (send to last byte);
- errors: every non-200 answer, connection failure or timeout (> 30 s), warm-up included;
- mean batch: images per model call on the server, from the deltas of
  vitrieval_embed_batch_size_sum / _count scraped from GET /metrics around the window;
- server CPU ms per request (user + system time of the server process over the window /
  requests): what a request costs, the figure that least depends on how much of a shared
  machine the server got;
- cores busy: the server, the client and everything else on the machine (/proc/stat),
  since client and server share the machine's cores.
Before the servers start, the bare model's CPU ms per image is timed at batch 1 to 32 (one
ONNX Runtime thread, best of 3): the ceiling on what batching can save in the model.
With --rounds R every cell runs R times; the table gives the mean req/s and the
percentiles of all R rounds' latencies together (each round is printed as it ends).

The clients run in this one process on asyncio. By default each keeps one HTTP/1.1
keep-alive connection and sends a request it encoded once beforehand (`--client raw`,
a few lines of asyncio streams): about 0.02 cores at 250 req/s. `--client httpx` uses
httpx.AsyncClient instead; on 2 cores it takes 0.25 cores at 16 clients and 0.6 at 64,
where it becomes the bottleneck (the server then sees batches of 1.4, not 32). Nothing is
pinned to cores: with the server needing both cores for ONNX Runtime and the client
needing 2% of one, a split would only take a core from the server.

Without --model/--index a throwaway model and index are built first: an untrained
`small` preset + GGeM (64 px input, width 192, depth 6, as in embedder_throughput.py)
exported to ONNX, and an index of `--gallery` held-out digits. Queries are JPEG crops
of the photos scikit-image ships, re-encoded once.

Bounded: at most 256 clients, loopback only, a per-request timeout, and `--time-limit`
seconds for the whole run (cells that would not fit are skipped and reported).

Run:  .venv/bin/python bench/serve_load.py [--model M.onnx --index DIR]
      [--clients 1,4,16,64] [--duration 10] [--warmup 2] [--rounds 1] [--json out.json]
      [--server-env VITRIEVAL_INTRA_OP_THREADS=1] [--server-arg=--max-batch-wait-ms=5]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import re
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from machine import cpu_model  # bench/machine.py (scripts run from bench/)
from serve_http import (  # bench/serve_http.py
    REQUEST_TIMEOUT_S,
    RawConnection,
    Server,
    machine_busy_seconds,
    metric_delta,
    scrape_metrics,
    search_request,
)

MAX_CLIENTS = 256
MODES = ("off", "on")


# -- the model, the index and the queries ------------------------------------------------


def build_throwaway(folder: Path, gallery: int) -> tuple[Path, Path]:
    """An untrained `small` + GGeM model exported to ONNX and a Flat index of `gallery`
    held-out digits (64 px PNG files) embedded with it."""
    import torch

    from vitrieval.index.evaluation.datasets import csv_list, load_dataset
    from vitrieval.index.pipeline.build_index import build_index
    from vitrieval.index.pipeline.sources import write_image_folder
    from vitrieval.index.runtime.embedder import Embedder
    from vitrieval.training.config import FitConfig
    from vitrieval.training.export import export_model, model_metadata
    from vitrieval.training.model import build_model

    torch.manual_seed(0)
    model = build_model("small", "ggem").eval()
    model_path = folder / "small.onnx"
    export_model(model, model_metadata(model, FitConfig(out="x", backbone="small")), model_path)
    split = load_dataset("digits", image_size=64)
    listing = write_image_folder(split.test[:gallery], folder / "images")
    build_index(csv_list(listing), folder / "index", Embedder(model_path), progress=False)
    return model_path, folder / "index"


def query_jpegs(count: int, size: int, seed: int = 0) -> list[bytes]:
    """`count` JPEG files (size x size, quality 90) cut from scikit-image's photos."""
    from PIL import Image
    from skimage import data as skdata

    rng = np.random.default_rng(seed)
    photos = [skdata.astronaut(), skdata.coffee(), skdata.chelsea(), skdata.rocket()]
    out = []
    for i in range(count):
        photo = photos[i % len(photos)]
        h, w = photo.shape[:2]
        side = int(rng.integers(min(h, w) // 2, min(h, w)))
        top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        crop = Image.fromarray(photo[top : top + side, left : left + side]).resize((size, size))
        buffer = io.BytesIO()
        crop.save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def write_photos(folder: Path, count: int, size: int, seed: int = 0) -> list[Path]:
    """`query_jpegs(count, size, seed)` written to `folder` as 00000.jpg, 00001.jpg, ..."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, jpeg in enumerate(query_jpegs(count, size, seed)):
        path = folder / f"{i:05d}.jpg"
        path.write_bytes(jpeg)
        paths.append(path)
    return paths


def model_cpu_ms(
    model: Path, batches: tuple[int, ...], rounds: int = 3, seconds: float = 0.25
) -> dict[int, float]:
    """CPU ms per image of the bare model per batch size, on one ONNX Runtime thread and
    timed in thread CPU time (the best of `rounds` interleaved rounds), so other work on a
    shared machine barely moves it: the most batching can save on the model's side."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    tensor = session.get_inputs()[0]
    shape = [int(d) for d in tensor.shape[1:]]
    rng = np.random.default_rng(0)
    inputs = {b: rng.standard_normal((b, *shape)).astype(np.float32) for b in batches}
    best = dict.fromkeys(batches, float("inf"))
    for _ in range(rounds):
        for batch, x in inputs.items():
            session.run(None, {tensor.name: x})
            images, start = 0, time.thread_time()
            while (used := time.thread_time() - start) < seconds or images == 0:
                session.run(None, {tensor.name: x})
                images += batch
            best[batch] = min(best[batch], 1000 * used / images)
    return best


@dataclass
class Snapshot:
    at: float
    client_cpu: float
    server_cpu: float
    machine_busy: float
    metrics: dict[str, float] = field(default_factory=dict)


async def snapshot(server: Server) -> Snapshot:
    taken = Snapshot(time.perf_counter(), time.process_time(), server.cpu_seconds(), 0.0)
    taken.machine_busy = machine_busy_seconds()
    taken.metrics = await scrape_metrics(server.port)
    return taken


async def run_cell(
    server: Server,
    clients: int,
    warmup: float,
    duration: float,
    jpegs: list[bytes],
    k: int,
    client_kind: str,
) -> dict[str, Any]:
    """`clients` closed-loop clients against `server` for warmup + duration seconds."""
    payloads = [search_request(server.port, jpeg, k) for jpeg in jpegs]
    started = time.perf_counter()
    window_start, stop_at = started + warmup, started + warmup + duration
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    checked: list[str] = []
    httpx_client = None
    failures: tuple[type[BaseException], ...] = (OSError, EOFError, ValueError, TimeoutError)
    if client_kind == "httpx":
        import httpx

        httpx_client = httpx.AsyncClient(
            base_url=server.url,
            timeout=REQUEST_TIMEOUT_S,
            limits=httpx.Limits(max_connections=clients, max_keepalive_connections=clients),
        )
        failures += (httpx.HTTPError,)

    async def one_request(conn: RawConnection, i: int) -> tuple[int, bytes]:
        if httpx_client is None:
            return await conn.request(payloads[i])
        response = await httpx_client.post(
            "/v1/search",
            files={"image": ("query.jpg", jpegs[i], "image/jpeg")},
            data={"k": str(k)},
        )
        return response.status_code, response.content

    async def client(number: int) -> None:
        conn = RawConnection(server.port)
        i = number
        try:
            while time.perf_counter() < stop_at:
                sent = time.perf_counter()
                try:
                    status, body = await asyncio.wait_for(
                        one_request(conn, i % len(payloads)), REQUEST_TIMEOUT_S
                    )
                except failures as exc:
                    errors[type(exc).__name__] += 1
                    await conn.close()
                    await asyncio.sleep(0.05)  # a dead server: do not spin on it
                    continue
                done = time.perf_counter()
                i += 1
                if status != 200:
                    errors[f"HTTP {status}"] += 1
                    continue
                if not checked:  # the first answer of the cell: is it a real result?
                    hits = json.loads(body)["hits"]
                    checked.append(f"{len(hits)} hits")
                if window_start <= done <= stop_at:
                    latencies.append(done - sent)
        finally:
            await conn.close()

    async def observe() -> tuple[Snapshot, Snapshot]:
        await asyncio.sleep(max(0.0, window_start - time.perf_counter()))
        first = await snapshot(server)
        await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
        return first, await snapshot(server)

    try:
        observer = asyncio.create_task(observe())
        await asyncio.gather(*(client(n) for n in range(clients)))
        first, last = await observer
    finally:
        if httpx_client is not None:
            await httpx_client.aclose()

    span = last.at - first.at
    lat_ms = np.array(latencies) * 1000

    def per_request(name: str) -> float:
        count = metric_delta(first.metrics, last.metrics, name.replace("_sum", "_count"))
        return metric_delta(first.metrics, last.metrics, name) / count if count else float("nan")

    server_cores = (last.server_cpu - first.server_cpu) / span
    client_cores = (last.client_cpu - first.client_cpu) / span
    machine_cores = (last.machine_busy - first.machine_busy) / span
    return {
        "mode": server.mode,
        "clients": clients,
        "requests": len(latencies),
        "rps": len(latencies) / duration,
        "p50_ms": float(np.percentile(lat_ms, 50)) if len(lat_ms) else float("nan"),
        "p99_ms": float(np.percentile(lat_ms, 99)) if len(lat_ms) else float("nan"),
        "mean_ms": float(lat_ms.mean()) if len(lat_ms) else float("nan"),
        "max_ms": float(lat_ms.max()) if len(lat_ms) else float("nan"),
        "errors": dict(errors),
        "first_answer": checked[0] if checked else None,
        "mean_batch": per_request("vitrieval_embed_batch_size_sum"),
        "server_ms": {
            "request": 1000
            * per_request('vitrieval_request_duration_seconds_sum{route="/v1/search"}'),
            **{
                stage: 1000
                * per_request(f'vitrieval_stage_duration_seconds_sum{{stage="{stage}"}}')
                for stage in ("decode", "embed", "search")
            },
        },
        "server_cpu_ms_per_request": (
            1000 * (last.server_cpu - first.server_cpu) / len(latencies)
            if latencies
            else float("nan")
        ),
        "server_cpu_s": last.server_cpu - first.server_cpu,
        "batches": metric_delta(first.metrics, last.metrics, "vitrieval_embed_batch_size_count"),
        "batched_images": metric_delta(
            first.metrics, last.metrics, "vitrieval_embed_batch_size_sum"
        ),
        "latencies_ms": lat_ms,  # dropped from the JSON
        "cpu_cores": {
            "server": server_cores,
            "client": client_cores,
            "others": machine_cores - server_cores - client_cores,
        },
    }


# -- the run -----------------------------------------------------------------------------


def summarise(cells: list[dict[str, Any]], clients: list[int]) -> list[dict[str, Any]]:
    """Per client count and mode, over all rounds: mean req/s, p50/p99 of all latencies
    together, images per model call and server CPU per request from the summed deltas,
    mean stage times and cores busy."""
    rows = []
    for n in clients:
        row: dict[str, Any] = {"clients": n}
        for mode in MODES:
            runs = [c for c in cells if c["clients"] == n and c["mode"] == mode]
            if not runs:
                row[mode] = None
                continue
            lat_ms = np.concatenate([c["latencies_ms"] for c in runs])
            requests = sum(c["requests"] for c in runs)
            batches = sum(c["batches"] for c in runs)
            nan = float("nan")
            row[mode] = {
                "rounds": len(runs),
                "rps": statistics.fmean(c["rps"] for c in runs),
                "rps_rounds": [round(c["rps"], 1) for c in runs],
                "p50_ms": float(np.percentile(lat_ms, 50)) if len(lat_ms) else nan,
                "p99_ms": float(np.percentile(lat_ms, 99)) if len(lat_ms) else nan,
                "mean_batch": sum(c["batched_images"] for c in runs) / batches if batches else nan,
                "errors": sum(sum(c["errors"].values()) for c in runs),
                "server_cpu_ms_per_request": (
                    1000 * sum(c["server_cpu_s"] for c in runs) / requests if requests else nan
                ),
                "cpu_cores": {
                    key: statistics.fmean(c["cpu_cores"][key] for c in runs)
                    for key in runs[0]["cpu_cores"]
                },
                "server_ms": {
                    key: statistics.fmean(c["server_ms"][key] for c in runs)
                    for key in runs[0]["server_ms"]
                },
            }
        if row["off"] and row["on"]:
            row["ratio"] = row["on"]["rps"] / row["off"]["rps"] if row["off"]["rps"] else None
        rows.append(row)
    return rows


def print_tables(rows: list[dict[str, Any]]) -> None:
    def fmt(value: float | None, digits: int = 1) -> str:
        return "-" if value is None or value != value else f"{value:,.{digits}f}"

    print(
        "| clients | off req/s | off p50 ms | off p99 ms | on req/s | on p50 ms | on p99 ms "
        "| on/off | mean batch (on) | errors off/on |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        off, on = row["off"] or {}, row["on"] or {}
        ratio = row.get("ratio")
        print(
            f"| {row['clients']} | {fmt(off.get('rps'))} | {fmt(off.get('p50_ms'))} "
            f"| {fmt(off.get('p99_ms'))} | {fmt(on.get('rps'))} | {fmt(on.get('p50_ms'))} "
            f"| {fmt(on.get('p99_ms'))} | {'-' if ratio is None else f'**{ratio:.2f}x**'} "
            f"| {fmt(on.get('mean_batch'), 2)} | {off.get('errors', '-')}/{on.get('errors', '-')} |"
        )
    print()
    print(
        "Where the time goes: server-side wall ms per request by stage (from /metrics), "
        "server CPU ms per request, and cores busy (server, client, everything else):"
    )
    print(
        "| clients | mode | request ms | decode ms | embed ms (incl. queue) | search ms "
        "| server CPU ms/req | server cores | client cores | others cores |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        for mode in MODES:
            cell = row[mode]
            if not cell:
                continue
            ms, cpu = cell["server_ms"], cell["cpu_cores"]
            print(
                f"| {row['clients']} | {mode} | {fmt(ms['request'])} | {fmt(ms['decode'], 2)} "
                f"| {fmt(ms['embed'])} | {fmt(ms['search'], 2)} "
                f"| {fmt(cell['server_cpu_ms_per_request'], 2)} | {fmt(cpu['server'], 2)} "
                f"| {fmt(cpu['client'], 2)} | {fmt(cpu['others'], 2)} |"
            )


async def run_all(
    servers: dict[str, Server], args: argparse.Namespace, jpegs: list[bytes], deadline: float
) -> tuple[list[dict[str, Any]], list[str]]:
    cells, skipped = [], []
    cell_s = args.warmup + args.duration + 5  # + drain and scrapes
    for round_ in range(args.rounds):
        for n in args.clients:
            order = MODES if (round_ + n) % 2 == 0 else MODES[::-1]
            for mode in order:
                if time.monotonic() + cell_s > deadline:
                    skipped.append(f"round {round_ + 1}, {n} clients, batching {mode}")
                    continue
                cell = await run_cell(
                    servers[mode], n, args.warmup, args.duration, jpegs, args.k, args.client
                )
                cell["round"] = round_ + 1
                cells.append(cell)
                print(
                    f"  round {round_ + 1}, {n:>3} clients, batching {mode:>3}: "
                    f"{cell['rps']:7.1f} req/s, p50 {cell['p50_ms']:7.1f} ms, "
                    f"p99 {cell['p99_ms']:7.1f} ms, batch {cell['mean_batch']:5.2f}, "
                    f"server CPU {cell['server_cpu_ms_per_request']:5.2f} ms/req, "
                    f"errors {sum(cell['errors'].values())}, load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    return cells, skipped


def parse_clients(text: str) -> list[int]:
    counts = [int(v) for v in re.split(r"[,\s]+", text.strip()) if v]
    if not counts or min(counts) < 1 or max(counts) > MAX_CLIENTS:
        raise argparse.ArgumentTypeError(f"client counts must be 1..{MAX_CLIENTS}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="exported model (default: a throwaway one)")
    parser.add_argument("--index", type=Path, help="index built with --model")
    parser.add_argument(
        "--clients",
        type=parse_clients,
        default=[1, 4, 16, 64],
        help=f"comma-separated client counts, each 1..{MAX_CLIENTS} (default 1,4,16,64)",
    )
    parser.add_argument("--duration", type=float, default=10.0, help="measured s per cell")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured s per cell")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every cell (mean req/s)")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw")
    parser.add_argument("--queries", type=int, default=32, help="distinct query JPEGs")
    parser.add_argument("--image-size", type=int, default=256, help="side of the query JPEGs")
    parser.add_argument("--gallery", type=int, default=300, help="digits in a throwaway index")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra vitrieval-serve flag for both servers, e.g. --server-arg=--max-batch-wait-ms=5",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment for both servers, e.g. VITRIEVAL_INTRA_OP_THREADS=1",
    )
    parser.add_argument("--time-limit", type=float, default=900.0, help="whole run, seconds")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all numbers here")
    args = parser.parse_args()
    if (args.model is None) != (args.index is None):
        parser.error("give both --model and --index, or neither (a throwaway pair is built)")
    if args.duration <= 0 or args.warmup < 0 or not 1 <= args.rounds <= 10:
        parser.error("--duration must be > 0, --warmup >= 0, --rounds 1..10")
    if not 0 < args.time_limit <= 3600:
        parser.error("--time-limit must be in (0, 3600] seconds")
    if any("=" not in item for item in args.server_env):
        parser.error("--server-env takes NAME=VALUE")
    deadline = time.monotonic() + args.time_limit
    env = dict(item.split("=", 1) for item in args.server_env)
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="serve_load_") as tmp:
        folder = Path(tmp)
        if args.model is None:
            started = time.perf_counter()
            args.model, args.index = build_throwaway(folder, args.gallery)
            print(
                f"throwaway small model + {args.gallery}-digit index: "
                f"{time.perf_counter() - started:.1f} s"
            )
        jpegs = query_jpegs(args.queries, args.image_size)
        model_ms = model_cpu_ms(args.model, (1, 2, 4, 8, 16, 32))
        servers: dict[str, Server] = {}
        try:
            for mode in MODES:
                servers[mode] = Server(mode, args.model, args.index, folder, args.server_arg, env)
            for server in servers.values():
                server.wait_ready(max(5.0, min(120.0, deadline - time.monotonic())))
            info = servers["on"].info()
            print(
                f"serving {info['index']['count']} items ({info['index']['factory']}) with "
                f"{info['model']['backbone']} on {info['model']['provider']}; "
                f"server settings (on): {info['service']}"
            )
            cells, skipped = asyncio.run(run_all(servers, args, jpegs, deadline))
        finally:
            for server in servers.values():
                server.stop()

    rows = summarise(cells, args.clients)
    load_after = os.getloadavg()
    import onnxruntime

    machine = (
        f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"onnxruntime {onnxruntime.__version__}"
    )
    print(f"\nmachine: {machine}")
    print(
        f"load average (1/5/15 min) before {'/'.join(f'{v:.2f}' for v in load_before)}, "
        f"after {'/'.join(f'{v:.2f}' for v in load_after)}"
    )
    print(
        f"model {info['model']['backbone']} ({info['model']['input_size']}, "
        f"{info['model']['embedding_dim']}-d), {info['index']['count']} items; "
        f"{args.client} client, one asyncio process, closed loop, POST /v1/search with a "
        f"{args.image_size}x{args.image_size} JPEG, k={args.k}; {args.warmup:g} s warm-up + "
        f"{args.duration:g} s measured per cell, {args.rounds} round(s), off/on interleaved"
        + (f"; server flags {args.server_arg}" if args.server_arg else "")
        + (f"; server env {env}" if env else "")
    )
    saving = 1 - min(model_ms.values()) / model_ms[1]
    print(
        "model alone, CPU ms per image by batch (1 ONNX Runtime thread, thread CPU time): "
        + ", ".join(f"{b}: {ms:.2f}" for b, ms in model_ms.items())
        + f"; the best batch saves {saving:.0%} of batch 1"
    )
    print_tables(rows)
    ratio16 = next((r.get("ratio") for r in rows if r["clients"] == 16), None)
    if ratio16 is not None:
        print(f"\nbatching on/off at 16 clients: {ratio16:.2f}x (goal >= 1.5x)")
    if skipped:
        print(f"skipped (time limit {args.time_limit:g} s): {'; '.join(skipped)}")
    if args.json:
        result = {
            "machine": machine,
            "load_before": load_before,
            "load_after": load_after,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "server_info": info,
            "model_cpu_ms_per_image": model_ms,
            "cells": [{k: v for k, v in c.items() if k != "latencies_ms"} for c in cells],
            "summary": rows,
            "skipped": skipped,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
