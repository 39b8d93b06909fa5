"""Export a run to one self-describing ONNX file, and prove it computes what PyTorch does.

The file follows DESIGN.md section 2: input `images` float32 (B, 3, H, W), output
`embeddings` float32 (B, D) L2-normalised, batch axis dynamic, preprocessing and the
weights' fingerprint in `vitrieval.*` metadata (see `index.model_metadata`).

After writing, ONNX Runtime is run against PyTorch at batch 1 and batch > 1 on random
tensors and on real photos preprocessed exactly as the metadata says; a maximum
absolute difference above `PARITY_TOLERANCE` fails the export and no file is left.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from index.atomic import atomic_path, atomic_write_text
from index.model_metadata import INPUT_NAME, OUTPUT_NAME, ModelMetadata
from index.preprocess import Preprocessor

from .checkpoint import MODEL_FILE, load_model_weights
from .config import FitConfig, load_config_file
from .model import EmbeddingModel, weights_fingerprint

PARITY_TOLERANCE = 1e-4


class ExportError(RuntimeError):
    """The run cannot be exported, or the exported model disagrees with PyTorch."""


@dataclass
class ExportReport:
    path: Path
    metadata: ModelMetadata
    max_abs_diff: dict[str, float]
    bytes: int

    def summary(self) -> str:
        worst = max(self.max_abs_diff.values()) if self.max_abs_diff else float("nan")
        checked = (
            "unchecked"
            if not self.max_abs_diff
            else f"ONNX Runtime vs PyTorch max |diff| {worst:.2e}"
        )
        return (
            f"exported {self.path} ({self.bytes / 1e6:.1f} MB, dim {self.metadata.embedding_dim}, "
            f"input {self.metadata.input_size[1]}x{self.metadata.input_size[2]}, {checked})"
        )


def load_run_model(run: Path) -> tuple[EmbeddingModel, FitConfig]:
    """Rebuild the model of a run folder from its config and final weights."""
    from .trainer import CONFIG_FILE, model_from_config

    if not (run / CONFIG_FILE).is_file():
        raise ExportError(f"{run} is not a run folder (no {CONFIG_FILE})")
    cfg = FitConfig(**load_config_file(run / CONFIG_FILE))
    model = model_from_config(cfg, load_pretrained=False)
    load_model_weights(model, run / MODEL_FILE)
    return model.eval(), cfg


def model_metadata(model: EmbeddingModel, cfg: FitConfig) -> ModelMetadata:
    data = model.data_config()
    return ModelMetadata(
        input_size=tuple(int(v) for v in data["input_size"]),
        mean=tuple(float(v) for v in data["mean"]),
        std=tuple(float(v) for v in data["std"]),
        interpolation=str(data["interpolation"]),
        crop_pct=float(data["crop_pct"]),
        embedding_dim=int(model.embedding_dim),
        backbone=cfg.backbone,
        pooling=cfg.pool,
        fingerprint=weights_fingerprint(model),
    )


def export_model(
    model: EmbeddingModel, meta: ModelMetadata, out: Path, opset: int = 18, check: bool = True
) -> ExportReport:
    """Write `model` to `out` as ONNX with `meta`; atomically, and only if it checks out."""
    model = model.eval().cpu()
    dummy = torch.zeros(2, *meta.input_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's deprecation chatter
            torch.onnx.export(
                model,
                (dummy,),
                str(tmp),
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                opset_version=opset,
                dynamo=False,
            )
        proto = onnx.load(str(tmp))
        del proto.metadata_props[:]
        for key, value in meta.to_properties().items():
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, value
        proto.doc_string = f"vitrieval embedding model: {meta.backbone} + {meta.pooling}"
        onnx.save(proto, str(tmp))
        onnx.checker.check_model(str(tmp))
        diffs = parity_check(model, tmp, meta) if check else {}
        size = tmp.stat().st_size
    return ExportReport(out, meta, diffs, size)


def export_run(run: Path, out: Path, opset: int = 18, check: bool = True) -> ExportReport:
    model, cfg = load_run_model(run)
    report = export_model(model, model_metadata(model, cfg), out, opset=opset, check=check)
    atomic_write_text(
        out.parent / (out.stem + ".export.json"),
        json.dumps(
            {
                "run": str(run),
                "max_abs_diff": report.max_abs_diff,
                "fingerprint": report.metadata.fingerprint,
            },
            indent=2,
        ),
    )
    return report


def sample_photos(meta: ModelMetadata) -> np.ndarray:
    """Real photos shipped with scikit-image, preprocessed per `meta`: float32 (3, 3, H, W)."""
    from PIL import Image
    from skimage import data

    preprocess = Preprocessor(meta)
    photos = [data.astronaut(), data.coffee(), data.chelsea()]
    return preprocess.batch([Image.fromarray(p).convert("RGB") for p in photos])


def parity_check(model: EmbeddingModel, onnx_path: Path, meta: ModelMetadata) -> dict[str, float]:
    """Max |ONNX Runtime - PyTorch| on random and real inputs at batch 1 and 3."""
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    random_batch = rng.standard_normal((3, *meta.input_size)).astype(np.float32)
    photos = sample_photos(meta)
    cases = {
        "random_b1": random_batch[:1],
        "random_b3": random_batch,
        "photo_b1": photos[:1],
        "photo_b3": photos,
    }
    diffs: dict[str, float] = {}
    with torch.no_grad():
        for name, batch in cases.items():
            expected = model(torch.from_numpy(batch)).numpy()
            (got,) = session.run([OUTPUT_NAME], {INPUT_NAME: batch})
            if got.shape != expected.shape:
                raise ExportError(
                    f"{name}: ONNX output shape {got.shape} != PyTorch {expected.shape}"
                )
            diffs[name] = float(np.abs(got - expected).max())
    worst = max(diffs, key=diffs.get)
    if diffs[worst] > PARITY_TOLERANCE:
        raise ExportError(
            f"ONNX Runtime disagrees with PyTorch on {worst}: "
            f"max |diff| {diffs[worst]:.3e} > {PARITY_TOLERANCE}"
        )
    return diffs
