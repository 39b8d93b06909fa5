"""Embedding throughput on a Ray cluster: `embed --ray` with 1 and 2 actors against the
single-process `embed`, on the same JPEG files, side by side as ratios in one run.

The files are photo-like JPEGs (crops of the photos scikit-image ships, resized to
--size px). The model is the `small` preset exported by `vitrieval-train export
--init-only` (64 px input), and with `--vits N` also timm's vit_small_patch16_224 (224
px, random weights: as fast as trained ones) on the first N files. Every
configuration writes the same embeddings folder (`vitrieval.index.pipeline.embed_folder`'s parts,
--part-size
images each) from scratch, checked against the single-process one (max abs
difference of the vectors).

- `single process`: `vitrieval.index.pipeline.embed_folder.embed_to_folder` with the Embedder's
defaults (ONNX
  Runtime on every core, min(4, cores) decoding threads);
- `ray, N actor(s)`: `vitrieval.distributed.embed.embed_on_ray` on a local Ray cluster started
  once beforehand (its start-up is reported on its own line), N actors of cores // N
  threads each. The time includes starting the actors (each loads the model), which
  every `embed --ray` pays once.

Each configuration's start-up is timed too, as the same run on one image per actor in
parts of one (the model loaded, the actors started, a part written and committed by
each); "after start-up" is the
images over the time left when it is taken away: the throughput a long job sees.

Rounds are interleaved (--rounds, median reported). The machine's load average is
printed before and after: on a shared machine the ratios move with it.

Run:  .venv/bin/python bench/ray_embed.py [--images 384] [--vits 64] [--doc /tmp/doc.md]
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from machine import cpu_model  # bench/machine.py (scripts run from bench/)
from serve_load import write_photos  # photo crops, shared with the load benchmark

from vitrieval.distributed.embed import embed_on_ray
from vitrieval.index.pipeline.embed_folder import embed_to_folder
from vitrieval.index.pipeline.sources import read_sources
from vitrieval.index.runtime.embedder import Embedder

TRAIN = Path(sys.executable).parent / "vitrieval-train"


def export(out: Path, *options: str) -> Path:
    """`vitrieval-train export --init-only OPTIONS --out OUT` (the documented command)."""
    command = [str(TRAIN), "export", "--init-only", *options, "--seed", "0", "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return out


def vectors(folder: Path) -> np.ndarray:
    table = pa.concat_tables(pq.read_table(p) for p in sorted(folder.glob("*.parquet")))
    return np.array(table.column("embedding").to_pylist(), dtype=np.float32)


def run_single(items, model: Path, out: Path, part_size: int) -> float:
    report = embed_to_folder(
        items, out, Embedder(model, device="cpu"), part_size=part_size, progress=False
    )
    return report.seconds


def run_ray(items, model: Path, out: Path, part_size: int, actors: int) -> float:
    threads = max(1, (os.cpu_count() or 1) // actors)
    report = embed_on_ray(
        items,
        out,
        model,
        address="local",
        device="cpu",
        part_size=part_size,
        actors=actors,
        threads=threads,
        progress=False,
    )
    return report.seconds


def bench_model(name: str, model: Path, items, work: Path, part_size: int, rounds: int) -> list:
    """(configuration, median seconds, median start-up seconds, max abs difference from
    single) for one model. A configuration's start-up is the same run on one image."""
    configs = {
        "single process": lambda items, out, size=part_size: run_single(items, model, out, size),
        "ray, 1 actor": lambda items, out, size=part_size: run_ray(items, model, out, size, 1),
        "ray, 2 actors": lambda items, out, size=part_size: run_ray(items, model, out, size, 2),
    }
    times: dict[str, list[float]] = {config: [] for config in configs}
    startups: dict[str, list[float]] = {config: [] for config in configs}
    diffs: dict[str, float] = dict.fromkeys(configs, 0.0)
    for round_ in range(rounds):
        reference = work / f"{name}-single-{round_}"
        for config, run in configs.items():
            out = reference if config == "single process" else work / f"{name}-{round_}"
            times[config].append(run(items, out))
            # one image per actor, in parts of one: every actor starts
            first = items[: 2 if config.endswith("2 actors") else 1]
            startups[config].append(run(first, work / f"{name}-one", 1))
            shutil.rmtree(work / f"{name}-one")
            diffs[config] = max(
                diffs[config], float(np.abs(vectors(out) - vectors(reference)).max())
            )
            if out != reference:
                shutil.rmtree(out)
        shutil.rmtree(reference)
    return [
        (
            config,
            statistics.median(times[config]),
            statistics.median(startups[config]),
            diffs[config],
        )
        for config in configs
    ]


def table(name: str, count: int, rows: list) -> list[str]:
    single, single_startup = rows[0][1], rows[0][2]
    lines = [
        f"| {name}, {count} images | seconds | images/s | vs single process | start-up "
        "| images/s after start-up | vs single process | max abs diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config, seconds, startup, diff in rows:
        steady = count / max(seconds - startup, 1e-9)
        single_steady = count / max(single - single_startup, 1e-9)
        lines.append(
            f"| {config} | {seconds:.2f} | {count / seconds:.0f} | {single / seconds:.2f}x "
            f"| {startup:.2f} s | {steady:.0f} | {steady / single_steady:.2f}x | {diff:.1e} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=384, help="JPEG files for the small preset")
    parser.add_argument("--vits", type=int, default=0, help="also vit_small_patch16_224 on N")
    parser.add_argument("--size", type=int, default=400, help="side of the JPEG files, px")
    parser.add_argument("--parts", type=int, default=8, help="parts the list is cut into")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--doc", type=Path, help="write the output and a markdown table here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import ray

    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    load = os.getloadavg()
    say(f"machine: {cpu_model()}, {os.cpu_count()} cores; load average {load[0]:.2f} before")
    with tempfile.TemporaryDirectory(prefix="ray_embed_") as tmp:
        work = Path(tmp)
        write_photos(work / "images", max(args.images, args.vits), args.size)
        all_items = read_sources(work / "images")
        models = [("small preset", export(work / "small.onnx", "--preset", "small"), args.images)]
        if args.vits:
            vits = export(
                work / "vits.onnx", "--backbone", "vit_small_patch16_224", "--pool", "ggem"
            )
            models.append(("vit_small_patch16_224", vits, args.vits))
        started = time.perf_counter()
        ray.init(
            address="local",
            include_dashboard=False,
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
        say(
            f"local Ray cluster started in {time.perf_counter() - started:.1f}s (not counted below)"
        )
        try:
            tables = []
            for name, model, count in models:
                part_size = max(1, -(-count // args.parts))
                with redirect_stdout(io.StringIO()):
                    rows = bench_model(name, model, all_items[:count], work, part_size, args.rounds)
                tables.append(table(name, count, rows))
                say()
                say(f"{name}: {count} JPEG files of {args.size} px, parts of {part_size}")
                for line in tables[-1]:
                    say(line)
        finally:
            ray.shutdown()
    load = os.getloadavg()
    say()
    say(f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} after (1, 5, 15 min)")
    if args.doc:
        args.doc.write_text("```\n" + "\n".join(lines) + "\n```\n")


if __name__ == "__main__":
    main()
