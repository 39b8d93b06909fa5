"""Export a run to one self-describing ONNX file, and prove it computes what PyTorch does.

The file follows the exported-model contract (docs/training.md, "The exported
model"): input `images` float32 (B, 3, H, W), output `embeddings` float32 (B, D)
L2-normalised, batch axis dynamic, preprocessing and the weights' fingerprint in
`vitrieval.*` metadata (see `vitrieval.index.runtime.model_metadata`).

After writing, ONNX Runtime is run against PyTorch at batch 1 and batch > 1 on random
tensors and on real photos preprocessed exactly as the metadata says; a maximum
absolute difference above `PARITY_TOLERANCE` fails the export and no file is left.

Two sources: a run folder (`export_run`, the trained weights) or a model built on the
spot (`export_init_only`: seeded initialisation, or backbone weights from a file as
`fit --pretrained` loads them), for timing, smoke tests and off-the-shelf weights.

A model whose weights exceed what one ONNX file holds (protobuf's 2 GB) keeps them as
external data in `NAME.onnx.data` beside `NAME.onnx`; ONNX Runtime finds it there.
"""

from __future__ import annotations

import contextlib
import json
import stat
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from vitrieval.index.atomic import atomic_write_text
from vitrieval.index.runtime.model_metadata import INPUT_NAME, OUTPUT_NAME, ModelMetadata
from vitrieval.index.runtime.onnx_files import publish, save_onnx
from vitrieval.index.runtime.preprocess import Preprocessor

from . import run_folder
from .config import FitConfig
from .epochs import seed_everything
from .model import EmbeddingModel, weights_fingerprint
from .run_folder import CONFIG_FILE, model_from_config

PARITY_TOLERANCE = 1e-4
EXTERNAL_DATA_THRESHOLD = 1_800_000_000
"""Weights above this many bytes go to external data: a single ONNX file is a protobuf
message, capped at 2 GiB, and the graph needs some room beside the weights."""
EXTERNAL_DATA_SUFFIX = ".data"


class ExportError(RuntimeError):
    """The run cannot be exported, or the exported model disagrees with PyTorch."""


@dataclass
class ExportReport:
    path: Path
    metadata: ModelMetadata
    max_abs_diff: dict[str, float]
    bytes: int  # the .onnx file and its external data together
    data_path: Path | None = None  # the external data file, when the weights needed one

    def summary(self) -> str:
        worst = max(self.max_abs_diff.values()) if self.max_abs_diff else float("nan")
        checked = (
            "unchecked"
            if not self.max_abs_diff
            else f"ONNX Runtime vs PyTorch max |diff| {worst:.2e}"
        )
        data = f", weights in {self.data_path.name}" if self.data_path else ""
        return (
            f"exported {self.path} ({self.bytes / 1e6:.1f} MB{data}, "
            f"dim {self.metadata.embedding_dim}, "
            f"input {self.metadata.input_size[1]}x{self.metadata.input_size[2]}, {checked})"
        )


def load_run_model(run: Path) -> tuple[EmbeddingModel, FitConfig]:
    """Rebuild the model of a run folder from its config and final weights (in eval mode)."""
    if not (run / CONFIG_FILE).is_file():
        raise ExportError(f"{run} is not a run folder (no {CONFIG_FILE})")
    return run_folder.load_run_model(run)


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


def external_data_path(out: Path) -> Path:
    """Where the weights of `out` go when they need external data: `NAME.onnx.data`."""
    return out.with_name(out.name + EXTERNAL_DATA_SUFFIX)


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the state dict's tensors: what the exported file's weights will take."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def export_model(
    model: EmbeddingModel,
    meta: ModelMetadata,
    out: Path,
    opset: int = 18,
    check: bool = True,
    external_data: bool | None = None,
) -> ExportReport:
    """Write `model` to `out` as ONNX with `meta`; atomically, and only if it checks out.

    `external_data`: keep the weights in `external_data_path(out)` beside the file (None:
    when they exceed `EXTERNAL_DATA_THRESHOLD`). Everything is written and checked in a
    private folder beside `out` and then renamed into place, the data file first.
    """
    model = model.eval().cpu()
    out = Path(out)
    if out.is_dir():
        raise ExportError(f"{out} is a folder: --out names the .onnx file to write")
    if external_data is None:
        external_data = weights_bytes(model) > EXTERNAL_DATA_THRESHOLD
    out.parent.mkdir(parents=True, exist_ok=True)
    data_path = external_data_path(out)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as work:
        staged = Path(work) / out.name
        _write_onnx(model, meta, staged, opset, data_path.name if external_data else None)
        diffs = parity_check(model, staged, meta) if check else {}
        staged_data = staged.with_name(data_path.name)
        size = staged.stat().st_size + (staged_data.stat().st_size if external_data else 0)
        mode = stat.S_IMODE(staged.stat().st_mode)  # a plain open()'s: 0o666 less the umask
        if external_data:
            publish(staged_data, data_path, mode)  # onnx writes it owner-only
        publish(staged, out, mode)
    return ExportReport(out, meta, diffs, size, data_path if external_data else None)


@contextlib.contextmanager
def _exporter_failures(opset: int) -> Iterator[None]:
    """torch.onnx.export's refusals as an ExportError naming the opset: an opset it does
    not know, or an operator it cannot write at that opset (OnnxExporterError, itself
    a RuntimeError); the original stays chained."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc).strip()
        reason = text.splitlines()[0] if text else type(exc).__name__
        raise ExportError(f"the ONNX exporter failed at opset {opset}: {reason}") from exc


def _write_onnx(
    model: EmbeddingModel, meta: ModelMetadata, path: Path, opset: int, data_name: str | None
) -> None:
    """Export, add the metadata, save to `path` (weights in `data_name` beside it if
    given) and run ONNX's checker."""
    # The exporter itself moves the weights of a model over 2 GB into one file per
    # tensor beside its output: a folder of its own keeps those apart.
    raw = path.parent / "raw" / "model.onnx"
    raw.parent.mkdir()
    dummy = torch.zeros(2, *meta.input_size)
    with warnings.catch_warnings(), _exporter_failures(opset):
        warnings.simplefilter("ignore")  # the exporter's deprecation chatter
        torch.onnx.export(
            model,
            (dummy,),
            str(raw),
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            opset_version=opset,
            dynamo=False,
        )
    proto = onnx.load(str(raw))  # external data, if any, is read in
    del proto.metadata_props[:]
    for key, value in meta.to_properties().items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    proto.doc_string = f"vitrieval embedding model: {meta.backbone} + {meta.pooling}"
    save_onnx(proto, path, data_name)
    onnx.checker.check_model(str(path))  # by path: works past 2 GB too


def export_run(run: Path, out: Path, opset: int = 18, check: bool = True) -> ExportReport:
    model, cfg = load_run_model(run)
    report = export_model(model, model_metadata(model, cfg), out, opset=opset, check=check)
    _write_sidecar(out, {"run": str(run)}, report)
    return report


def init_only_model(cfg: FitConfig) -> tuple[EmbeddingModel, list[str]]:
    """The model `cfg` describes, untrained: seeded with `cfg.seed` exactly as `fit`
    seeds its starting model, the backbone's weights from `cfg.pretrained` if given
    (loaded as `fit --pretrained` loads them).

    When the file is a vitrieval model (keys under `backbone.`, e.g. a run's
    `model.safetensors`), the head tensors (pooling, projection) it holds with this
    model's shapes are loaded too. Returns the model in eval mode and the names of the
    head tensors taken from the file.
    """
    seed_everything(cfg.seed)
    model = model_from_config(cfg, load_pretrained=True)
    taken: list[str] = []
    if cfg.pretrained and cfg.pretrained != "timm":
        taken = _load_head_tensors(model, Path(cfg.pretrained))
    return model.eval(), taken


def _load_head_tensors(model: EmbeddingModel, path: Path) -> list[str]:
    from .backbones import _read_state_dict

    saved = _read_state_dict(path)
    if not any(key.startswith("backbone.") for key in saved):
        return []  # a bare backbone (timm) state dict: no head to take
    own = model.state_dict()
    head = {
        key: value
        for key, value in saved.items()
        if not key.startswith("backbone.") and key in own and own[key].shape == value.shape
    }
    model.load_state_dict(head, strict=False)
    return sorted(head)


def export_init_only(
    cfg: FitConfig, out: Path, opset: int = 18, check: bool = True
) -> tuple[ExportReport, list[str]]:
    """Export the untrained (or `--pretrained`) model `cfg` describes: `init_only_model`.

    Returns the report and the head tensors loaded from `cfg.pretrained`.
    """
    model, taken = init_only_model(cfg)
    report = export_model(model, model_metadata(model, cfg), out, opset=opset, check=check)
    source = {
        "init_only": True,
        "backbone": cfg.backbone,
        "pool": cfg.pool,
        "dim": cfg.dim,
        "seed": cfg.seed,
        "pretrained": cfg.pretrained,
        "head_from_pretrained": taken,
    }
    _write_sidecar(out, source, report)
    return report, taken


def _write_sidecar(out: Path, source: dict, report: ExportReport) -> None:
    """`NAME.export.json` beside the model: where it came from and its parity figures."""
    atomic_write_text(
        out.parent / (out.stem + ".export.json"),
        json.dumps(
            {
                **source,
                "max_abs_diff": report.max_abs_diff,
                "fingerprint": report.metadata.fingerprint,
                "external_data": report.data_path.name if report.data_path else None,
            },
            indent=2,
        ),
    )


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
            if not np.isfinite(expected).all():  # NaN differs from nothing: say so
                raise ExportError(f"{name}: the PyTorch model's own output is not finite")
            (got,) = session.run([OUTPUT_NAME], {INPUT_NAME: batch})
            if got.shape != expected.shape:
                raise ExportError(
                    f"{name}: ONNX output shape {got.shape} != PyTorch {expected.shape}"
                )
            diffs[name] = float(np.abs(got - expected).max())
    # "not <=": a NaN difference fails too (NaN > tolerance is false); shown first
    failing = {name: diff for name, diff in diffs.items() if not diff <= PARITY_TOLERANCE}
    if failing:
        nan = [name for name, diff in failing.items() if np.isnan(diff)]
        worst = nan[0] if nan else max(failing, key=failing.__getitem__)
        raise ExportError(
            f"ONNX Runtime disagrees with PyTorch on {worst}: "
            f"max |diff| {diffs[worst]:.3e} > {PARITY_TOLERANCE}"
        )
    return diffs
