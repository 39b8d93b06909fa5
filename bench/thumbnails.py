"""The web page's thumbnails of large WebP and PNG files: Pillow against libvips.

The page asks for one thumbnail per hit (`GET /v1/items/{key}/thumbnail`, 160 px); the
server makes each in a worker thread with `vitrieval.service.routers.items.thumbnail_jpeg`
(`open_image` with a 160 px draft, then Pillow's thumbnail and a JPEG encode). This
times what a user waits for: a page of `--page` thumbnails requested at once, as a
browser does (6 connections per host), made by 6 threads (asyncio's default pool on a
2-core host), from files of `--sizes` megapixels made as bench/decoders.py makes them
(scikit-image's astronaut and coffee, upscaled, camera-like noise). Each decoder runs
in its own process (`VITRIEVAL_DECODER` is read once), alternating, `--repeats` times;
the figure is the median page time and the slowest single thumbnail.

Run:  cd bench && nice -n 10 ../.venv/bin/python thumbnails.py [--sizes 4 12 18] [--page 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from decoders import write_files  # bench/decoders.py
from machine import cpu_model, load_average

DECODERS = ("pillow", "vips")
THUMBNAIL_SIZE = 160  # the route's default
BROWSER_CONNECTIONS = 6


def page_times(files: list[Path], page: int) -> dict[str, float]:
    """One page of `page` thumbnails from `files` (cycled): total and slowest, ms."""
    from vitrieval.index.runtime.images import DEFAULT_MAX_PIXELS
    from vitrieval.service.routers.items import thumbnail_jpeg

    chosen = [files[i % len(files)] for i in range(page)]

    def one(path: Path) -> float:
        start = time.perf_counter()
        assert thumbnail_jpeg(path, THUMBNAIL_SIZE, DEFAULT_MAX_PIXELS) is not None
        return time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(BROWSER_CONNECTIONS) as pool:
        singles = list(pool.map(one, chosen))
    return {"page_ms": 1e3 * (time.perf_counter() - start), "slowest_ms": 1e3 * max(singles)}


def child(args: argparse.Namespace) -> None:
    files = [Path(p) for p in args.files]
    page_times(files[:1], 1)  # imports and libvips start-up outside the timing
    print(json.dumps(page_times(files, args.page)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[4.0, 12.0, 18.0])
    parser.add_argument("--page", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--files", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(f"# {cpu_model()}, {os.cpu_count()} cores, load {load_average()}")
    with tempfile.TemporaryDirectory() as tmp:
        made = write_files(Path(tmp), args.sizes)
        print(
            "| format | MP | Pillow page ms | vips page ms | speed-up "
            "| Pillow slowest ms | vips slowest ms |"
        )
        print("|---|---|---|---|---|---|---|")
        for fmt in ("WEBP", "PNG"):
            for mp in args.sizes:
                files = [str(p) for f, m, p in made if f == fmt and m == mp]
                runs: dict[str, list[dict[str, float]]] = {d: [] for d in DECODERS}
                for _ in range(args.repeats):
                    for decoder in DECODERS:  # alternating: the load drifts
                        env = {**os.environ, "VITRIEVAL_DECODER": decoder}
                        out = subprocess.run(
                            [
                                sys.executable,
                                __file__,
                                "--child",
                                "--page",
                                str(args.page),
                                "--files",
                                *files,
                            ],
                            env=env,
                            capture_output=True,
                            text=True,
                            check=True,
                        ).stdout
                        runs[decoder].append(json.loads(out.strip().splitlines()[-1]))
                page = {d: statistics.median(r["page_ms"] for r in runs[d]) for d in DECODERS}
                slow = {d: statistics.median(r["slowest_ms"] for r in runs[d]) for d in DECODERS}
                print(
                    f"| {fmt} | {mp:g} | {page['pillow']:.0f} | {page['vips']:.0f} | "
                    f"{page['pillow'] / page['vips']:.2f}x | {slow['pillow']:.0f} | "
                    f"{slow['vips']:.0f} |",
                    flush=True,
                )
    print(f"# load after: {load_average()}")


if __name__ == "__main__":
    main()
