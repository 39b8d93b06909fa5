"""Embedding throughput: vitrieval's Embedder against PyTorch eager and a bare ONNX session.

Three ways to turn the same JPEG files into embeddings with the same model, timed in
one run, interleaved over rounds (median reported):

- `torch eager`: what a plain PyTorch script does: decode with PIL, timm's eval
  transform, model forward under `torch.inference_mode`, batch after batch, one thread
  of Python;
- `embedder`: `index.runtime.embedder.Embedder.embed_sources` on the file paths (decoding in
  worker threads while ONNX Runtime runs the previous batch);
- `bare ORT`: `InferenceSession.run` on tensors decoded and preprocessed beforehand,
  the ceiling for any pipeline around this model.

Ratios: embedder / torch eager (goal >= 1.3x) and the pipeline overhead
1 - embedder / bare ORT (goal <= 15%).

Run:  .venv/bin/python bench/embedder_throughput.py [--preset small] [--images 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import onnxruntime as ort
import torch
from machine import cpu_model  # bench/machine.py (scripts run from bench/)
from serve_load import write_photos  # photo crops, shared with the load benchmark
from timm.data import create_transform

from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.runtime.images import open_image
from vitrieval.index.runtime.preprocess import Preprocessor
from vitrieval.training.config import FitConfig
from vitrieval.training.export import export_model, model_metadata
from vitrieval.training.model import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="backbone preset or timm ViT name")
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--image-size", type=int, default=256, help="side of the JPEG files")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = build_model(args.preset, "ggem").eval()
    data_config = model.data_config()
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        export_model(
            model, model_metadata(model, FitConfig(out="x", backbone=args.preset)), onnx_path
        )
        paths = write_photos(Path(tmp), args.images, args.image_size)
        embedder = Embedder(onnx_path, batch_size=args.batch_size)
        transform = create_transform(
            data_config["input_size"],
            interpolation=data_config["interpolation"],
            mean=data_config["mean"],
            std=data_config["std"],
            crop_pct=data_config["crop_pct"],
        )
        preprocess = Preprocessor(embedder.metadata)
        decoded = preprocess.batch([open_image(p) for p in paths])
        session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])

        def torch_eager() -> None:
            with torch.inference_mode():
                for start in range(0, len(paths), args.batch_size):
                    chunk = paths[start : start + args.batch_size]
                    batch = torch.stack([transform(open_image(p)) for p in chunk])
                    model(batch)

        def vitrieval_embedder() -> None:
            result = embedder.embed_sources(paths)
            assert len(result.indices) == len(paths)

        def bare_ort() -> None:
            for start in range(0, len(decoded), args.batch_size):
                session.run(["embeddings"], {"images": decoded[start : start + args.batch_size]})

        cases: dict[str, Callable[[], None]] = {
            "torch eager (decode + model)": torch_eager,
            "vitrieval Embedder (decode + model)": vitrieval_embedder,
            "bare ONNX Runtime (pre-decoded)": bare_ort,
        }
        for run in cases.values():  # warm-up: allocators, thread pools, caches
            run()
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, run in cases.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)

    rate = {name: len(paths) / statistics.median(t) for name, t in times.items()}
    names = list(cases)
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), onnxruntime {ort.__version__}, {embedder.provider}"
    )
    print(
        f"model: {args.preset} + ggem, input {data_config['input_size']}, batch {args.batch_size}; "
        f"{len(paths)} JPEG files of {args.image_size}x{args.image_size}; median of {args.rounds}"
    )
    print(f"{'pipeline':<40}{'img/s':>10}{'vs torch eager':>16}")
    for name in names:
        print(f"{name:<40}{rate[name]:>10.0f}{rate[name] / rate[names[0]]:>15.2f}x")
    speedup = rate[names[1]] / rate[names[0]]
    overhead = 1 - rate[names[1]] / rate[names[2]]
    print(f"Embedder vs torch eager: {speedup:.2f}x (goal >= 1.3x)")
    print(f"Embedder pipeline overhead vs bare ONNX Runtime: {overhead:.1%} (goal <= 15%)")


if __name__ == "__main__":
    main()
