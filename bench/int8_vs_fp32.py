"""INT8 dynamic quantisation against FP32: embedding speed and retrieval quality on digits.

Takes an exported FP32 model (a digits run: `vitrieval-train export --run RUN --out M.onnx`),
quantises it with `vitrieval.index.runtime.quantize.quantize_model`, then, for both models in one
run:
embeds the digits held-out split (539 images, in memory, so the model dominates),
interleaved over rounds (median img/s), and scores leave-one-out retrieval on it.

Run:  .venv/bin/python bench/int8_vs_fp32.py --model runs/demo/model.onnx
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from vitrieval.index.evaluation.datasets import load_dataset
from vitrieval.index.evaluation.metrics import retrieval_metrics
from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.runtime.quantize import quantize_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="FP32 .onnx exported by vitrieval-train")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    embedder_fp32 = Embedder(args.model, batch_size=args.batch_size)
    size = embedder_fp32.metadata.input_size[-1]
    held_out = load_dataset("digits", image_size=size).test
    images = [item.open() for item in held_out]
    labels = [item.label for item in held_out]
    with tempfile.TemporaryDirectory() as tmp:
        int8_path = Path(tmp) / "model.int8.onnx"
        report = quantize_model(Path(args.model), int8_path, check_images=images[:64])
        models = {"fp32": embedder_fp32, "int8": Embedder(int8_path, batch_size=args.batch_size)}
        times: dict[str, list[float]] = {name: [] for name in models}
        vectors = {name: m.embed_images(images) for name, m in models.items()}  # warm-up too
        for _ in range(args.rounds):
            for name, model in models.items():
                started = time.perf_counter()
                model.embed_images(images)
                times[name].append(time.perf_counter() - started)

    rate = {name: len(images) / statistics.median(t) for name, t in times.items()}
    scores = {name: retrieval_metrics(v, labels, ks=(1,)) for name, v in vectors.items()}
    print(f"model {args.model}: {report.summary()}")
    print(f"{'model':<6}{'img/s':>9}{'speed':>8}{'R@1':>9}{'mAP':>9}{'MAP@R':>9}{'MB':>7}")
    sizes = {"fp32": report.bytes_before, "int8": report.bytes_after}
    for name in models:
        s = scores[name]
        print(
            f"{name:<6}{rate[name]:>9.0f}{rate[name] / rate['fp32']:>7.2f}x"
            f"{s['recall@1']:>9.4f}{s['map']:>9.4f}{s['map_at_r']:>9.4f}{sizes[name] / 1e6:>7.2f}"
        )
    delta = scores["int8"]["recall@1"] - scores["fp32"]["recall@1"]
    print(
        f"INT8: {rate['int8'] / rate['fp32']:.2f}x the FP32 speed, R@1 change {delta:+.4f}, "
        f"cosine agreement mean {report.mean_cosine:.4f} min {report.min_cosine:.4f}"
    )


if __name__ == "__main__":
    main()
