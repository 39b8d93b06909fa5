"""`vitrieval-train analyze`: similarity and projection PNGs, isotropy and pair cosines."""

from __future__ import annotations

import json
from math import comb

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from vitrieval.index.evaluation.datasets import load_dataset
from vitrieval.index.evaluation.metrics import isotropy_score, retrieval_metrics
from vitrieval.training.analyze import centered, pair_cosines
from vitrieval.training.checkpoint import save_tensors
from vitrieval.training.cli import main
from vitrieval.training.config import FitConfig
from vitrieval.training.data import build_transforms
from vitrieval.training.evaluate import embed_items
from vitrieval.training.export import export_model, load_run_model, model_metadata
from vitrieval.training.model import build_model

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A run folder (config.yaml + model.safetensors, untrained tiny ViT) on a folder of
    4 digit classes x 16 images, plus a second weights file in it and its ONNX export."""
    base = tmp_path_factory.mktemp("analyze")
    root = base / "digits4"
    digits = load_digits()
    for c in range(4):
        (root / str(c)).mkdir(parents=True)
        for i, image in enumerate(digits.images[digits.target == c][:16]):
            pixels = (image * (255 / 16)).astype(np.uint8)
            Image.fromarray(pixels).resize((32, 32), Image.BICUBIC).convert("RGB").save(
                root / str(c) / f"{i:02d}.png"
            )
    run = base / "run"
    run.mkdir()
    cfg = FitConfig(out=str(run), dataset="folder", data_root=str(root), backbone="tiny", dim=32)
    cfg.resolved().save(run / "config.yaml")
    torch.manual_seed(0)
    model = build_model("tiny", "ggem", dim=32)
    save_tensors(run / "model.safetensors", model.state_dict())
    torch.manual_seed(1)
    save_tensors(run / "other.safetensors", build_model("tiny", "ggem", dim=32).state_dict())
    onnx_path = base / "model.onnx"
    export_model(model.eval(), model_metadata(model, cfg), onnx_path)
    return run, root, onnx_path


def _held_out_embeddings(run, root):
    model, _ = load_run_model(run)
    items = load_dataset("folder", root, test_fraction=0.3, seed=0, image_size=32).test
    _, eval_tf = build_transforms(model.data_config(), 1.0, 0.0)
    return embed_items(model, items, eval_tf, 64, torch.device("cpu")), [i.label for i in items]


def test_analyze_run_writes_pngs_and_scores(tiny_run, tmp_path, capsys):
    run, root, _ = tiny_run
    out = tmp_path / "out"
    assert main(["analyze", "--model", str(run), "--out", str(out), "--projection", "pca"]) == 0
    for name in ("similarity.png", "projection.png"):
        assert (out / name).read_bytes()[:8] == PNG
        assert Image.open(out / name).size[0] == 460  # one panel
    report = json.loads((out / "analysis.json").read_text())
    assert report["dataset"] == "folder" and report["seed"] == 0  # the run's own split
    (entry,) = report["models"]
    assert entry["name"] == "run" and entry["kind"] == "run" and entry["embedding_dim"] == 32
    # 4 classes x 5 held-out images: 4 * C(5, 2) positive pairs, the rest negative
    assert entry["n_items"] == 20
    assert entry["n_positive_pairs"] == 4 * comb(5, 2) == 40
    assert entry["n_negative_pairs"] == comb(20, 2) - 40

    emb, labels = _held_out_embeddings(run, root)
    assert entry["isotropy"] == pytest.approx(isotropy_score(emb), rel=1e-6)
    assert entry["isotropy_centered"] == pytest.approx(isotropy_score(centered(emb)), rel=1e-6)
    assert 0.0 < entry["isotropy"] <= 1.0 and 0.0 < entry["isotropy_centered"] <= 1.0
    sims = emb @ emb.T
    same = np.array(labels)[:, None] == np.array(labels)[None, :]
    upper = np.triu(np.ones_like(same), k=1)
    assert entry["mean_positive_cosine"] == pytest.approx(sims[same & upper].mean(), abs=1e-5)
    assert entry["mean_negative_cosine"] == pytest.approx(sims[~same & upper].mean(), abs=1e-5)
    assert -1.0 <= entry["mean_negative_cosine"] <= 1.0
    expected = retrieval_metrics(emb, labels, ks=(1,))
    assert entry["recall@1"] == expected["recall@1"] and entry["map"] == expected["map"]
    assert 0.0 <= entry["recall@1"] <= 1.0 and 0.0 <= entry["map"] <= 1.0
    printed = capsys.readouterr().out
    assert f"isotropy {entry['isotropy']:.4f}" in printed and "wrote" in printed


def test_analyze_compares_weights_and_onnx_side_by_side(tiny_run, tmp_path):
    run, _, onnx_path = tiny_run
    out = tmp_path / "cmp"
    args = ["analyze", "--model", str(run / "other.safetensors"), "--model", str(run)]
    assert main([*args, "--compare", str(onnx_path), "--out", str(out)]) == 0  # t-SNE
    models = json.loads((out / "analysis.json").read_text())["models"]
    assert [m["name"] for m in models] == ["run/other", "run", "model"]
    assert [m["kind"] for m in models] == ["run", "run", "onnx"]
    # the exported model embeds as PyTorch does: same scores through ONNX Runtime
    assert models[2]["isotropy"] == pytest.approx(models[1]["isotropy"], abs=1e-4)
    assert models[2]["mean_positive_cosine"] == pytest.approx(
        models[1]["mean_positive_cosine"], abs=1e-4
    )
    assert models[2]["recall@1"] == models[1]["recall@1"]
    assert models[0]["isotropy"] != pytest.approx(models[1]["isotropy"], rel=1e-6)
    # three panels side by side, 460 px each
    assert Image.open(out / "similarity.png").size[0] == 3 * 460
    assert Image.open(out / "projection.png").size[0] == 3 * 460


def test_pair_cosines_by_hand():
    emb = np.array([[1, 0], [0, 1], [1, 1], [-1, 0]], np.float64)
    pos, neg = pair_cosines(emb, ["a", "a", "b", "b"])
    np.testing.assert_allclose(pos, [0.0, -np.sqrt(0.5)])  # pairs (0, 1) and (2, 3)
    np.testing.assert_allclose(
        sorted(neg), sorted([np.sqrt(0.5), -1.0, np.sqrt(0.5), 0.0])
    )  # (0, 2) (0, 3) (1, 2) (1, 3)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "/nonexistent/model.txt"], "expected a run folder"),
        (["--model", "/nonexistent/model.onnx"], "model file not found"),
        (["--names", "a,b"], "--names has 2 names for 1 models"),
        (["--max-items", "1"], "--max-items must be >= 2"),
    ],
)
def test_analyze_user_errors_are_one_line(tiny_run, tmp_path, capsys, args, needle):
    run, _, _ = tiny_run
    base = [] if "--model" in args else ["--model", str(run)]
    assert main(["analyze", *base, *args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_onnx_alone_needs_a_dataset(tiny_run, tmp_path, capsys):
    _, _, onnx_path = tiny_run
    assert main(["analyze", "--model", str(onnx_path), "--out", str(tmp_path / "o")]) == 2
    assert "--dataset is required" in capsys.readouterr().err
