"""Many collections on one server (`vitrieval-serve --data DIR`, docs/collections.md):

- RSS of the server with every collection closed, all open, and closed again when idle;
- the first search of a closed collection (it opens: the store, and the model when no
  open collection uses it) against a search of an open one;
- search p50 on an open collection against a server of that one index
  (`--model --index`): the ratio is what addressing by collection costs;
- snapshot time (POST .../snapshots) against the collection's size.

The collections hold random unit vectors (128-d, Flat) embedded by one tiny exported
model, so every collection shares one model; the searches send vectors (the model is
not what is measured). Printed as a table, written to OUT/collections.json.

    .venv/bin/python bench/many_collections.py --out runs/collections
    .venv/bin/python bench/many_collections.py --collections 10 --items 1000   # a quick look
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe, work_directory
from serve_http import HOST, Server

from vitrieval.index.collections import MODELS_DIR, DataFolder
from vitrieval.index.store import IndexStore

KEY = "bench-admin-key-0123456789"
DIM = 128


def export_model(path: Path) -> Path:
    """An untrained tiny ViT + GGeM (32 px, 128-d): embeds, which is all this needs."""
    import torch

    from vitrieval.training.config import FitConfig
    from vitrieval.training.export import export_model as export
    from vitrieval.training.export import model_metadata
    from vitrieval.training.model import build_model

    torch.manual_seed(0)
    model = build_model("tiny", "ggem")
    export(model, model_metadata(model, FitConfig(out="unused")), path)
    return path


def fill(folder: DataFolder, name: str, items: int, rng: np.random.Generator) -> None:
    """Collection `name`: `items` random unit vectors, saved (a sealed segment)."""
    folder.create(name, "tiny.onnx")
    vectors = rng.standard_normal((items, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    with IndexStore.open(folder.path(name)) as store:
        store.add([f"{name}/{i}" for i in range(items)], vectors)
        store.save()


def call(url: str, method: str = "GET", body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"X-API-Key": KEY, "content-type": "application/json"}
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def search_ms(url: str, rng: np.random.Generator) -> float:
    """One search on a new connection (as a client meeting a closed collection would)."""
    vector = rng.standard_normal(DIM).tolist()
    started = time.perf_counter()
    call(f"{url}/search", "POST", {"vector": vector, "k": 10})
    return (time.perf_counter() - started) * 1000


def paired_search_ms(
    servers: list[tuple[Server, str]], searches: int, rng: np.random.Generator
) -> list[list[float]]:
    """Milliseconds per search on each (server, path) over one kept-alive connection
    each, the servers taking turns query by query (so that drift in the machine's load
    falls on both alike)."""
    links = [http.client.HTTPConnection(HOST, server.port, timeout=60) for server, _ in servers]
    headers = {"X-API-Key": KEY, "content-type": "application/json"}
    times: list[list[float]] = [[] for _ in servers]
    try:
        for _ in range(searches):
            body = json.dumps({"vector": rng.standard_normal(DIM).tolist(), "k": 10})
            for link, (_, path), taken in zip(links, servers, times, strict=True):
                started = time.perf_counter()
                link.request("POST", path, body, headers)
                response = link.getresponse()
                response.read()
                assert response.status == 200, response.status
                taken.append((time.perf_counter() - started) * 1000)
    finally:
        for link in links:
            link.close()
    return times


def rss_mib(server: Server) -> float:
    with open(f"/proc/{server.process.pid}/status") as status:
        line = next(x for x in status if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def p50(values: list[float]) -> float:
    return statistics.median(values)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    (work / "data").mkdir()
    folder = DataFolder(work / "data")
    export_model(folder.root / MODELS_DIR / "tiny.onnx")
    started = time.perf_counter()
    names = [f"c{n:03d}" for n in range(args.collections)]
    for name in names:
        fill(folder, name, args.items, rng)
    built_s = time.perf_counter() - started
    env = {"VITRIEVAL_API_KEY": KEY}
    idle = ["--collection-idle-s", str(args.idle_s)]
    data = Server("off", None, None, work, idle, env, served=["--data", str(folder.root)])
    # a writable server of a copy of the first collection, as the data server is writable
    alone = shutil.copytree(folder.path(names[0]), work / "alone")
    served = ["--model", str(folder.root / MODELS_DIR / "tiny.onnx"), "--index", str(alone)]
    single = Server("off", None, None, work, [], env, served=served)
    try:
        data.wait_ready(120)
        single.wait_ready(120)
        result: dict[str, Any] = {"build_s": round(built_s, 1)}
        result["rss_closed_mib"] = rss_mib(data)
        first = [search_ms(f"{data.url}/v1/collections/{n}", rng) for n in names]
        result["first_search_ms_p50"] = p50(first)
        result["rss_all_open_mib"] = rss_mib(data)
        pairs = [(data, f"/v1/collections/{names[0]}/search"), (single, "/v1/search")]
        in_collection, alone = paired_search_ms(pairs, args.searches, rng)
        result["open_search_ms_p50"] = p50(in_collection)
        result["single_search_ms_p50"] = p50(alone)
        result["ratio"] = result["open_search_ms_p50"] / result["single_search_ms_p50"]
        time.sleep(args.idle_s * 2 + 1)  # every collection closes
        listed = call(f"{data.url}/v1/collections")["collections"]
        result["open_after_idle"] = sum(c["open"] for c in listed)
        result["rss_closed_again_mib"] = rss_mib(data)
        result["snapshots"] = snapshot_times(data, folder, args.snapshot_sizes, rng)
    finally:
        data.stop()
        single.stop()
    return result


def snapshot_times(
    server: Server, folder: DataFolder, sizes: list[int], rng: np.random.Generator
) -> list[dict[str, Any]]:
    times = []
    for size in sizes:
        name = f"snap-{size}"
        fill(folder, name, size, rng)
        started = time.perf_counter()
        taken = call(f"{server.url}/v1/collections/{name}/snapshots", "POST")
        seconds = time.perf_counter() - started
        times.append({"items": size, "bytes": taken["bytes"], "seconds": round(seconds, 3)})
    return times


def report(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    r = result
    lines = [
        f"{args.collections} collections x {args.items:,} items ({DIM}-d Flat, one model)",
        f"RSS, all closed at start      {r['rss_closed_mib']:8.0f} MiB",
        f"RSS, all open                 {r['rss_all_open_mib']:8.0f} MiB",
        f"RSS, closed again when idle   {r['rss_closed_again_mib']:8.0f} MiB "
        f"({r['open_after_idle']} left open)",
        f"first search, closed (p50)    {r['first_search_ms_p50']:8.2f} ms  (a new connection)",
        f"search, open (p50)            {r['open_search_ms_p50']:8.2f} ms  (kept-alive, paired)",
        f"search, one-index server      {r['single_search_ms_p50']:8.2f} ms  "
        f"ratio {r['ratio']:.2f}",
        "snapshot: items, bytes, seconds",
    ]
    for s in r["snapshots"]:
        lines.append(f"  {s['items']:>9,} {s['bytes']:>14,} {s['seconds']:8.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/collections")
    parser.add_argument("--workdir", help="an empty folder for the data (default: a temporary one)")
    parser.add_argument("--collections", type=int, default=100)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--searches", type=int, default=300)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--snapshot-sizes", type=int, nargs="+", default=[10_000, 100_000, 300_000])
    args = parser.parse_args()
    work = work_directory(args.workdir, "vitrieval-collections", parser.error)
    machine = describe()
    try:
        result = measure(args, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = report(result, args)
    print("\n".join(lines))
    payload = {"machine": machine, "options": vars(args), "result": result}
    (out / "collections.json").write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
