"""`vitrieval-train export --init-only`: untrained or `--pretrained` models exported
without a run, their parity with PyTorch, and external data for big weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from index_cli_helpers import run as run_index  # tests/index_cli_helpers.py
from safetensors.torch import save_file

import vitrieval.training.export as export_module
from vitrieval.index.evaluation.datasets import load_dataset
from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.runtime.model_metadata import read_model_metadata
from vitrieval.index.runtime.quantize import quantize_model
from vitrieval.training.cli import main
from vitrieval.training.config import FitConfig
from vitrieval.training.epochs import seed_everything
from vitrieval.training.export import export_model, model_metadata
from vitrieval.training.model import build_model, weights_fingerprint
from vitrieval.training.run_folder import model_from_config

VIT = "vit_tiny_patch16_224"  # the smallest timm ViT at its own 224 px input


def onnx_embed(path: Path, batch: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(["embeddings"], {"images": batch})
    return out


def torch_embed(model: torch.nn.Module, batch: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.from_numpy(batch)).numpy()


def random_batch(size: int, count: int = 4, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((count, 3, size, size)).astype(np.float32)


def test_preset_is_fits_starting_model_and_seeded(tmp_path, capsys):
    out = tmp_path / "a.onnx"
    assert main(["export", "--init-only", "--preset", "tiny", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tiny + ggem: random initialisation, seed 0" in printed
    assert "max |diff|" in printed
    meta = read_model_metadata(out)
    assert (meta.backbone, meta.pooling, meta.embedding_dim) == ("tiny", "ggem", 128)
    assert meta.input_size == (3, 32, 32)
    # the very model `fit --seed 0` starts training from
    seed_everything(0)
    start = model_from_config(FitConfig(out="unused"))
    assert meta.fingerprint == weights_fingerprint(start)
    np.testing.assert_allclose(
        onnx_embed(out, random_batch(32)), torch_embed(start, random_batch(32)), atol=1e-4
    )
    sidecar = json.loads((tmp_path / "a.export.json").read_text())
    assert sidecar["init_only"] is True and sidecar["seed"] == 0
    assert sidecar["fingerprint"] == meta.fingerprint and sidecar["external_data"] is None

    again, other = tmp_path / "b.onnx", tmp_path / "c.onnx"
    assert main(["export", "--init-only", "--preset", "tiny", "--out", str(again)]) == 0
    args = ["export", "--init-only", "--preset", "tiny", "--seed", "1", "--out", str(other)]
    assert main(args) == 0
    assert read_model_metadata(again).fingerprint == meta.fingerprint
    assert read_model_metadata(other).fingerprint != meta.fingerprint


def test_small_preset_with_pool_and_dim(tmp_path):
    out = tmp_path / "m.onnx"
    args = ["export", "--init-only", "--preset", "small", "--pool", "gem", "--dim", "24"]
    assert main([*args, "--seed", "4", "--out", str(out)]) == 0
    meta = read_model_metadata(out)
    assert (meta.pooling, meta.embedding_dim, meta.input_size) == ("gem", 24, (3, 64, 64))
    seed_everything(4)
    expected = model_from_config(FitConfig(out="unused", backbone="small", pool="gem", dim=24))
    np.testing.assert_allclose(
        onnx_embed(out, random_batch(64)), torch_embed(expected, random_batch(64)), atol=1e-4
    )


def test_timm_vit_random_and_from_a_state_dict(tmp_path, capsys):
    # a timm-style state dict of the backbone, with the classifier a hub file carries
    torch.manual_seed(123)
    donor = build_model(VIT, "avg").backbone
    state = {k: v.clone() for k, v in donor.state_dict().items()}
    state["head.weight"] = torch.randn(1000, 192)
    state["head.bias"] = torch.zeros(1000)
    weights = tmp_path / "vit.pth"
    torch.save(state, weights)

    loaded, fresh = tmp_path / "loaded.onnx", tmp_path / "fresh.onnx"
    common = ["export", "--init-only", "--backbone", VIT, "--pool", "ggem", "--dim", "32"]
    assert main([*common, "--seed", "3", "--pretrained", str(weights), "--out", str(loaded)]) == 0
    assert f"backbone weights from {weights}; head initialised with seed 3" in (
        capsys.readouterr().out
    )
    assert main([*common, "--seed", "3", "--out", str(fresh)]) == 0

    # expected: the same seeded model, its backbone replaced by the donor's weights
    seed_everything(3)
    expected = build_model(VIT, "ggem", dim=32)
    expected.backbone.load_state_dict(donor.state_dict())
    batch = random_batch(224, count=3)
    got = onnx_embed(loaded, batch)
    assert got.shape == (3, 32)
    np.testing.assert_allclose(got, torch_embed(expected, batch), atol=1e-4)
    meta = read_model_metadata(loaded)
    assert meta.backbone == VIT and meta.input_size == (3, 224, 224)
    assert meta.fingerprint == weights_fingerprint(expected)

    # without --pretrained: the seeded random backbone, which the file really replaced
    seed_everything(3)
    random_model = build_model(VIT, "ggem", dim=32)
    np.testing.assert_allclose(
        onnx_embed(fresh, batch), torch_embed(random_model, batch), atol=1e-4
    )
    assert np.abs(onnx_embed(fresh, batch) - got).max() > 1e-2


def test_a_vitrieval_weights_file_brings_its_head(tmp_path, capsys):
    torch.manual_seed(7)
    trained = build_model("tiny", "ggem", dim=16)
    with torch.no_grad():
        trained.pool.p.fill_(4.5)  # as if training had moved it
    weights = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(weights))

    out = tmp_path / "m.onnx"
    args = ["export", "--init-only", "--preset", "tiny", "--dim", "16"]
    assert main([*args, "--pretrained", str(weights), "--out", str(out)]) == 0
    assert "head from the file too (pool.p, proj.bias, proj.weight)" in capsys.readouterr().out
    assert read_model_metadata(out).fingerprint == weights_fingerprint(trained)
    np.testing.assert_allclose(
        onnx_embed(out, random_batch(32)), torch_embed(trained, random_batch(32)), atol=1e-4
    )


def test_weights_that_make_the_model_answer_nan_are_not_exported(tmp_path, capsys):
    # NaN differs from nothing: the parity check must not pass a model whose own
    # output is NaN
    broken = build_model("tiny", "ggem", dim=16)
    with torch.no_grad():
        broken.pool.p.fill_(float("nan"))
    weights = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in broken.state_dict().items()}, str(weights))
    args = ["export", "--init-only", "--preset", "tiny", "--dim", "16"]
    assert main([*args, "--pretrained", str(weights), "--out", str(tmp_path / "m.onnx")]) == 2
    assert "the PyTorch model's own output is not finite" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def test_an_index_built_with_the_exported_model(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    assert main(["export", "--init-only", "--preset", "tiny", "--out", str(model)]) == 0
    images = tmp_path / "images"
    items = [i for i in load_dataset("digits").train if i.label in {"0", "1"}][:12]
    for item in items:
        (images / item.label).mkdir(parents=True, exist_ok=True)
        item.open().save(images / item.label / f"{item.key.replace('/', '_')}.png")
    index = tmp_path / "index"
    build = ("build", "--model", model, "--images", images, "--labels-from-folders", "--out", index)
    code, out, _ = run_index(capsys, *build)
    assert code == 0 and "indexed 12 of 12 images" in out
    query = sorted(images.glob("1/*.png"))[0]
    code, out, _ = run_index(capsys, "search", index, query, "-k", "2", "--json")
    assert code == 0
    top = json.loads(out)[0]["hits"][0]
    assert top["key"] == query.relative_to(images).as_posix()
    assert top["score"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "give exactly one of --run RUN"),
        (["--run", "R", "--init-only"], "give exactly one of --run RUN"),
        (["--run", "R", "--pool", "avg", "--seed", "2"], "--pool, --seed: options of --init-only"),
        (["--init-only", "--backbone", "vit_nope"], "unknown backbone 'vit_nope'"),
        (["--init-only", "--pool", "avg", "--pool-groups", "2"], "--pool-groups is an option"),
        (["--init-only", "--dim", "0"], "--dim must be >= 1"),
        (["--init-only", "--pretrained", "missing.pth"], "--pretrained missing.pth: no such file"),
        (["--init-only", "--pool", "gem", "--pool-p", "nan"], "--pool-p must be a finite number"),
        (["--init-only", "--opset", "999"], "the ONNX exporter failed at opset 999"),
        (["--init-only", "--opset", "1"], "the ONNX exporter failed at opset 1"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, needle):
    assert main(["export", *argv, "--out", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitrieval-train export: error: ") and needle in err
    assert err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_out_a_folder_is_a_one_line_error(tmp_path, capsys):
    assert main(["export", "--init-only", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a folder: --out names the .onnx file to write" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_weights_that_do_not_fit_are_a_one_line_error(tmp_path, capsys):
    weights = tmp_path / "w.safetensors"
    save_file({"pos_embed": torch.zeros(1, 5, 7)}, str(weights))
    args = ["export", "--init-only", "--preset", "tiny", "--pretrained", str(weights)]
    assert main([*args, "--out", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert "do not fit the backbone" in err and err.count("\n") == 1
    assert not (tmp_path / "m.onnx").exists()


def test_external_data_beside_the_file(tmp_path, capsys, monkeypatch):
    torch.manual_seed(0)
    model = build_model("tiny", "ggem")
    meta = model_metadata(model, FitConfig(out="unused"))
    inline = export_model(model, meta, tmp_path / "inline.onnx")
    assert inline.data_path is None and not (tmp_path / "inline.onnx.data").exists()

    report = export_model(model, meta, tmp_path / "ext" / "m.onnx", external_data=True)
    onnx_file, data_file = tmp_path / "ext" / "m.onnx", tmp_path / "ext" / "m.onnx.data"
    assert report.data_path == data_file and "weights in m.onnx.data" in report.summary()
    assert sorted(p.name for p in (tmp_path / "ext").iterdir()) == ["m.onnx", "m.onnx.data"]
    assert onnx_file.stat().st_size < 100_000 < data_file.stat().st_size
    assert report.bytes == onnx_file.stat().st_size + data_file.stat().st_size
    # both with the mode of a new file (onnx itself writes the data owner-only)
    assert data_file.stat().st_mode == onnx_file.stat().st_mode == inline.path.stat().st_mode
    assert read_model_metadata(onnx_file) == meta
    batch = random_batch(32)
    np.testing.assert_array_equal(onnx_embed(onnx_file, batch), onnx_embed(inline.path, batch))
    embedder = Embedder(onnx_file, device="cpu")
    np.testing.assert_allclose(embedder.embed_arrays(batch), torch_embed(model, batch), atol=1e-4)

    quantized = quantize_model(onnx_file, tmp_path / "m.int8.onnx")
    assert quantized.bytes_before == report.bytes and quantized.min_cosine > 0.99

    # the CLI moves weights out on its own past the threshold (2 GB; lowered here)
    monkeypatch.setattr(export_module, "EXTERNAL_DATA_THRESHOLD", 1000)
    out = tmp_path / "cli" / "big.onnx"
    assert main(["export", "--init-only", "--preset", "tiny", "--out", str(out)]) == 0
    assert "weights in big.onnx.data" in capsys.readouterr().out
    assert (tmp_path / "cli" / "big.onnx.data").is_file()
    assert json.loads((tmp_path / "cli" / "big.export.json").read_text())["external_data"] == (
        "big.onnx.data"
    )
    np.testing.assert_allclose(onnx_embed(out, batch), onnx_embed(inline.path, batch), atol=1e-6)
