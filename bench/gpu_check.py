"""The GPU check: every GPU path vitrieval has, run and measured in one short command.

Made for a GPU host that has torch (CUDA), timm, onnx and the CPU build of onnxruntime
but neither onnxruntime-gpu nor faiss-gpu (their CUDA runtimes do not fit the check's
transfer limit): where a GPU build is missing, torch on CUDA stands in for it, measured
the same way, and the JSON says so. bench/gpu.py measures the GPU builds themselves
where they are installed. bench/gpu_check.sh installs brought wheels and runs this.

Parts, each written to OUT/<part>.json as soon as it ends (a run cut off still leaves
what it measured), then everything together in OUT/gpu-check.json:

- tests: tests/test_gpu.py in a subprocess; the outcome of every test (the gpu-marked
  ones run where their library's GPU build is present, skip with the reason elsewhere).
- train: the training step (forward, Norm-softmax, backward, clipping, AdamW) FP32
  against AMP (bf16), img/s, for the `small` preset and ViT-S/16 at 224 with GGeM
  (bench/gpu.py's `train_case`).
- methods: steps of JCF pooling (Norm-softmax), LaCViT's first stage (SupCon on the
  projection head) and DenseCL++ pre-training (two views, global + dense loss), through
  training.amp.MixedPrecision as the training loops run them; FP32 and AMP ms/step, the
  losses finite and the weights moved.
- embed: ViT-S/16 (GGeM) exported to ONNX; ONNX Runtime CPU embeds real photos; the
  same model in torch on CUDA, FP32 and bf16, embeds them too (cosine against the CPU
  vectors) and is timed at batch 64: the stand-in for ONNX Runtime's CUDA provider.
- batching: 16 concurrent callers, one image each per request, through
  service.batching.DynamicBatcher on the torch-CUDA bf16 model, batching on against off.
- search: exact inner-product top-k with torch on the GPU (float32, and float16 scores)
  at 1M x 384 against FAISS CPU Flat and IVF (bench/search_qps.py's clustered vectors),
  QPS with the recall of each against exact results: the stand-in for FAISS GPU.

Without a CUDA device every part but `tests` is skipped with the reason; --rehearse runs
the same code on the CPU at toy sizes instead, to find bugs before GPU time is spent.

Run:  bench/gpu_check.sh OUT [--parts ...]   or   .venv/bin/python bench/gpu_check.py --out OUT
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu import BATCH, NUM_CLASSES, cuda_time, images_per_s, machine, recall, table, train_case

PARTS = ("tests", "train", "methods", "embed", "batching", "search")
REPO = Path(__file__).resolve().parent.parent
VIT_S = "vit_small_patch16_224"
CALLERS = 16


class Settings:
    """Sizes of one run: the GPU's, or toy sizes for a CPU rehearsal."""

    def __init__(self, rehearse: bool, n: int, queries: int) -> None:
        self.device = torch.device("cpu" if rehearse else "cuda")
        self.rehearse = rehearse
        self.rounds, self.steps, self.warmup = (1, 1, 1) if rehearse else (3, 10, 3)
        self.vit = "tiny" if rehearse else VIT_S
        self.models = ("tiny",) if rehearse else ("small", VIT_S)
        self.batch = 8 if rehearse else BATCH
        self.n = 20_000 if rehearse else n
        self.queries = 200 if rehearse else queries
        self.requests = 4 if rehearse else 40  # per caller


# -- tests ---------------------------------------------------------------------------------


def tests_part(s: Settings, out: Path) -> dict[str, Any]:
    xml = Path(tempfile.mkdtemp()) / "gpu_tests.xml"  # OUT keeps JSON only
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/test_gpu.py",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--junitxml={xml}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome, message = tag, (found.get("message") or "")[:300]
        rows.append(
            {"test": case.get("name"), "outcome": outcome, "s": float(case.get("time") or 0)}
        )
        if message:
            rows[-1]["message"] = message
    return {
        "exit": done.returncode,
        "seconds": time.perf_counter() - started,
        "summary": done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "",
        "rows": rows,
    }


# -- training ---------------------------------------------------------------------------------


def train_part(s: Settings, out: Path) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = True  # what a training run gets by default too
    bf16 = s.device.type == "cpu" or torch.cuda.is_bf16_supported()
    dtype = torch.bfloat16 if bf16 else torch.float16
    rows = [train_case(m, m, dtype, s, s.device.type) for m in s.models]
    for row in rows:
        row["batch"] = BATCH
    return {"rows": rows}


def method_steps(s: Settings) -> dict[str, Callable[[], tuple[torch.nn.Module, Callable]]]:
    """name -> () -> (module holding every trained parameter, loss of one batch)."""
    from vitrieval.training.lacvit import ProjectionHead
    from vitrieval.training.losses import SupConLoss, create_loss
    from vitrieval.training.model import build_model
    from vitrieval.training.pretrain import Objective, build_pretrain_model
    from vitrieval.training.pretrain_config import PretrainConfig

    dev, b = s.device, s.batch

    def batch_of(model: Any, n: int) -> torch.Tensor:
        return torch.randn(n, *model.data_config()["input_size"], device=dev)

    labels = torch.arange(b, device=dev) % max(2, b // 4)  # 4 per class: SupCon positives

    def jcf():
        model = build_model(s.vit, "jcf")
        loss = create_loss("norm_softmax", model.embedding_dim, NUM_CLASSES)
        both = torch.nn.ModuleList([model, loss]).to(dev)
        images = batch_of(model, b)
        return both, lambda: loss(model(images), labels)

    def lacvit():
        model = build_model(s.vit, "ggem")
        head, supcon = ProjectionHead(model.embedding_dim), SupConLoss()
        both = torch.nn.ModuleList([model, head]).to(dev)
        images = batch_of(model, b)
        return both, lambda: supcon(head(model(images)), labels)

    def densecl_pp():
        cfg = PretrainConfig(out="unused", backbone=s.vit, method="densecl++").resolved()
        encoder, heads = build_pretrain_model(cfg, load_pretrained=False)
        objective = Objective(cfg)
        both = torch.nn.ModuleList([encoder, heads]).to(dev)
        views = batch_of(encoder, 2 * (b // 2))  # rows i and B + i: two views of image i
        generator = torch.Generator(device=dev).manual_seed(0)
        return both, lambda: objective(heads(encoder, views), views, generator)[0]

    return {"JCF": jcf, "LaCViT (SupCon)": lacvit, "DenseCL++": densecl_pp}


def methods_part(s: Settings, out: Path) -> dict[str, Any]:
    from vitrieval.training.amp import MixedPrecision

    rows = []
    for name, make in method_steps(s).items():
        row: dict[str, Any] = {"method": name, "model": s.vit, "batch": s.batch}
        for mode in ("fp32", "amp"):
            torch.manual_seed(0)
            module, loss_of = make()
            params = [p for p in module.parameters() if p.requires_grad]
            before = [p.detach().clone() for p in params]
            optimizer = torch.optim.AdamW(params, lr=1e-4)
            amp = MixedPrecision(mode == "amp", s.device)
            losses: list[float] = []

            def step(amp=amp, loss_of=loss_of, optimizer=optimizer, params=params, losses=losses):
                with amp.autocast():
                    loss = loss_of()
                amp.optimizer_step(loss, optimizer, params, 1.0)
                losses.append(float(loss.detach()))

            seconds = cuda_time(step, s.steps, s.warmup)
            moved = sum(not torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True))
            label = "FP32" if mode == "fp32" else f"AMP {str(amp.dtype).removeprefix('torch.')}"
            row[f"{label} ms/step"] = 1e3 * seconds
            row[f"{mode} losses finite"] = bool(np.isfinite(losses).all())
            row[f"{mode} first/last loss"] = [losses[0], losses[-1]]
            row[f"{mode} tensors moved"] = f"{moved}/{len(params)}"
            del module, optimizer
        rows.append(row)
    return {"rows": rows}


# -- embedding ---------------------------------------------------------------------------------


def photos(size: int) -> list[bytes]:
    """scikit-image's bundled photos as PNG bytes (real images, various sizes)."""
    import io

    from PIL import Image
    from skimage import data as skdata

    names = ["astronaut", "coffee", "chelsea", "camera", "rocket", "immunohistochemistry"]
    names += ["hubble_deep_field", "motorcycle_left", "retina", "cat", "coins", "page"]
    out = []
    for name in names:
        try:
            array = getattr(skdata, name)()
        except Exception:  # a photo this scikit-image lacks (needs pooch)
            continue
        if isinstance(array, tuple):
            array = array[0]
        buffer = io.BytesIO()
        Image.fromarray(array).convert("RGB").save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


class TorchEmbedder:
    """The exported model's torch twin on a device: float32 (B, 3, S, S) -> (B, D)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype | None):
        self.model = model.to(device).eval()
        self.device, self.dtype = device, dtype

    @torch.inference_mode()
    def __call__(self, batch: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(batch).to(self.device, non_blocking=True)
        if self.dtype is None:
            return self.model(x).float().cpu().numpy()
        with torch.autocast(self.device.type, self.dtype):
            return self.model(x).float().cpu().numpy()


_SETUP: dict[str, tuple[Any, dict[str, TorchEmbedder], np.ndarray]] = {}


def embed_setup(s: Settings) -> tuple[Any, dict[str, TorchEmbedder], np.ndarray]:
    """(ONNX Runtime CPU Embedder, torch embedders by precision, real photos prepared),
    made once per run (the export takes seconds)."""
    if s.vit not in _SETUP:
        with tempfile.TemporaryDirectory() as tmp:  # the session has read the file
            _SETUP[s.vit] = _embed_setup(s, Path(tmp))
    return _SETUP[s.vit]


def _embed_setup(s: Settings, folder: Path) -> tuple[Any, dict[str, TorchEmbedder], np.ndarray]:
    from vitrieval.index.runtime.embedder import Embedder
    from vitrieval.training.config import FitConfig
    from vitrieval.training.export import export_model, model_metadata
    from vitrieval.training.model import build_model

    torch.manual_seed(0)
    model = build_model(s.vit, "ggem").eval()
    path = folder / "model.onnx"
    export_model(model, model_metadata(model, FitConfig(out="unused")), path, check=False)
    cpu = Embedder(path, device="cpu", batch_size=BATCH)
    prepared = np.stack([cpu.prepare(png) for png in photos(cpu.input_size)])
    torch.backends.cuda.matmul.allow_tf32 = False  # FP32 means float32 here
    torch.backends.cudnn.allow_tf32 = False
    torch_embedders = {
        "FP32": TorchEmbedder(model, s.device, None),
        "bf16": TorchEmbedder(model, s.device, torch.bfloat16),
    }
    return cpu, torch_embedders, prepared


def rate(run: Callable[[np.ndarray], Any], batch: np.ndarray, seconds: float) -> float:
    """bench/gpu.py's `images_per_s`, after one untimed call (kernels, workspace)."""
    run(batch)
    return images_per_s(run, batch, seconds)


def embed_part(s: Settings, out: Path) -> dict[str, Any]:
    cpu, gpus, prepared = embed_setup(s)
    reference = cpu.embed_arrays(prepared)
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((s.batch, *prepared.shape[1:]), dtype=np.float32)
    seconds = 0.5 if s.rehearse else 2.0
    cpu_rate = rate(cpu.embed_arrays, batch, seconds)
    rows = []
    for name, embed in gpus.items():
        vectors = embed(prepared)
        cosine = np.sum(vectors * reference, axis=1)
        gpu_rate = max(rate(embed, batch, seconds) for _ in range(s.rounds))
        rows.append(
            {
                "path": f"torch {s.device.type} {name}",
                "photos": len(prepared),
                "min cosine vs ORT CPU": float(cosine.min()),
                "mean cosine vs ORT CPU": float(cosine.mean()),
                "max |diff|": float(np.abs(vectors - reference).max()),
                "img/s (batch)": gpu_rate,
                "ORT CPU img/s": cpu_rate,
                "GPU / CPU": gpu_rate / cpu_rate,
            }
        )
    return {"model": f"{s.vit} + GGeM", "batch": s.batch, "rows": rows}


async def _callers(batcher: Any, images: np.ndarray, requests: int) -> float:
    """Seconds for CALLERS callers to make `requests` one-image requests each."""

    async def caller(i: int) -> None:
        for r in range(requests):
            await batcher.embed(images[(i + r) % len(images)])

    await batcher.start()
    try:
        await caller(0)  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(CALLERS)))
        return time.perf_counter() - start
    finally:
        await batcher.stop()


def batching_part(s: Settings, out: Path) -> dict[str, Any]:
    from vitrieval.service.batching import DynamicBatcher

    _, gpus, prepared = embed_setup(s)
    run = gpus["bf16"]
    rows = []
    for enabled in (False, True, False, True):  # interleaved
        sizes: list[int] = []
        batcher = DynamicBatcher(run, enabled=enabled, max_batch=32, on_batch=sizes.append)
        seconds = asyncio.run(_callers(batcher, prepared, s.requests))
        timed = sizes[s.requests :]  # the warm-up's batches first
        rows.append(
            {
                "batching": "on" if enabled else "off",
                "requests/s": CALLERS * s.requests / seconds,
                "mean batch": float(np.mean(timed)) if timed else None,
            }
        )
    on = max(r["requests/s"] for r in rows if r["batching"] == "on")
    off = max(r["requests/s"] for r in rows if r["batching"] == "off")
    return {"callers": CALLERS, "path": "torch bf16", "rows": rows, "gain": on / off}


# -- search ---------------------------------------------------------------------------------


def torch_topk(
    x: torch.Tensor, q: np.ndarray, k: int, chunk: int = 2048
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact inner-product top-k of queries q (Q, D) in x (N, D) on x's device."""
    scores, ids = [], []
    for start in range(0, len(q), chunk):
        block = torch.from_numpy(q[start : start + chunk]).to(x.device, x.dtype)
        top = torch.topk(block @ x.T, k, dim=1)
        scores.append(top.values)
        ids.append(top.indices)
    return torch.cat(scores), torch.cat(ids)


def search_part(s: Settings, out: Path) -> dict[str, Any]:
    import faiss
    from search_qps import CLUSTERS, SEED, D, K, make_mixture, timed  # bench/search_qps.py

    meta = np.random.default_rng(SEED)
    centres = meta.standard_normal((CLUSTERS, D), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    rot = np.linalg.qr(meta.standard_normal((D, D)))[0].astype(np.float32)
    x = make_mixture(s.n, centres, rot, SEED + 10 + s.n)
    q = make_mixture(s.queries, centres, rot, SEED + 20 + s.n)
    rows: list[dict[str, Any]] = []

    flat = faiss.IndexFlatIP(D)
    flat.add(x)
    seconds, exact = timed(lambda: flat.search(q, K)[1])
    rows.append({"search": "FAISS CPU Flat", "QPS": len(q) / seconds, "recall@10": 1.0})
    flat.reset()  # its memory back before the IVF build

    nlist = 2 ** round(math.log2(4 * math.sqrt(s.n)))
    ivf = faiss.index_factory(D, f"IVF{nlist},Flat", faiss.METRIC_INNER_PRODUCT)
    started = time.perf_counter()
    ivf.train(x[: min(64 * nlist, s.n)])
    ivf.add(x)
    build = time.perf_counter() - started
    for nprobe in (16, 64, 256):
        faiss.extract_index_ivf(ivf).nprobe = nprobe
        seconds, ids = timed(lambda: ivf.search(q, K)[1])
        rows.append(
            {
                "search": f"FAISS CPU IVF{nlist},Flat nprobe={nprobe}",
                "QPS": len(q) / seconds,
                "recall@10": recall(ids, exact, K),
                "build s": build,
            }
        )
    ivf.reset()

    sync = torch.cuda.synchronize if s.device.type == "cuda" else lambda: None
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in (torch.float32, torch.float16):
        started = time.perf_counter()
        xt = torch.from_numpy(x).to(s.device, dtype)
        sync()
        upload = time.perf_counter() - started

        def search(xt=xt) -> np.ndarray:
            ids = torch_topk(xt, q, K)[1]
            sync()
            return ids.cpu().numpy()

        search()  # warm-up: kernels, workspace
        seconds, ids = timed(search)
        rows.append(
            {
                "search": f"torch {s.device.type} exact, {str(dtype).removeprefix('torch.')}",
                "QPS": len(q) / seconds,
                "recall@10": recall(ids, exact, K),
                "build s": upload,
            }
        )
        del xt
    cpu_exact = rows[0]["QPS"]
    for row in rows:
        row["x FAISS CPU Flat"] = row["QPS"] / cpu_exact
    return {"n": s.n, "dim": D, "queries": len(q), "k": K, "rows": rows}


# -- main ------------------------------------------------------------------------------------


RUNNERS: dict[str, Callable[[Settings, Path], dict[str, Any]]] = {
    "tests": tests_part,
    "train": train_part,
    "methods": methods_part,
    "embed": embed_part,
    "batching": batching_part,
    "search": search_part,
}


def no_gpu(s: Settings) -> str | None:
    if s.rehearse or torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"no CUDA device: torch {torch.__version__} ({build}) sees none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the JSON files")
    parser.add_argument("--parts", default=",".join(PARTS), help=",".join(PARTS))
    parser.add_argument("--rehearse", action="store_true", help="run on the CPU at toy sizes")
    parser.add_argument("--n", type=int, default=1_000_000, help="search: database vectors")
    parser.add_argument("--queries", type=int, default=4_000, help="search: queries")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"unknown part(s) {unknown}; valid: {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    s = Settings(args.rehearse, args.n, args.queries)
    info = machine()
    info["timm"] = importlib.metadata.version("timm")
    if torch.cuda.is_available():
        info["gpu_name"] = torch.cuda.get_device_name()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    results: dict[str, Any] = {"machine": info, "rehearsal": s.rehearse, "parts": {}}
    missing = no_gpu(s)
    for part in parts:
        started = time.perf_counter()
        if missing and part != "tests":
            result: dict[str, Any] = {"skipped": missing}
        else:
            print(f"\n## {part}", flush=True)
            try:
                result = RUNNERS[part](s, args.out)
            except Exception as error:  # one part's failure must not end the check
                result = {"error": f"{type(error).__name__}: {error}"}
                result["traceback"] = traceback.format_exc()[-3000:]
        result["part seconds"] = time.perf_counter() - started
        results["parts"][part] = result
        (args.out / f"{part}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        if "rows" in result:
            print(table(result["rows"], list(dict.fromkeys(k for r in result["rows"] for k in r))))
        summary = {k: v for k, v in result.items() if k not in ("rows", "traceback")}
        print(f"{part}: {json.dumps(summary, default=str)}", flush=True)
        if "traceback" in result:
            print(result["traceback"], flush=True)
    (args.out / "gpu-check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
