"""Self-supervised pretraining against random initialisation, on copy detection.

The table of docs/experiments.md ("DenseCL++ on copy detection"). The catalogue is
the photographs scikit-image and scikit-learn ship, cut into tiles (`make_catalogue`):
with 20 photos a gallery would be too easy, while tiles of one photo share its
colours and textures, so finding a copy's own tile takes more than the photo's
colour statistics. For every seed and method the encoder is pretrained on the
catalogue without labels (the use case: an unlabelled catalogue that needs a
near-duplicate search), exported to ONNX, and scored with

    vitrieval-index bench --model MODEL.onnx --copy-detection CATALOGUE --out REPORT

whose edited copies (crop, rotation, resize, colour, JPEG) are drawn with the
benchmark's own fixed seed, the same for every model. Methods:

- `random`: the encoder at its initialisation for that seed (the weights every
  pretraining of the seed starts from), no training;
- `simclr`, `densecl`, `densecl++` (random dense negatives) and `densecl++ guided`,
  all with the same budget (epochs, batch size, learning rate, augmentations).

Runs whose REPORT/report.json exists are reused, so an interrupted experiment
continues where it stopped. Prints (and writes OUT/table.md, OUT/summary.json) the
mean and sample standard deviation over seeds of R@1 and mAP.

    .venv/bin/python bench/densecl_experiment.py --out runs/densecl --seeds 0 1 2 \\
        --epochs 100
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from machine import cpu_model  # bench/machine.py (scripts run from bench/)
from PIL import Image

# (name, extra pretrain flags); "random" is not trained
METHODS: dict[str, list[str]] = {
    "random": [],
    "simclr": ["--method", "simclr"],
    "densecl": ["--method", "densecl"],
    "densecl++ random": ["--method", "densecl++", "--negatives", "random"],
    "densecl++ guided": ["--method", "densecl++", "--negatives", "guided"],
}

# Real photographs only: the synthetic images (checkerboard, colour wheel, logos,
# phantoms, binary blobs) and the second stereo view are left out, and `cat` is
# `chelsea` again.
SKIMAGE_PHOTOS = (
    "astronaut",
    "brick",
    "camera",
    "cell",
    "chelsea",
    "clock",
    "coffee",
    "coins",
    "grass",
    "gravel",
    "hubble_deep_field",
    "immunohistochemistry",
    "moon",
    "page",
    "retina",
    "rocket",
    "text",
)


def shipped_photos() -> dict[str, np.ndarray]:
    """name -> RGB uint8 array of every photograph scikit-image and scikit-learn ship."""
    import skimage.data
    from sklearn.datasets import load_sample_images

    photos = {}
    for name in SKIMAGE_PHOTOS:
        image = np.asarray(getattr(skimage.data, name)())
        if image.ndim == 2:
            image = np.stack([image] * 3, axis=-1)
        photos[name] = image[..., :3].astype(np.uint8)
    sample = load_sample_images()
    for filename, image in zip(sample.filenames, sample.images, strict=True):
        photos[Path(filename).stem] = image
    return photos


def make_catalogue(folder: Path, tile: int = 128, short_side: int = 256) -> int:
    """Write every shipped photo, its short side scaled to `short_side`, as the
    non-overlapping `tile` x `tile` tiles of its centred grid (PNG); returns the count."""
    folder.mkdir(parents=True, exist_ok=True)
    count = 0
    for name, array in shipped_photos().items():
        image = Image.fromarray(array)
        scale = short_side / min(image.size)
        image = image.resize(
            (round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC
        )
        cols, rows = image.width // tile, image.height // tile
        left = (image.width - cols * tile) // 2
        top = (image.height - rows * tile) // 2
        for r in range(rows):
            for c in range(cols):
                box = (left + c * tile, top + r * tile, left + (c + 1) * tile, top + (r + 1) * tile)
                image.crop(box).save(folder / f"{name}_{r}{c}.png")
                count += 1
    return count


def bin_path(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def run_logged(command: list[str], log: Path) -> float:
    started = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed; see {log}")
    return time.perf_counter() - started


def random_init_run(run: Path, seed: int, args: argparse.Namespace) -> None:
    """A run folder holding the encoder as every pretraining of `seed` starts it."""
    from vitrieval.training.checkpoint import save_tensors
    from vitrieval.training.epochs import seed_everything
    from vitrieval.training.pretrain import build_pretrain_model
    from vitrieval.training.pretrain_config import PretrainConfig
    from vitrieval.training.run_folder import CONFIG_FILE, RUN_MODEL_FILE

    cfg = PretrainConfig(
        out=str(run), images=str(args.catalogue), backbone=args.preset, seed=seed
    ).resolved()
    seed_everything(cfg.seed)  # as pretrain() does before building the model
    encoder, _ = build_pretrain_model(cfg)
    run.mkdir(parents=True, exist_ok=True)
    save_tensors(run / RUN_MODEL_FILE, encoder.state_dict())
    cfg.embedding_config().save(run / CONFIG_FILE)


def evaluate(method: str, seed: int, args: argparse.Namespace) -> dict:
    """Pretrain (unless `random`), export and score one method and seed."""
    slug = method.replace("+", "p").replace(" ", "-")
    run = Path(args.out) / f"{slug}-s{seed}"
    report_file = run / "copy" / "report.json"
    if report_file.is_file():
        print(f"{run}: done before, reusing its report")
        return json.loads(report_file.read_text())
    if run.exists():
        shutil.rmtree(run)  # never finished: start again
    train_seconds = 0.0
    if method == "random":
        random_init_run(run, seed, args)
    else:
        run.mkdir(parents=True)
        command = [
            bin_path("vitrieval-train"),
            "pretrain",
            *METHODS[method],
            "--images",
            str(args.catalogue),
            "--preset",
            args.preset,
            "--epochs",
            str(args.epochs),
            "--warmup-epochs",
            str(args.warmup_epochs),
            "--batch-size",
            str(args.batch_size),
            "--seed",
            str(seed),
            "--out",
            str(run),
        ]
        train_seconds = run_logged(command, run / "pretrain.log")
    model = run / "model.onnx"
    run_logged(
        [bin_path("vitrieval-train"), "export", "--run", str(run), "--out", str(model)],
        run / "export.log",
    )
    run_logged(
        [
            bin_path("vitrieval-index"),
            "bench",
            "--model",
            str(model),
            "--copy-detection",
            str(args.catalogue),
            "--queries-per-image",
            str(args.queries_per_image),
            "--out",
            str(run / "copy"),
        ],
        run / "bench.log",
    )
    report = json.loads(report_file.read_text())
    report["train_seconds"] = round(train_seconds, 1)
    report_file.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{method:<17} seed {seed}: R@1 {report['recall@1']:.4f}  mAP {report['map']:.4f}  "
        f"({train_seconds:.0f} s pretraining)"
    )
    return report


def _mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {std:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/densecl"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--warmup-epochs", type=float, default=10.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--queries-per-image", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.catalogue = args.out / "catalogue"
    if not args.catalogue.is_dir():
        print(f"{make_catalogue(args.catalogue)} tiles written to {args.catalogue}")

    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    for seed in args.seeds:
        for method in args.methods:
            results[method].append(evaluate(method, seed, args))

    tiles = len(list(args.catalogue.glob("*.png")))
    lines = [
        f"{tiles} tiles of {len(shipped_photos())} photos, {args.queries_per_image} edited "
        f"copies each; preset {args.preset}, {args.epochs} epochs, batch {args.batch_size}, "
        f"seeds {' '.join(map(str, args.seeds))}; {cpu_model()}, Python "
        f"{platform.python_version()}",
        "",
        "| method | R@1 | mAP | pretraining s (mean) |",
        "|---|---|---|---|",
    ]
    summary = {}
    for method, reports in results.items():
        r1 = [r["recall@1"] for r in reports]
        ap = [r["map"] for r in reports]
        seconds = statistics.mean(r["train_seconds"] for r in reports)
        summary[method] = {"recall@1": r1, "map": ap, "train_seconds": seconds}
        lines.append(f"| {method} | {_mean_std(r1)} | {_mean_std(ap)} | {seconds:.0f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    (args.out / "table.md").write_text(table)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
