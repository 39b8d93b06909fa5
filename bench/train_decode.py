"""Training input pipeline with and without the decode cache (training/decode_cache.py).

Writes N photo-like files (the photos scikit-image ships, `skimage.data`, upscaled to
2-12 MP, alternately PNG and JPEG) to a temporary folder, then times the data side of
`vitrieval-train fit` alone, no model: the DataLoader over `ImageDataset` with fit's
training transform at the preset's input size, `--workers` processes, batch 16.

- "no cache": an epoch decoding every file in full, as every epoch did before;
- "check, no cache": `drop_unreadable` without a cache (the pass that starts a run);
- "fill (memory)" / "fill (disk)": the same pass filling the cache;
- "epoch, memory" / "epoch, disk": epochs from the cached copies (median of `--epochs`);
- "refill (disk)": a second run's pass over a filled disk cache (nothing decoded).

    python bench/train_decode.py [--images 48] [--preset tiny] [--epochs 5] [--workers N]

The no-cache epochs run first: a worker forked after this process decoded with
libvips would have to decode with it (see index/runtime/vips_decode.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from machine import cpu_model
from PIL import Image
from skimage import data as skdata

from vitrieval.index.evaluation.datasets import Item
from vitrieval.training.config import FitConfig
from vitrieval.training.data import ImageDataset, build_transforms, drop_unreadable, epoch_loader
from vitrieval.training.decode_cache import DecodeCache, working_side
from vitrieval.training.model import build_model

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
BATCH = 16


def write_photos(folder: Path, count: int, seed: int) -> list[Item]:
    """`count` files of 2-12 MP (megapixels drawn uniformly), PNG and JPEG in turn."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    items = []
    for i in range(count):
        source = np.asarray(getattr(skdata, PHOTOS[i % len(PHOTOS)])())
        if source.ndim == 2:
            source = np.stack([source] * 3, axis=-1)
        height, width = source.shape[:2]
        scale = np.sqrt(rng.uniform(2e6, 12e6) / (width * height))
        image = Image.fromarray(source[..., :3]).resize(
            (round(width * scale), round(height * scale)), Image.Resampling.BICUBIC
        )
        path = folder / f"{i:03d}.{'png' if i % 2 else 'jpg'}"
        if path.suffix == ".png":
            image.save(path, compress_level=1)
        else:
            image.save(path, quality=90)
        items.append(Item(path.stem, f"c{i % 4}", path))
    return items


def epoch_rate(items: list[Item], transform, cfg: FitConfig, epoch: int) -> float:
    """Images/s of one epoch of the training DataLoader (every batch drawn, no model)."""
    dataset = ImageDataset(items, {f"c{i}": i for i in range(4)}, transform)
    started = time.perf_counter()
    seen = sum(len(labels) for _, labels in epoch_loader(dataset, cfg, epoch))
    return seen / (time.perf_counter() - started)


def pass_rate(items: list[Item], cache: DecodeCache | None) -> tuple[float, list[Item]]:
    started = time.perf_counter()
    good, bad = drop_unreadable(items, "images", cache)
    assert not bad, bad
    return len(items) / (time.perf_counter() - started), good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--epochs", type=int, default=5, help="cached epochs timed (median)")
    parser.add_argument("--workers", type=int, default=None, help="default: fit's")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = build_model(args.preset, "ggem")
    data_config = model.data_config()
    cfg = FitConfig(out="-", dataset="folder", batch_size=BATCH, workers=args.workers).resolved()
    train_tf, _ = build_transforms(data_config, cfg.crop_scale, cfg.hflip, cfg.auto_augment)
    side = working_side(max(data_config["input_size"][1:]), data_config["crop_pct"], cfg.crop_scale)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="train_decode_") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        items = write_photos(folder / "photos", args.images, args.seed)
        megapixels = [Image.open(item.path).size for item in items]
        mp = [w * h / 1e6 for w, h in megapixels]
        print(
            f"{len(items)} files ({sum(p.path.suffix == '.png' for p in items)} PNG), "
            f"{min(mp):.1f}-{max(mp):.1f} MP (median {statistics.median(mp):.1f}), "
            f"written in {time.perf_counter() - t0:.0f} s; preset {args.preset} "
            f"({data_config['input_size'][-1]} px), working side {side} px, "
            f"workers {cfg.workers}, batch {BATCH}"
        )
        rows: list[tuple[str, float]] = []
        rows.append(("epoch, no cache", epoch_rate(items, train_tf, cfg, 1)))
        rows.append(("check, no cache", pass_rate(items, None)[0]))
        rate, in_memory = pass_rate(items, DecodeCache("memory", side))
        rows.append(("fill (memory)", rate))
        rates = [epoch_rate(in_memory, train_tf, cfg, e) for e in range(1, args.epochs + 1)]
        rows.append((f"epoch, memory (median of {args.epochs})", statistics.median(rates)))
        disk = DecodeCache("disk", side, folder / "cache")
        rate, on_disk = pass_rate(items, disk)
        rows.append(("fill (disk)", rate))
        rates = [epoch_rate(on_disk, train_tf, cfg, e) for e in range(1, args.epochs + 1)]
        rows.append((f"epoch, disk (median of {args.epochs})", statistics.median(rates)))
        again = DecodeCache("disk", side, folder / "cache")
        rows.append(("refill (disk, next run)", pass_rate(items, again)[0]))
        assert again.stats.decoded == 0
        cache_mib = disk.stats.disk_bytes / 2**20
    base = rows[0][1]
    load_after = os.getloadavg()
    print("\n| phase | img/s | vs epoch without cache |\n|---|---:|---:|")
    for name, value in rows:
        print(f"| {name} | {value:,.1f} | {value / base:,.2f}x |")
    print(
        f"\ncached copies: {cache_mib:.1f} MiB for {len(items)} images "
        f"(the files: {sum(mp):.0f} MP)"
    )
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"decoder {os.environ.get('VITRIEVAL_DECODER', 'auto')}; load average "
        f"{'/'.join(f'{v:.2f}' for v in load_before)} before, "
        f"{'/'.join(f'{v:.2f}' for v in load_after)} after; commit {_commit()}"
    )


def _commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "training", "index"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head}{' (training/ or index/ modified)' if dirty else ''}"


if __name__ == "__main__":
    main()
