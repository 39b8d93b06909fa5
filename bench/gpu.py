"""GPU benchmark: training steps, ONNX Runtime CUDA embedding (FP32 / FP16), FAISS GPU vs CPU.

Three sections, each run when its GPU path is usable here and otherwise skipped with the
reason; with no GPU at all the script prints "no GPU: ..." and exits 0.

1. Training step (torch on CUDA): forward, Norm-softmax over 100 classes, backward,
   gradient clipping and AdamW, batch 64 of random images, GGeM pooling; FP32 against
   AMP (bfloat16 where the GPU has it, else float16 with a GradScaler: what
   training/trainer.py does). Models: the `small` preset (64 px, patch 8, width 192,
   depth 6) and ViT-S/16 at 224 (`vit_small_patch16_224`, random weights). Median
   milliseconds per step over rounds, img/s, the AMP speed-up.
2. Embedding (ONNX Runtime's CUDAExecutionProvider through index.runtime.embedder.Embedder):
   the same two models exported with training.export (random weights: speed does not
   depend on them), preprocessed batches of 64 through `Embedder.embed_arrays`, so the
   model alone is timed (decoding is CPU work, measured by bench/embedder_throughput.py).
   FP32 against FP16, where FP16 is onnxruntime's own float16 converter
   (`onnxruntime.transformers.float16.convert_float_to_float16`, keep_io_types=True): the
   graph computes in half precision while its input and output stay float32, so the
   converted file keeps the exported-model contract (names, metadata) and drops into the
   Embedder unchanged; exporting from torch in half would make the input float16 and break
   that contract. Reported: img/s, FP16 speed-up, the FP16 embeddings' largest absolute
   difference and smallest cosine against FP32, and CPU provider img/s for scale.
3. FAISS (a GPU build, faiss-gpu): bench/search_qps.py's clustered vectors (1,000
   Gaussian clusters, L2-normalised), 1M x 384 by default, 10,000 queries, k = 10.
   "Flat" and f"IVF{nlist},Flat" (nlist = 4 sqrt(N) as a power of two, trained on
   min(64 nlist, N) vectors), built (train + add) on the CPU and on the GPU
   (faiss.index_cpu_to_all_gpus, as index/store does); QPS with all queries in one call
   (fastest of >= 2 runs) at nprobe 16, 64 and 256. The same parameters give the same
   recall on both (printed beside each row, against exact CPU Flat results), so the
   GPU/CPU QPS ratio of a row is at equal recall.

The machine (GPU, driver, CPU, cores, library versions) is printed with the figures;
--json writes everything. On a GPU host with the development virtualenv, swap in the
GPU builds first (docs/deploy.md, "GPU benchmark"):
    .venv/bin/pip uninstall -y onnxruntime faiss-cpu
    .venv/bin/pip install "onnxruntime-gpu[cuda,cudnn]" faiss-gpu

Run:  .venv/bin/python bench/gpu.py [--sections train,embed,faiss] [--n 1000000]
      [--queries 10000] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from machine import cpu_model  # bench/machine.py (scripts run from bench/)

# isort: split
import onnxruntime as ort  # after torch: it finds the CUDA libraries torch has loaded

SECTIONS = ("train", "embed", "faiss")
MODELS = {"small": "small (64 px)", "vit_small_patch16_224": "ViT-S/16 (224 px)"}
BATCH = 64
NUM_CLASSES = 100


# -- what is usable here -----------------------------------------------------------------


def torch_gpu() -> str | None:
    """None when torch can train on CUDA here, else why not."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"


def ort_gpu() -> str | None:
    providers = ort.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        return (
            f"onnxruntime {ort.__version__} has no CUDAExecutionProvider "
            "(install onnxruntime-gpu in place of onnxruntime)"
        )
    if torch_gpu() is not None:
        return f"no CUDA device ({torch_gpu()})"
    return None


def faiss_gpu() -> str | None:
    if not hasattr(faiss, "StandardGpuResources"):
        return f"faiss {faiss.__version__} is a CPU build (install faiss-gpu in place of faiss-cpu)"
    if faiss.get_num_gpus() == 0:
        return f"faiss {faiss.__version__} sees no GPU"
    return None


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": f"{ort.__version__} ({', '.join(ort.get_available_providers())})",
        "faiss": faiss.__version__,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
        )
        info["cuda"] = torch.version.cuda
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
        except (OSError, IndexError, subprocess.SubprocessError):
            info["driver"] = None
    return info


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A Markdown table of `rows` (missing cells blank; floats to 4 significant digits,
    whole numbers from 100 up)."""

    def cell(value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return f"{value:.4g}" if abs(value) < 100 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


# -- 1. training step ----------------------------------------------------------------------


def train_section(args: argparse.Namespace) -> list[dict[str, Any]]:
    amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    torch.backends.cuda.matmul.allow_tf32 = True  # what a training run gets by default too
    rows = []
    for backbone, label in MODELS.items():
        rows.append(train_case(backbone, label, amp_dtype, args))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return rows


def train_case(
    backbone: str,
    label: str,
    amp_dtype: torch.dtype,
    args: argparse.Namespace,
    device_name: str = "cuda",
) -> dict[str, Any]:
    """FP32 and AMP steps of one model, interleaved over rounds (median per step)."""
    from vitrieval.training.losses import create_loss
    from vitrieval.training.model import build_model

    device = torch.device(device_name)
    torch.manual_seed(0)
    model = build_model(backbone, "ggem").to(device).train()
    loss_fn = create_loss("norm_softmax", model.embedding_dim, NUM_CLASSES).to(device)
    params = [*model.parameters(), *loss_fn.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    size = model.data_config()["input_size"]
    images = torch.randn(BATCH, *size, device=device)
    labels = torch.randint(0, NUM_CLASSES, (BATCH,), device=device)
    scalers = {
        "fp32": torch.amp.GradScaler(device.type, enabled=False),
        "amp": torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16),
    }

    def step(mode: str) -> None:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=mode == "amp"):
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler = scalers[mode]
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(optimizer)
        scaler.update()

    timings: dict[str, list[float]] = {"fp32": [], "amp": []}
    for _ in range(args.rounds):  # interleaved, so both see the same clocks
        for mode in timings:
            timings[mode].append(cuda_time(lambda m=mode: step(m), args.steps, args.warmup))
    fp32, amp = statistics.median(timings["fp32"]), statistics.median(timings["amp"])
    return {
        "model": label,
        "params M": sum(p.numel() for p in model.parameters()) / 1e6,
        "FP32 ms/step": 1e3 * fp32,
        f"AMP {str(amp_dtype).removeprefix('torch.')} ms/step": 1e3 * amp,
        "FP32 img/s": BATCH / fp32,
        "AMP img/s": BATCH / amp,
        "AMP speed-up": fp32 / amp,
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }


def cuda_time(fn: Callable[[], None], steps: int, warmup: int) -> float:
    """Seconds per call of fn on the GPU (synchronised), after `warmup` untimed calls."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - start) / steps


# -- 2. embedding through ONNX Runtime ------------------------------------------------


def export_models(folder: Path) -> dict[str, dict[str, Path]]:
    """Each model exported as FP32 and converted to FP16 (float32 input and output)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from vitrieval.training.config import FitConfig
    from vitrieval.training.export import export_model, model_metadata
    from vitrieval.training.model import build_model

    paths = {}
    for backbone in MODELS:
        torch.manual_seed(0)
        model = build_model(backbone, "ggem")
        fp32 = folder / f"{backbone}.onnx"
        export_model(model, model_metadata(model, FitConfig(out="unused")), fp32, check=False)
        fp16 = folder / f"{backbone}.fp16.onnx"
        onnx.save(convert_float_to_float16(onnx.load(str(fp32)), keep_io_types=True), str(fp16))
        paths[backbone] = {"fp32": fp32, "fp16": fp16}
    return paths


def embed_section(args: argparse.Namespace, device: str = "cuda") -> list[dict[str, Any]]:
    from vitrieval.index.runtime.embedder import Embedder

    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:  # pip-installed CUDA / cuDNN (onnxruntime-gpu[cuda,cudnn])
        preload()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = export_models(Path(tmp))
        for backbone, label in MODELS.items():
            embedders = {
                "fp32": Embedder(models[backbone]["fp32"], device=device, batch_size=BATCH),
                "fp16": Embedder(models[backbone]["fp16"], device=device, batch_size=BATCH),
            }
            for name, embedder in embedders.items():
                if device == "cuda" and embedder.provider != "CUDAExecutionProvider":
                    raise RuntimeError(f"{label} {name} runs on {embedder.provider}, not CUDA")
            size = embedders["fp32"].input_size
            batch = np.random.default_rng(0).standard_normal((BATCH, 3, size, size), np.float32)
            rates: dict[str, list[float]] = {"fp32": [], "fp16": []}
            for embedder in embedders.values():  # warm-up: CUDA kernels, cuDNN algorithm search
                for _ in range(args.warmup):
                    embedder.embed_arrays(batch)
            for _ in range(args.rounds):
                for name, embedder in embedders.items():
                    rates[name].append(images_per_s(embedder.embed_arrays, batch, 2.0))
            fp32_out = embedders["fp32"].embed_arrays(batch)
            fp16_out = embedders["fp16"].embed_arrays(batch)
            cpu = Embedder(models[backbone]["fp32"], device="cpu", batch_size=BATCH)
            cpu_rate = images_per_s(cpu.embed_arrays, batch, 3.0)
            fp32, fp16 = statistics.median(rates["fp32"]), statistics.median(rates["fp16"])
            rows.append(
                {
                    "model": label,
                    "CUDA FP32 img/s": fp32,
                    "CUDA FP16 img/s": fp16,
                    "FP16 speed-up": fp16 / fp32,
                    "FP16 max |diff|": float(np.abs(fp16_out - fp32_out).max()),
                    "FP16 min cosine": float(np.min(np.sum(fp16_out * fp32_out, axis=1))),
                    "CPU FP32 img/s": cpu_rate,
                    "CUDA FP32 / CPU": fp32 / cpu_rate,
                }
            )
    return rows


def images_per_s(
    run: Callable[[np.ndarray], np.ndarray], batch: np.ndarray, seconds: float
) -> float:
    """Images per second of `run(batch)` over at least 2 calls and `seconds`."""
    calls, start = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - start < seconds:
        run(batch)
        calls += 1
    return calls * len(batch) / (time.perf_counter() - start)


# -- 3. FAISS on the GPU -------------------------------------------------------------------


def faiss_section(args: argparse.Namespace) -> list[dict[str, Any]]:
    from search_qps import CLUSTERS, SEED, D, K, make_mixture, timed  # bench/search_qps.py

    meta = np.random.default_rng(SEED)
    centres = meta.standard_normal((CLUSTERS, D), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    rot = np.linalg.qr(meta.standard_normal((D, D)))[0].astype(np.float32)
    started = time.perf_counter()
    x = make_mixture(args.n, centres, rot, SEED + 10 + args.n)
    q = make_mixture(args.queries, centres, rot, SEED + 20 + args.n)
    print(f"  data: {args.n:,} x {D} in {time.perf_counter() - started:.1f} s", flush=True)
    nlist = 2 ** round(math.log2(4 * math.sqrt(args.n)))
    ntrain = min(64 * nlist, args.n)
    rows: list[dict[str, Any]] = []
    exact: np.ndarray | None = None
    for factory, probes in (("Flat", [0]), (f"IVF{nlist},Flat", [16, 64, 256])):
        built: dict[str, tuple[faiss.Index, float]] = {}
        for where in ("cpu", "gpu"):
            index = faiss.index_factory(D, factory, faiss.METRIC_INNER_PRODUCT)
            started = time.perf_counter()
            if where == "gpu":
                index = faiss.index_cpu_to_all_gpus(index)
            if not index.is_trained:
                index.train(x[:ntrain])
            index.add(x)
            built[where] = (index, time.perf_counter() - started)
            print(f"  {factory} on {where}: built in {built[where][1]:.1f} s", flush=True)
        for nprobe in probes:
            row: dict[str, Any] = {
                "index": factory,
                "nprobe": nprobe or None,
                "CPU build s": built["cpu"][1],
                "GPU build s": built["gpu"][1],
            }
            results = {}
            for where, (index, _) in built.items():
                if nprobe:
                    set_nprobe(index, nprobe, where)
                seconds, ids = timed(lambda ix=index: ix.search(q, K)[1])
                row[f"{where.upper()} QPS"] = len(q) / seconds
                results[where] = ids
            if exact is None:  # the first row is the exact CPU Flat search
                exact = results["cpu"]
            for where, ids in results.items():
                row[f"{where.upper()} recall@10"] = recall(ids, exact, K)
            row["GPU / CPU QPS"] = row["GPU QPS"] / row["CPU QPS"]
            row["build speed-up"] = row["CPU build s"] / row["GPU build s"]
            rows.append(row)
            params = f" nprobe={nprobe}" if nprobe else ""
            print(f"  {factory}{params}: GPU {row['GPU / CPU QPS']:.1f}x CPU QPS", flush=True)
        del built
    return rows


def set_nprobe(index: faiss.Index, nprobe: int, where: str) -> None:
    if where == "gpu":
        faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", nprobe)
    else:
        faiss.extract_index_ivf(index).nprobe = nprobe


def recall(found: np.ndarray, exact: np.ndarray, k: int) -> float:
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(found, exact, strict=True)]))


# -- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help="train,embed,faiss")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps / calls first")
    parser.add_argument("--n", type=int, default=1_000_000, help="FAISS database vectors")
    parser.add_argument("--queries", type=int, default=10_000, help="FAISS queries")
    parser.add_argument("--json", metavar="PATH", help="write machine, settings and rows here")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; valid: {', '.join(SECTIONS)}")

    missing = {"train": torch_gpu(), "embed": ort_gpu(), "faiss": faiss_gpu()}
    if all(missing[s] for s in sections):
        print("no GPU: " + "; ".join(f"{s}: {missing[s]}" for s in sections) + "; nothing measured")
        return 0
    info = machine()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    runners = {"train": train_section, "embed": embed_section, "faiss": faiss_section}
    results: dict[str, Any] = {"machine": info, "settings": vars(args)}
    for section in sections:
        if missing[section]:
            print(f"\n## {section}: skipped ({missing[section]})")
            results[section] = {"skipped": missing[section]}
            continue
        print(f"\n## {section}", flush=True)
        rows = runners[section](args)
        results[section] = rows
        print(table(rows, list(rows[0])), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
