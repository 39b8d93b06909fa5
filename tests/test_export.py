"""ONNX export: parity for every pooling, metadata contract, preprocessing agreement."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from skimage import data as skdata
from timm.data import create_transform

import vitrieval.training.export as export_module
from vitrieval.index.runtime.model_metadata import (
    ModelMetadata,
    ModelMetadataError,
    read_model_metadata,
)
from vitrieval.index.runtime.preprocess import Preprocessor
from vitrieval.training.config import FitConfig
from vitrieval.training.export import ExportError, export_model, model_metadata
from vitrieval.training.model import build_model, weights_fingerprint
from vitrieval.training.pooling import pooling_names


@pytest.mark.parametrize("pool", pooling_names())
def test_every_pooling_exports_with_parity(tmp_path, pool):
    torch.manual_seed(0)
    model = build_model("tiny", pool, dim=48 if pool == "gem" else None)
    meta = model_metadata(model, FitConfig(out="x", pool=pool))
    report = export_model(model, meta, tmp_path / "m.onnx")
    assert set(report.max_abs_diff) == {"random_b1", "random_b3", "photo_b1", "photo_b3"}
    assert max(report.max_abs_diff.values()) <= 1e-4
    # dynamic batch axis, unit-norm output of the declared width
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((5, 3, 32, 32)).astype(np.float32)
    (out,) = session.run(["embeddings"], {"images": x})
    assert out.shape == (5, meta.embedding_dim)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    with torch.no_grad():
        np.testing.assert_allclose(out, model(torch.from_numpy(x)).numpy(), atol=1e-4)


def test_metadata_contract(tmp_path):
    model = build_model("tiny", "ggem")
    export_model(model, model_metadata(model, FitConfig(out="x")), tmp_path / "m.onnx")
    meta = read_model_metadata(tmp_path / "m.onnx")
    assert meta.input_size == (3, 32, 32)
    assert meta.embedding_dim == 128
    assert meta.backbone == "tiny" and meta.pooling == "ggem"
    assert meta.crop_pct == 1.0 and meta.interpolation == "bicubic"
    assert len(meta.mean) == 3 and len(meta.std) == 3
    assert meta.fingerprint == weights_fingerprint(model)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    props = session.get_modelmeta().custom_metadata_map
    assert props["vitrieval.input_size"] == "[3, 32, 32]"
    assert all(key.startswith("vitrieval.") for key in props)
    assert [i.name for i in session.get_inputs()] == ["images"]
    assert [o.name for o in session.get_outputs()] == ["embeddings"]


def test_parity_failure_is_loud_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(export_module, "PARITY_TOLERANCE", 0.0)
    model = build_model("tiny", "ggem")
    with torch.no_grad():
        model.backbone.pos_embed.mul_(50)  # any float noise at all now exceeds a zero tolerance
    with pytest.raises(ExportError, match="disagrees"):
        export_model(model, model_metadata(model, FitConfig(out="x")), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_metadata_errors(tmp_path):
    with pytest.raises(ModelMetadataError, match="not found"):
        read_model_metadata(tmp_path / "nope.onnx")
    (tmp_path / "bad.onnx").write_bytes(b"garbage")
    with pytest.raises(ModelMetadataError, match="not a loadable"):
        read_model_metadata(tmp_path / "bad.onnx")
    props = ModelMetadata(
        (3, 8, 8), (0.5,) * 3, (0.5,) * 3, "bilinear", 1.0, 4, "b", "p", "f"
    ).to_properties()
    props["vitrieval.format_version"] = "99"
    with pytest.raises(ModelMetadataError, match="newer"):
        ModelMetadata.from_properties(props)


@pytest.mark.parametrize(
    ("size", "crop_pct", "interpolation"), [(32, 1.0, "bicubic"), (64, 0.875, "bilinear")]
)
def test_preprocessor_matches_timm_eval_transform(size, crop_pct, interpolation):
    meta = ModelMetadata(
        (3, size, size),
        (0.485, 0.456, 0.406),
        (0.229, 0.224, 0.225),
        interpolation,
        crop_pct,
        8,
        "b",
        "p",
        "f",
    )
    timm_tf = create_transform(
        (3, size, size),
        interpolation=interpolation,
        crop_pct=crop_pct,
        mean=meta.mean,
        std=meta.std,
    )
    for photo in (skdata.astronaut(), skdata.coffee()[:, :500]):  # square and landscape
        image = Image.fromarray(photo)
        np.testing.assert_allclose(Preprocessor(meta)(image), timm_tf(image).numpy(), atol=1e-6)
