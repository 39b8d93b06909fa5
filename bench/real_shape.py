"""ViT-S/16 at 224 px with GGeM: every way to run it on this machine, side by side.

The shape users run (196 patches of 16 px, width 384, 12 blocks of 6 heads, 9.2 GFLOP
per image), exported with `vitrieval-train export --init-only` (random weights unless
`--pretrained`: the speed does not depend on them), timed in one run, interleaved over
rounds (median), as ratios:

- `torch eager`: decode each JPEG with PIL, timm's eval transform, the model under
  `torch.inference_mode`, batch after batch (what a plain PyTorch script does);
- `Embedder`: `index.runtime.embedder.Embedder.embed_sources` on the files, with the plain,
  the fused and the fused INT8 model;
- bare ONNX Runtime on tensors decoded beforehand, for the plain graph, ONNX
  Runtime's `transformers` optimiser (model_type 'vit'), vitrieval's fused attention
  (`vitrieval-index optimize`), INT8 dynamic (`vitrieval-index quantize`) of the plain
  and of the fused graph, and INT8 static (QDQ, per-channel weights, calibrated on a
  sample);
- the machine's GEMM limit: float32 matrix products at the shape of the model's MLP
  (torch and numpy), their GFLOP/s divided by the model's FLOPs per image.

The catalogue: real photos scikit-image ships (7 of them), cropped at random and
resized to 500-2000 px on the long side, written as JPEG files (quality 90) to a
temporary folder. Agreement: cosine between each variant's embeddings and the plain
graph's on the catalogue; an FP32 graph rewrite is kept only at cosine >= 0.9999.
Quality (`--quality-images`): R@1 and mAP, leave-one-out, on scikit-learn's digits
(the held-out 30%, upscaled to 224 px), for the FP32 model and each INT8 one.

The machine is described with its load: load averages before and after, and the CPU
other processes took during each timed case (from /proc/stat less this process's own).

Run:  .venv/bin/python bench/real_shape.py [--images 64] [--rounds 3] [--quality-images 539]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from machine import cpu_model  # bench/machine.py (scripts run from bench/)
from PIL import Image
from skimage import data as skdata
from timm.data import create_transform

from vitrieval.index.evaluation.datasets import load_dataset
from vitrieval.index.evaluation.metrics import retrieval_metrics
from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.runtime.images import open_image
from vitrieval.index.runtime.model_metadata import read_model_metadata
from vitrieval.index.runtime.optimize import optimize_model
from vitrieval.index.runtime.preprocess import Preprocessor
from vitrieval.index.runtime.quantize import quantize_model
from vitrieval.training.cli import main as train_cli
from vitrieval.training.config import FitConfig
from vitrieval.training.export import init_only_model
from vitrieval.training.flops import model_flops
from vitrieval.training.model import weights_fingerprint

PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
)
KEEP_COSINE = 0.9999


def write_catalogue(folder: Path, count: int, min_side: int, max_side: int, seed: int = 0):
    """`count` JPEG files: random crops (30-100% of the side) of the scikit-image photos,
    resized so the long side is uniform in [min_side, max_side]."""
    rng = np.random.default_rng(seed)
    photos = [getattr(skdata, name)() for name in PHOTOS]
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        photo = photos[i % len(photos)]
        h, w = photo.shape[:2]
        ch, cw = (int(rng.uniform(0.3, 1.0) * s) for s in (h, w))
        top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        crop = Image.fromarray(photo[top : top + ch, left : left + cw])
        long_side = int(rng.integers(min_side, max_side + 1))
        scale = long_side / max(ch, cw)
        size = (max(1, round(cw * scale)), max(1, round(ch * scale)))
        path = folder / f"{i:05d}.jpg"
        crop.resize(size, Image.Resampling.BICUBIC).save(path, quality=90)
        paths.append(path)
    return paths


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def kernel_profile(path: Path, batch: np.ndarray, tmp: Path) -> list[tuple[str, float]]:
    """Share of ONNX Runtime's kernel time per operator type over two runs of `batch`
    (its profiler: SessionOptions.enable_profiling), largest first."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp / f"profile_{path.stem}")
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    sess.run(["embeddings"], {"images": batch})  # warm-up, profiled too: as long as a run
    sess.run(["embeddings"], {"images": batch})
    events = json.loads(Path(sess.end_profiling()).read_text())
    totals: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op = event["args"]["op_name"]
            totals[op] = totals.get(op, 0.0) + event["dur"]
    whole = sum(totals.values())
    return sorted(((op, t / whole) for op, t in totals.items()), key=lambda kv: -kv[1])


def run_arrays(sess: ort.InferenceSession, arrays: np.ndarray, batch: int) -> np.ndarray:
    parts = [
        sess.run(["embeddings"], {"images": arrays[start : start + batch]})[0]
        for start in range(0, len(arrays), batch)
    ]
    out = np.concatenate(parts).astype(np.float32)
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


def ort_transformers_optimize(src: Path, dst: Path, heads: int, width: int) -> str:
    """ONNX Runtime's own transformer optimiser, model_type 'vit'; its fusion counts."""
    from onnxruntime.transformers import optimizer

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        model = optimizer.optimize_model(
            str(src), model_type="vit", num_heads=heads, hidden_size=width
        )
    model.save_model_to_file(str(dst))
    stats = model.get_fused_operator_statistics()
    return ", ".join(f"{k} {v}" for k, v in stats.items() if v) or "no fusion"


def quantize_static_qdq(src: Path, dst: Path, calibration: np.ndarray) -> None:
    """INT8 static: QDQ, per-channel int8 weights, uint8 activations calibrated (MinMax)
    on `calibration`; the MatMuls with a weight only (attention's QK^T and AV stay FP32:
    quantising softmax outputs cost both accuracy and time in a trial)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    graph = onnx.load(str(src)).graph
    weights = {t.name for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}

    def is_weight(name: str) -> bool:
        while name not in weights:
            node = producers.get(name)
            if node is None or node.op_type != "Identity":
                return False
            name = node.input[0]
        return True

    nodes = [n.name for n in graph.node if n.op_type == "MatMul" and is_weight(n.input[1])]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter(
                [{"images": calibration[i : i + 8]} for i in range(0, len(calibration), 8)]
            )

        def get_next(self):
            return next(self.batches, None)

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantiser's per-tensor INFO lines
    try:
        quantize_static(
            str(src),
            str(dst),
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul"],
            nodes_to_quantize=nodes,
        )
    finally:
        root.setLevel(level)


def gemm_case(shape: tuple[int, int, int], backend: str) -> tuple[Callable[[], None], float]:
    """A float32 matrix product of `shape` (m, k, n) and its FLOPs."""
    m, k, n = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    if backend == "torch":
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        return (lambda: torch.matmul(ta, tb)), 2.0 * m * k * n
    if backend == "onnxruntime":  # one MatMul node: ONNX Runtime's own GEMM (MLAS)
        from onnx import TensorProto, helper, numpy_helper

        graph = helper.make_graph(
            [helper.make_node("MatMul", ["a", "b"], ["c"])],
            "gemm",
            [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
            [helper.make_tensor_value_info("c", TensorProto.FLOAT, [m, n])],
            [numpy_helper.from_array(b, "b")],
        )
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return (lambda: sess.run(["c"], {"a": a})), 2.0 * m * k * n
    return (lambda: a @ b), 2.0 * m * k * n


class CpuMeter:
    """Wall time, this process's CPU time and the whole machine's busy time."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")

    def sample(self) -> tuple[float, float, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / self.tick  # less idle, iowait
        return time.perf_counter(), usage.ru_utime + usage.ru_stime, busy


@dataclass
class Case:
    name: str
    kind: str  # "files", "tensors" or "gemm"
    run: Callable[[], None]
    work: float  # images per run (GEMM: FLOPs per run)
    times: list[float] = field(default_factory=list)
    own_cores: list[float] = field(default_factory=list)
    other_cores: list[float] = field(default_factory=list)

    def rate(self) -> float:
        return self.work / statistics.median(self.times)

    def rate_per_cpu_second(self) -> float:
        """Work per second of this process's CPU time (median over rounds): what the
        case would do per core it had to itself, less sensitive to a shared machine."""
        return statistics.median(
            self.work / (t * cores) for t, cores in zip(self.times, self.own_cores, strict=True)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="vit_small_patch16_224")
    parser.add_argument("--pool", default="ggem")
    parser.add_argument("--dim", type=int, help="projection width (default: none)")
    parser.add_argument("--pretrained", help="backbone weights file (default: random weights)")
    parser.add_argument("--images", type=int, default=64, help="JPEG files in the catalogue")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--min-side", type=int, default=500)
    parser.add_argument("--max-side", type=int, default=2000)
    parser.add_argument("--calibration", type=int, default=32, help="images for INT8 static")
    parser.add_argument(
        "--quality-images", type=int, default=539, help="held-out digits for R@1/mAP (0: skip)"
    )
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print ONNX Runtime's kernel time per operator type (plain, fused, INT8)",
    )
    args = parser.parse_args()

    load_before = os.getloadavg()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        plain = tmp / "model.onnx"
        export = ["export", "--init-only", "--backbone", args.backbone, "--pool", args.pool]
        export += ["--dim", str(args.dim)] if args.dim else []
        export += ["--pretrained", args.pretrained] if args.pretrained else []
        if train_cli([*export, "--out", str(plain)]) != 0:
            sys.exit("export failed")
        cfg = FitConfig(
            out="", backbone=args.backbone, pool=args.pool, dim=args.dim, pretrained=args.pretrained
        )
        model, _ = init_only_model(cfg)
        meta = read_model_metadata(plain)
        assert weights_fingerprint(model) == meta.fingerprint, "torch and ONNX models differ"
        flops = model_flops(model)["total"]
        heads = int(model.backbone.blocks[0].attn.num_heads)
        width = int(model.backbone.num_features)
        tokens = int(model.backbone.patch_embed.num_patches) + model.num_prefix_tokens

        paths = write_catalogue(tmp / "photos", args.images, args.min_side, args.max_side)
        catalogue_mb = sum(p.stat().st_size for p in paths) / 1e6
        preprocess = Preprocessor(meta)
        decoded = preprocess.batch([open_image(p) for p in paths])
        calibration = decoded[: args.calibration]

        models: dict[str, Path] = {"plain": plain}
        notes: dict[str, str] = {}
        models["fused"] = tmp / "model.opt.onnx"
        notes["fused"] = optimize_model(plain, models["fused"]).summary()
        models["ort-vit"] = tmp / "model.ortvit.onnx"
        notes["ort-vit"] = ort_transformers_optimize(plain, models["ort-vit"], heads, width)
        check = [Image.open(p).convert("RGB") for p in paths[:16]]
        models["int8"] = tmp / "model.int8.onnx"
        quantize_model(plain, models["int8"], check_images=check)
        models["fused-int8"] = tmp / "model.opt.int8.onnx"
        quantize_model(models["fused"], models["fused-int8"], check_images=check)
        models["static"] = tmp / "model.qdq.onnx"
        quantize_static_qdq(plain, models["static"], calibration)

        sessions = {name: session(path) for name, path in models.items()}
        reference = run_arrays(sessions["plain"], decoded, args.batch_size)
        agreement = {}
        for name, sess in sessions.items():
            cos = np.sum(run_arrays(sess, decoded, args.batch_size) * reference, axis=1)
            agreement[name] = (float(cos.min()), float(cos.mean()))
        kept = {n: agreement[n][0] >= KEEP_COSINE for n in ("fused", "ort-vit")}

        transform = create_transform(
            meta.input_size,
            interpolation=meta.interpolation,
            mean=meta.mean,
            std=meta.std,
            crop_pct=meta.crop_pct,
        )
        batch = args.batch_size

        def torch_eager() -> None:
            with torch.inference_mode():
                for start in range(0, len(paths), batch):
                    chunk = paths[start : start + batch]
                    model(torch.stack([transform(Image.open(p).convert("RGB")) for p in chunk]))

        def embedder_run(embedder: Embedder) -> Callable[[], None]:
            def go() -> None:
                result = embedder.embed_sources(paths)
                assert len(result.indices) == len(paths), result.errors

            return go

        def bare(sess: ort.InferenceSession) -> Callable[[], None]:
            return lambda: run_arrays(sess, decoded, batch)

        n = len(paths)
        cases = [
            Case("torch eager (files)", "files", torch_eager, n),
            Case(
                "Embedder, plain (files)",
                "files",
                embedder_run(Embedder(plain, batch_size=batch)),
                n,
            ),
            Case("bare ORT, plain graph", "tensors", bare(sessions["plain"]), n),
            Case(
                "bare ORT, ORT transformers optimizer 'vit'",
                "tensors",
                bare(sessions["ort-vit"]),
                n,
            ),
            Case("bare ORT, fused attention (optimize)", "tensors", bare(sessions["fused"]), n),
            Case("bare ORT, INT8 dynamic", "tensors", bare(sessions["int8"]), n),
            Case("bare ORT, fused + INT8 dynamic", "tensors", bare(sessions["fused-int8"]), n),
            Case("bare ORT, INT8 static QDQ per-channel", "tensors", bare(sessions["static"]), n),
            Case(
                "Embedder, fused (files)",
                "files",
                embedder_run(Embedder(models["fused"], batch_size=batch)),
                n,
            ),
            Case(
                "Embedder, fused + INT8 dynamic (files)",
                "files",
                embedder_run(Embedder(models["fused-int8"], batch_size=batch)),
                n,
            ),
        ]
        mlp_shape = (batch * tokens, width, 4 * width)
        for backend in ("torch", "numpy", "onnxruntime"):
            product, product_flops = gemm_case(mlp_shape, backend)
            repeats = max(1, int(4 * flops * n / 40 / product_flops))  # about 1/10 of a case

            def gemm(product=product, repeats=repeats) -> None:
                for _ in range(repeats):
                    product()

            cases.append(
                Case(f"GEMM limit: {backend} matmul fp32", "gemm", gemm, repeats * product_flops)
            )

        for case in cases:  # warm-up: allocators, thread pools, caches
            case.run()
        meter = CpuMeter()
        for _ in range(args.rounds):
            for case in cases:
                wall0, own0, busy0 = meter.sample()
                case.run()
                wall1, own1, busy1 = meter.sample()
                wall = wall1 - wall0
                case.times.append(wall)
                case.own_cores.append((own1 - own0) / wall)
                case.other_cores.append(max(0.0, (busy1 - busy0) - (own1 - own0)) / wall)

        profiles = {}
        if args.profile:
            for name in ("plain", "fused", "int8", "fused-int8"):
                profiles[name] = kernel_profile(models[name], decoded[:batch], tmp)
        quality = {}
        if args.quality_images:
            held_out = load_dataset("digits", image_size=meta.input_size[-1]).test
            held_out = held_out[: args.quality_images]
            digits = preprocess.batch([item.open() for item in held_out])
            labels = [item.label for item in held_out]
            for name in ("plain", "int8", "fused-int8", "static"):
                vectors = run_arrays(sessions[name], digits, batch)
                scores = retrieval_metrics(vectors, labels, ks=(1,))
                quality[name] = (scores["recall@1"], scores["map"])
        sizes = {name: path.stat().st_size / 1e6 for name, path in models.items()}
    load_after = os.getloadavg()

    gemm_rates = [c.rate() / flops for c in cases if c.kind == "gemm"]
    limit = max(gemm_rates)  # images/s at the best GEMM rate measured
    rates = {c.name: (c.rate() if c.kind != "gemm" else c.rate() / flops) for c in cases}
    eager = rates[cases[0].name]
    bare_plain = rates[cases[2].name]
    per_cpu = {c.name: c.rate_per_cpu_second() / (flops if c.kind == "gemm" else 1) for c in cases}
    bare_plain_cpu = per_cpu[cases[2].name]
    model_of = {
        cases[1].name: "plain",
        cases[2].name: "plain",
        cases[3].name: "ort-vit",
        cases[4].name: "fused",
        cases[5].name: "int8",
        cases[6].name: "fused-int8",
        cases[7].name: "static",
        cases[8].name: "fused",
        cases[9].name: "fused-int8",
    }

    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), onnxruntime {ort.__version__}"
    )
    print(
        "load average (1, 5, 15 min): before "
        + ", ".join(f"{v:.2f}" for v in load_before)
        + "; after "
        + ", ".join(f"{v:.2f}" for v in load_after)
    )
    print(
        f"model: {args.backbone} + {args.pool}, input {list(meta.input_size)}, "
        f"{flops / 1e9:.2f} GFLOP/image, weights: {args.pretrained or 'random'}; "
        f"{n} JPEG files {args.min_side}-{args.max_side} px ({catalogue_mb:.1f} MB), "
        f"batch {batch}, median of {args.rounds} rounds"
    )
    for name in ("fused", "ort-vit"):
        state = "kept" if kept[name] else f"dropped (cosine < {KEEP_COSINE})"
        print(f"{name}: {notes[name]}; {state}")
    header = (
        "| pipeline | img/s | vs torch eager | vs bare ORT | of GEMM limit | cos min vs FP32 "
        "| R@1 | mAP | MB | cores used | others' cores | img per CPU s | vs bare ORT |"
    )
    rows = []
    for case in cases:
        name = model_of.get(case.name)
        cos = f"{agreement[name][0]:.6f}" if name else "-"
        r1, ap = (
            (f"{quality[name][0]:.4f}", f"{quality[name][1]:.4f}") if name in quality else ("", "")
        )
        size = f"{sizes[name]:.1f}" if name else "-"
        rate = rates[case.name]
        rows.append(
            [
                case.name,
                f"{rate:.2f}",
                f"{rate / eager:.2f}x",
                f"{rate / bare_plain:.2f}x",
                f"{rate / limit:.2f}",
                cos,
                r1,
                ap,
                size,
                f"{statistics.median(case.own_cores):.2f}",
                f"{statistics.median(case.other_cores):.2f}",
                f"{per_cpu[case.name]:.2f}",
                f"{per_cpu[case.name] / bare_plain_cpu:.2f}x",
            ]
        )
    if args.markdown:
        print(header)
        print("|---|" + "---:|" * 12)
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        titles = [
            "pipeline",
            "img/s",
            "vs eager",
            "vs ORT",
            "of GEMM",
            "cos min",
            "R@1",
            "mAP",
            "MB",
            "cores",
            "others",
            "per CPU s",
            "vs ORT",
        ]
        widths = [max(w, len(t)) for w, t in zip(widths, titles, strict=True)]
        print(
            "  ".join(
                t.ljust(w) if i == 0 else t.rjust(w)
                for i, (t, w) in enumerate(zip(titles, widths, strict=True))
            )
        )
        for row in rows:
            print(
                "  ".join(
                    v.ljust(w) if i == 0 else v.rjust(w)
                    for i, (v, w) in enumerate(zip(row, widths, strict=True))
                )
            )
    gflops = ", ".join(
        f"{c.name.split(': ')[1]} {c.rate() / 1e9:.1f} GFLOP/s" for c in cases if c.kind == "gemm"
    )
    print(f"GEMM at the MLP's shape {mlp_shape}: {gflops} -> limit {limit:.2f} img/s")
    for name, shares in profiles.items():
        top = ", ".join(f"{op} {share:.1%}" for op, share in shares[:6])
        print(f"kernel time, {name} (batch {batch}): {top}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": cpu_model(),
                    "cores": os.cpu_count(),
                    "load_before": load_before,
                    "load_after": load_after,
                    "model": {"backbone": args.backbone, "pool": args.pool, "flops": flops},
                    "images": n,
                    "batch_size": batch,
                    "rounds": args.rounds,
                    "notes": notes,
                    "kept": kept,
                    "agreement": agreement,
                    "quality": quality,
                    "kernel_profiles": profiles,
                    "sizes_mb": sizes,
                    "cases": [
                        {
                            "name": c.name,
                            "kind": c.kind,
                            "rate": rates[c.name],
                            "times": c.times,
                            "own_cores": c.own_cores,
                            "other_cores": c.other_cores,
                            "rate_per_cpu_second": per_cpu[c.name],
                        }
                        for c in cases
                    ],
                    "gemm_limit_images_per_s": limit,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
