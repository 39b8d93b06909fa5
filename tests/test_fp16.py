"""`vitrieval-index quantize --to fp16`: the GPU serving form of a model (float16
weights and activations, float32 input and output, its own fingerprint)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import pytest
from PIL import Image

from vitrieval.index.cli import main
from vitrieval.index.runtime.embedder import Embedder


def photos() -> list[Image.Image]:
    rng = np.random.default_rng(5)
    return [Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)) for _ in range(4)]


def test_fp16_keeps_the_contract_and_agrees_with_fp32(tiny_onnx, tmp_path, capsys) -> None:
    out = tmp_path / "tiny.fp16.onnx"
    assert main(["quantize", "--model", str(tiny_onnx), "--out", str(out), "--to", "fp16"]) == 0
    assert "(fp16)" in capsys.readouterr().out
    proto = onnx.load(str(out))
    halves = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16]
    singles = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    assert len(halves) > 10 and not [t for t in singles if np.prod(t.dims) > 1]
    elem = onnx.TensorProto.FLOAT
    assert proto.graph.input[0].type.tensor_type.elem_type == elem  # the contract's input
    assert proto.graph.output[0].type.tensor_type.elem_type == elem
    props = {p.key: json.loads(p.value) for p in proto.metadata_props}
    source = {p.key: json.loads(p.value) for p in onnx.load(str(tiny_onnx)).metadata_props}
    original = source["vitrieval.fingerprint"]
    assert props["vitrieval.fingerprint"] == hashlib.sha256(f"{original}:fp16".encode()).hexdigest()
    assert props["vitrieval.quantization"] == "fp16"
    assert props["vitrieval.source_fingerprint"] == original
    assert out.stat().st_size < 0.6 * tiny_onnx.stat().st_size

    half = Embedder(out, device="cpu")  # ONNX Runtime's CPU runs it too (slowly on x86)
    reference = Embedder(tiny_onnx, device="cpu").embed_images(photos())
    got = half.embed_images(photos())
    assert half.fingerprint == props["vitrieval.fingerprint"] != original
    assert got.dtype == np.float32 and not np.array_equal(got, reference)
    assert np.sum(got * reference, axis=1).min() > 0.999


def test_an_unknown_target_is_refused(tiny_onnx, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["quantize", "--model", str(tiny_onnx), "--out", str(tmp_path / "x.onnx"),
              "--to", "int4"])  # fmt: skip
    assert stopped.value.code == 2 and "invalid choice" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
