"""`vitrieval-index optimize`: fused attention, same embeddings, refusals, quantising after."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from index_cli_helpers import run  # tests/index_cli_helpers.py

import vitrieval.index.runtime.optimize as optimize_module
from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.runtime.model_metadata import ModelMetadataError, read_model_metadata
from vitrieval.index.runtime.optimize import (
    COSINE_FLOOR,
    OptimizeError,
    default_check_images,
    optimize_model,
)
from vitrieval.index.runtime.quantize import quantize_model, quantized_fingerprint
from vitrieval.training.config import FitConfig
from vitrieval.training.export import export_model, model_metadata
from vitrieval.training.model import build_model


def op_counts(path) -> collections.Counter:
    return collections.Counter(node.op_type for node in onnx.load(str(path)).graph.node)


def test_fused_model_embeds_as_the_plain_one(tmp_path, tiny_onnx, capsys):
    out = tmp_path / "tiny.opt.onnx"
    code, printed, err = run(capsys, "optimize", "--model", tiny_onnx, "--out", out)
    assert code == 0, err
    assert "4 attention blocks fused" in printed
    # every block is one Attention node; what fed the old pattern is gone
    plain, fused = op_counts(tiny_onnx), op_counts(out)
    assert plain["Softmax"] == 4 and plain["Attention"] == 0
    assert fused["Attention"] == 4 and fused["Softmax"] == 0 and fused["Split"] == 0
    assert sum(fused.values()) < sum(plain.values()) - 4 * 20
    # same metadata and fingerprint (same function), the rewrite recorded
    assert read_model_metadata(out) == read_model_metadata(tiny_onnx)
    props = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert props.get_modelmeta().custom_metadata_map["vitrieval.optimization"] == (
        '"attention-fusion"'
    )
    images = default_check_images()
    reference = Embedder(tiny_onnx, device="cpu").embed_images(images)
    optimised = Embedder(out, device="cpu").embed_images(images)
    cosines = np.sum(reference * optimised, axis=1)
    assert cosines.min() >= COSINE_FLOOR
    np.testing.assert_allclose(optimised, reference, atol=1e-5)
    # and on a batch of arbitrary tensors
    x = np.random.default_rng(3).standard_normal((5, 3, 32, 32)).astype(np.float32)
    embedder = Embedder(out, device="cpu")
    np.testing.assert_allclose(
        embedder.embed_arrays(x), Embedder(tiny_onnx, device="cpu").embed_arrays(x), atol=1e-5
    )


@pytest.mark.parametrize("fused_attn", [True, False])
def test_both_attention_exports_of_timm_fuse(tmp_path, fused_attn):
    """timm computes attention with scaled_dot_product_attention (q and k both scaled by
    the exporter) or, with fused_attn off, as q * scale @ k^T: both patterns fuse."""
    torch.manual_seed(0)
    model = build_model("tiny", "cls", dim=24)
    for block in model.backbone.blocks:
        block.attn.fused_attn = fused_attn
    plain = tmp_path / "m.onnx"
    export_model(model, model_metadata(model, FitConfig(out="x", pool="cls", dim=24)), plain)
    report = optimize_model(plain, tmp_path / "m.opt.onnx")
    assert report.fused == 4 and report.min_cosine >= COSINE_FLOOR
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "m.opt.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(["embeddings"], {"images": x})
    with torch.no_grad():
        np.testing.assert_allclose(got, model(torch.from_numpy(x)).numpy(), atol=1e-4)


def test_a_disagreeing_rewrite_writes_nothing(tmp_path, tiny_onnx, monkeypatch):
    original = optimize_module.fuse_attention

    def wrong_scale(model):  # a fusion that gets the scale wrong must be caught
        count = original(model)
        for node in model.graph.node:
            if node.op_type == "Attention":
                node.attribute.append(onnx.helper.make_attribute("scale", 3.0))
        return count

    monkeypatch.setattr(optimize_module, "fuse_attention", wrong_scale)
    with pytest.raises(OptimizeError, match="disagrees"):
        optimize_model(tiny_onnx, tmp_path / "m.opt.onnx")
    assert list(tmp_path.iterdir()) == []


def test_refusals(tmp_path, tiny_onnx, capsys):
    optimised = tmp_path / "m.opt.onnx"
    optimize_model(tiny_onnx, optimised)
    with pytest.raises(OptimizeError, match="already optimised"):
        optimize_model(optimised, tmp_path / "again.onnx")
    quantised = tmp_path / "m.int8.onnx"
    quantize_model(tiny_onnx, quantised)
    with pytest.raises(OptimizeError, match="optimise the FP32 model, then quantise"):
        optimize_model(quantised, tmp_path / "q.opt.onnx")
    with pytest.raises(OptimizeError, match="refusing to overwrite"):
        optimize_model(tiny_onnx, tiny_onnx)
    (tmp_path / "junk.onnx").write_bytes(b"junk")
    with pytest.raises(ModelMetadataError):
        optimize_model(tmp_path / "junk.onnx", tmp_path / "junk.opt.onnx")
    # through the CLI: one line, exit 2
    code, _, err = run(capsys, "optimize", "--model", optimised, "--out", tmp_path / "x.onnx")
    assert code == 2 and err.count("\n") == 1 and "already optimised" in err


def test_no_attention_to_fuse(tmp_path, tiny_onnx):
    # strip the Softmax out of the pattern: nothing matches, nothing is written
    model = onnx.load(str(tiny_onnx))
    for node in model.graph.node:
        if node.op_type == "Softmax":
            node.op_type = "Sigmoid"
            del node.attribute[:]
    broken = tmp_path / "sigmoid.onnx"
    onnx.save(model, str(broken))
    with pytest.raises(OptimizeError, match="no attention block"):
        optimize_model(broken, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_quantising_the_fused_model_quantises_attention(tmp_path, tiny_onnx):
    optimised = tmp_path / "m.opt.onnx"
    optimize_model(tiny_onnx, optimised)
    report = quantize_model(optimised, tmp_path / "m.opt.int8.onnx")
    counts = op_counts(tmp_path / "m.opt.int8.onnx")
    assert counts["QAttention"] == 4 and counts["Attention"] == 0
    assert report.min_cosine > 0.99
    meta = json.loads(
        ort.InferenceSession(str(tmp_path / "m.opt.int8.onnx"), providers=["CPUExecutionProvider"])
        .get_modelmeta()
        .custom_metadata_map["vitrieval.quantization"]
    )
    assert meta == "int8-dynamic"
    # its own fingerprint: the plain INT8 model's vectors differ from it
    source = read_model_metadata(tiny_onnx).fingerprint
    assert report.fingerprint == quantized_fingerprint(source, "attention-fusion")
    assert report.fingerprint != quantized_fingerprint(source)
    assert read_model_metadata(tmp_path / "m.opt.int8.onnx").fingerprint == report.fingerprint


def test_an_index_built_with_the_plain_model_is_searched_with_the_fused_one(
    tmp_path, tiny_onnx, digits_gallery, capsys
):
    optimised = tmp_path / "m.opt.onnx"
    optimize_model(tiny_onnx, optimised)
    query = sorted(digits_gallery["images"].rglob("*.png"))[0]
    code, out, err = run(
        capsys, "search", digits_gallery["index"], query, "-k", "1", "--json", "--model", optimised
    )
    assert code == 0, err
    top = json.loads(out)[0]["hits"][0]
    assert top["key"] == query.relative_to(digits_gallery["images"]).as_posix()
    assert top["score"] == pytest.approx(1.0, abs=1e-5)
