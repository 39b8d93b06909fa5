"""The self-description an exported vitrieval model carries (docs/training.md).

An exported `.onnx` file has input `images` (float32, (B, 3, H, W), normalised) and
output `embeddings` (float32, (B, D), unit L2 norm), and in its `metadata_props` the
keys below, prefixed `vitrieval.`, with JSON-encoded values. Export writes them with
`to_properties`; whoever embeds reads them back with `read_model_metadata`, so the
preprocessing is stated exactly once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

FORMAT_VERSION = 1
PREFIX = "vitrieval."
INPUT_NAME = "images"
OUTPUT_NAME = "embeddings"


class ModelMetadataError(ValueError):
    """The model file lacks vitrieval metadata or carries an unsupported version."""


@dataclass(frozen=True)
class ModelMetadata:
    input_size: tuple[int, int, int]  # (3, H, W), as in timm's data config
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str  # "bilinear" | "bicubic" | "nearest"
    crop_pct: float  # resize the short side to H / crop_pct, then centre-crop H x W
    embedding_dim: int
    backbone: str
    pooling: str
    fingerprint: str  # sha256 of the weights
    format_version: int = FORMAT_VERSION

    def to_properties(self) -> dict[str, str]:
        """Flat `vitrieval.<key>` -> JSON string mapping for ONNX metadata_props."""
        return {PREFIX + k: json.dumps(v) for k, v in asdict(self).items()}

    @classmethod
    def from_properties(cls, props: dict[str, str]) -> ModelMetadata:
        values = {}
        for f in fields(cls):
            raw = props.get(PREFIX + f.name)
            if raw is None:
                raise ModelMetadataError(
                    f"model metadata lacks {PREFIX + f.name}; not a vitrieval export?"
                )
            values[f.name] = json.loads(raw)
        if values["format_version"] > FORMAT_VERSION:
            raise ModelMetadataError(
                f"model format_version {values['format_version']} is newer than this vitrieval "
                f"understands ({FORMAT_VERSION}); upgrade vitrieval"
            )
        for key in ("input_size", "mean", "std"):
            values[key] = tuple(values[key])
        return cls(**values)


CHECKPOINT_SUFFIXES: frozenset[str] = frozenset({".safetensors", ".pt", ".pth", ".ckpt"})
"""Weights files of a training run: what `vitrieval-train export` turns into a model."""


def _export_hint(run: str) -> str:
    return (
        f"export it first (`vitrieval-train export --run {run} --out MODEL.onnx`) and "
        "pass the .onnx file"
    )


def model_file(path: str | Path) -> Path:
    """`path` (a `--model`) checked to be a model file. A training checkpoint, a run
    folder, another folder or a missing file is a ModelMetadataError saying what to pass
    instead, before ONNX Runtime answers with a protobuf parse error. (An index folder
    stands for its model copy in the CLI: `vitrieval.index.cli.common.model_from_args`.)"""
    path = Path(path)
    if path.is_dir():
        exported = sorted(p for p in path.iterdir() if p.suffix == ".onnx" and p.is_file())
        if exported:  # a run folder after `export`: say which file to pass
            files = " or ".join(str(p) for p in exported[:4])
            raise ModelMetadataError(
                f"{path} is a folder, not a model file; it holds the exported model {files}: "
                "pass that file as the model"
            )
        if any(p.suffix in CHECKPOINT_SUFFIXES for p in path.iterdir()):
            raise ModelMetadataError(
                f"{path} is a training run folder, not an exported model: {_export_hint(str(path))}"
            )
        raise ModelMetadataError(
            f"{path} is a folder, not a model file: pass an exported .onnx model (or an "
            "index folder, whose model copy is used)"
        )
    if not path.is_file():
        raise ModelMetadataError(f"model file not found: {path}")
    if path.suffix.lower() in CHECKPOINT_SUFFIXES:
        raise ModelMetadataError(
            f"{path} is a training checkpoint, not an exported model: "
            + _export_hint(str(path.parent))
        )
    return path


def read_model_metadata(path: str | Path) -> ModelMetadata:
    """Read the metadata of an exported model with ONNX Runtime (no onnx package needed)."""
    import onnxruntime as ort

    path = model_file(path)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ModelMetadataError(f"{path} is not a loadable ONNX model: {exc}") from None
    return ModelMetadata.from_properties(dict(session.get_modelmeta().custom_metadata_map))
