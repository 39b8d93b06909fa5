"""`fit --method lacvit | ce`: LaCViT's two stages and the cross-entropy baseline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file
from sklearn.datasets import load_digits
from torch import nn

from vitrieval.index.evaluation.datasets import load_dataset
from vitrieval.index.evaluation.metrics import isotropy_score
from vitrieval.index.runtime.model_metadata import read_model_metadata
from vitrieval.training.augment import TwoViews, contrastive_view_transform, light_transform
from vitrieval.training.cli import main
from vitrieval.training.config import FitConfig
from vitrieval.training.data import build_transforms
from vitrieval.training.evaluate import embed_items
from vitrieval.training.lacvit import (
    Data,
    LinearClassifier,
    ProjectionHead,
    encoder_scores,
    top1_accuracy,
    train_probe,
)
from vitrieval.training.model import build_model

CLASSES = 4
PER_CLASS = 16


@pytest.fixture(scope="module")
def digit_folder(tmp_path_factory):
    """4 digit classes x 16 real handwritten digits as 32 px PNGs, a folder per class:
    small enough for a whole two-stage run in seconds."""
    root = tmp_path_factory.mktemp("digits4")
    digits = load_digits()
    for c in range(CLASSES):
        (root / f"d{c}").mkdir()
        images = digits.images[digits.target == c][:PER_CLASS]
        for i, image in enumerate(images):
            pixels = (image * (255 / 16)).astype(np.uint8)
            Image.fromarray(pixels).resize((32, 32), Image.BICUBIC).convert("RGB").save(
                root / f"d{c}" / f"{i:02d}.png"
            )
    return root


def fast_args(root, out, method="lacvit", *extra):
    return [
        "fit",
        "--method",
        method,
        "--dataset",
        "folder",
        "--data-root",
        str(root),
        "--preset",
        "tiny",
        "--batch-size",
        "16",
        "--warmup-epochs",
        "0",
        "--eval-batch-size",
        "64",
        "--out",
        str(out),
        *extra,
    ]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_lacvit_run_writes_both_stages_and_exports(digit_folder, tmp_path, capsys):
    run = tmp_path / "run"
    args = fast_args(digit_folder, run, "lacvit", "--epochs", "2", "--probe-epochs", "3")
    assert main(args) == 0
    rows = _rows(run)
    assert [(r["stage"], r["epoch"]) for r in rows] == [
        ("initial", 0),
        ("contrastive", 1),
        ("contrastive", 2),
        ("probe", 1),
        ("probe", 2),
        ("probe", 3),
    ]
    n_test = CLASSES * 5  # ceil(0.3 * 16) held out per class
    for r in rows:
        assert 0.0 <= r["map"] <= 1.0 and 0.0 <= r["recall@1"] <= 1.0
        assert 0.0 < r["isotropy"] <= 1.0
        assert r["n_queries"] == n_test
    for r in rows[1:3]:
        assert r["loss"] > 0 and "top1" not in r  # SupCon; no classifier in stage 1
    probe_rows = rows[3:]
    for r in probe_rows:
        assert r["top1"] is not None and 0.0 <= r["top1"] <= 1.0
        # the frozen encoder's retrieval after stage 2 is that after stage 1
        assert r["recall@1"] == pytest.approx(rows[2]["recall@1"], abs=1e-9)
        assert r["isotropy"] == pytest.approx(rows[2]["isotropy"], rel=1e-6)
    assert probe_rows[-1]["loss"] < probe_rows[0]["loss"]
    assert probe_rows[-1]["train_top1"] > 1 / CLASSES  # the probe fits its training data

    results = json.loads((run / "results.json").read_text())
    assert results["method"] == "lacvit"
    assert results["top1"] == probe_rows[-1]["top1"]
    assert results["initial_isotropy"] == rows[0]["isotropy"]

    # The run's model is the encoder alone: no projection-head weights, and it exports.
    weights = load_file(str(run / "model.safetensors"))
    assert not any(key.startswith(("net.", "head.")) for key in weights)
    assert set(weights) == set(load_file(str(run / "initial.safetensors")))
    with safe_open(str(run / "classifier.safetensors"), framework="pt") as fh:
        assert json.loads(fh.metadata()["classes"]) == [f"d{c}" for c in range(CLASSES)]
        assert fh.get_tensor("fc.weight").shape == (CLASSES, 128)
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    assert state["stage"] == "contrastive" and state["epoch"] == 2
    assert "done: lacvit" in capsys.readouterr().out

    onnx_path = tmp_path / "encoder.onnx"
    assert main(["export", "--run", str(run), "--out", str(onnx_path)]) == 0
    assert read_model_metadata(onnx_path).embedding_dim == 128


def test_lacvit_resume_continues_stage_one_exactly(digit_folder, tmp_path):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    # epoch 1 all warm-up: its learning rates do not depend on the total epoch count,
    # so the 1-epoch run's first epoch is the 2-epoch run's (as a crash would leave it)
    probe = ["--probe-epochs", "1", "--warmup-epochs", "1"]
    assert main(fast_args(digit_folder, straight, "lacvit", "--epochs", "2", *probe)) == 0
    assert main(fast_args(digit_folder, broken, "lacvit", "--epochs", "1", *probe)) == 0
    assert main(["fit", "--out", str(broken), "--resume", "--epochs", "2"]) == 0
    a = load_file(str(straight / "model.safetensors"))
    b = load_file(str(broken / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0, msg=key)
    stages = [(r["stage"], r["epoch"]) for r in _rows(broken)]
    assert stages == [("initial", 0), ("contrastive", 1), ("contrastive", 2), ("probe", 1)]


@pytest.mark.parametrize("method", ["ce", "lacvit"])
def test_the_same_seed_trains_the_same_run(digit_folder, tmp_path, method):
    """Two runs with one seed: the same metrics rows (but for timings), encoder and
    classifier, bit for bit (for lacvit, the probe's epoch included)."""
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        extra = ("--epochs", "1", "--probe-epochs", "1", "--seed", "7")
        assert main(fast_args(digit_folder, run, method, *extra)) == 0
    timings = ("train_seconds", "train_images_per_s")
    a, b = ([{k: v for k, v in r.items() if k not in timings} for r in _rows(run)] for run in runs)
    assert a == b and len(a) == {"ce": 2, "lacvit": 3}[method]  # initial, stage 1, probe
    for name in ("model.safetensors", "classifier.safetensors"):
        first, second = (load_file(str(run / name)) for run in runs)
        assert first.keys() == second.keys()
        for key in first:
            torch.testing.assert_close(first[key], second[key], atol=0, rtol=0, msg=key)


def test_ce_baseline_trains_encoder_and_head_end_to_end(digit_folder, tmp_path):
    run = tmp_path / "ce"
    assert main(fast_args(digit_folder, run, "ce", "--epochs", "2")) == 0
    rows = _rows(run)
    assert [(r["stage"], r["epoch"]) for r in rows] == [
        ("initial", 0),
        ("finetune", 1),
        ("finetune", 2),
    ]
    assert all(0.0 <= r["top1"] <= 1.0 for r in rows[1:])
    initial = load_file(str(run / "initial.safetensors"))
    final = load_file(str(run / "model.safetensors"))
    assert any(not torch.equal(initial[k], final[k]) for k in initial)  # the encoder trained
    results = json.loads((run / "results.json").read_text())
    assert results["method"] == "ce" and results["probe_seconds"] == 0.0
    assert results["top1"] == rows[-1]["top1"]


def test_the_two_views_of_an_image_differ():
    model = build_model("tiny", "ggem")
    image = load_dataset("digits", image_size=32).train[0].open()
    views = TwoViews(contrastive_view_transform(model.data_config(), 0.8, 0.0))
    torch.manual_seed(0)
    first, second = views(image)
    assert first.shape == second.shape == (3, 32, 32) and first.dtype == torch.float32
    assert (first - second).abs().mean() > 0.05
    torch.manual_seed(0)  # the draws come from torch's RNG: reseeding repeats them
    again = views(image)
    torch.testing.assert_close(again[0], first)
    torch.testing.assert_close(again[1], second)
    # the eval transform is deterministic and lies in the same normalised range
    _, eval_tf = build_transforms(model.data_config(), 1.0, 0.0)
    assert float(eval_tf(image).min()) >= -1.0 - 1e-6 and float(first.min()) >= -1.0 - 1e-6


def test_light_transform_only_crops_and_flips():
    config = build_model("tiny", "ggem").data_config()
    image = load_dataset("digits", image_size=32).train[3].open()
    _, eval_tf = build_transforms(config, 1.0, 0.0)
    # A "crop" of the whole image (scale 1: every other aspect ratio does not fit, and
    # torchvision falls back to the whole image) flipped with certainty: the evaluation
    # input mirrored, no colour change.
    torch.manual_seed(0)
    out = light_transform(config, 1.0, 1.0)(image)
    torch.testing.assert_close(out, eval_tf(image).flip(-1), atol=1e-5, rtol=0)


def test_projection_head_is_two_layer_mlp_to_128_unit_vectors():
    torch.manual_seed(0)
    head = ProjectionHead(192, 128)
    assert [type(m) for m in head.net] == [nn.Linear, nn.ReLU, nn.Linear]
    assert head.net[0].weight.shape == (192, 192) and head.net[2].weight.shape == (128, 192)
    h = torch.nn.functional.normalize(torch.randn(6, 192), dim=1)
    z = head(h)
    assert z.shape == (6, 128)
    torch.testing.assert_close(z.norm(dim=1), torch.ones(6))
    # z = normalise(W2 relu(W1 h + b1) + b2), by hand
    by_hand = head.net[2](torch.relu(head.net[0](h)))
    torch.testing.assert_close(z, by_hand / by_hand.norm(dim=1, keepdim=True))


def _small_data(model, n_train=120, n_test=60):
    split = load_dataset("digits", image_size=32)
    config = model.data_config()
    _, eval_tf = build_transforms(config, 1.0, 0.0)
    train, test = split.train[:n_train], split.test[:n_test]
    return Data(train, test, sorted({i.label for i in train}), eval_tf, config)


def test_stage_two_leaves_the_encoder_unchanged(tmp_path):
    torch.manual_seed(0)
    model = build_model("tiny", "ggem", drop_path_rate=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = _small_data(model)
    cfg = FitConfig(out=str(tmp_path), probe_epochs=3, batch_size=32, workers=0).resolved()
    seen = []
    probe, last = train_probe(model, data, cfg, torch.device("cpu"), on_epoch=seen.append)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert all(not p.requires_grad for p in model.parameters())
    assert [r["epoch"] for r in seen] == [1, 2, 3] and last is seen[-1]
    assert seen[-1]["loss"] < seen[0]["loss"]
    # the reported top-1 is the probe's accuracy on the held-out embeddings
    emb = embed_items(model, data.test, data.eval_transform, 64, torch.device("cpu"))
    labels = [item.label for item in data.test]
    assert last["top1"] == pytest.approx(top1_accuracy(probe, emb, labels, data.class_to_index))
    assert last["isotropy"] == pytest.approx(isotropy_score(emb))
    assert last["top1"] > 0.3  # 10 classes: far above chance even on an untrained encoder


def test_linear_classifier_is_linear_in_eval_mode():
    torch.manual_seed(0)
    clf = LinearClassifier(8, 3)
    batch = torch.randn(64, 8) * 0.01 + 1  # tightly clustered, like an untrained encoder's
    clf(batch)
    # the first batch's statistics replace BatchNorm's (0, 1) start
    torch.testing.assert_close(clf.norm.running_mean, batch.mean(0))
    torch.testing.assert_close(clf.norm.running_var, batch.var(0))
    assert clf.norm.momentum == 0.1
    clf(batch + 1)  # later batches move the statistics by the usual momentum
    torch.testing.assert_close(clf.norm.running_mean, batch.mean(0) + 0.1)
    clf.eval()
    x, y = torch.randn(5, 8), torch.randn(5, 8)
    torch.testing.assert_close(clf(x + y) - clf(y), clf(x) - clf(torch.zeros(1, 8)))


def test_top1_skips_classes_the_classifier_never_saw():
    clf = nn.Linear(2, 2)
    with torch.no_grad():
        clf.weight.copy_(torch.eye(2))
        clf.bias.zero_()
    emb = np.array([[1, 0], [0, 1], [1, 0], [0, 1]], np.float32)
    assert top1_accuracy(clf, emb, ["a", "b", "b", "z"], {"a": 0, "b": 1}) == pytest.approx(2 / 3)
    assert top1_accuracy(clf, emb, ["y", "y", "z", "z"], {"a": 0, "b": 1}) is None


def test_encoder_scores_holds_retrieval_and_isotropy():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(40, 16)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    labels = [str(i % 4) for i in range(40)]
    scores = encoder_scores(emb, labels)
    assert scores["isotropy"] == pytest.approx(isotropy_score(emb))
    assert scores["n_queries"] == 40 and 0.0 <= scores["recall@1"] <= 1.0


@pytest.mark.parametrize("method", ["simclr", "LaCViT"])
def test_unknown_method_is_one_line_exit_2(tmp_path, capsys, method):
    code = main(["fit", "--method", method, "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"unknown --method {method!r}" in err and "metric, lacvit, ce" in err
    assert not (tmp_path / "x").exists()


def test_resume_of_another_method_is_refused(digit_folder, tmp_path, capsys):
    run = tmp_path / "ce"
    assert main(fast_args(digit_folder, run, "ce", "--epochs", "1")) == 0
    capsys.readouterr()
    code = main(["fit", "--out", str(run), "--resume", "--method", "lacvit", "--epochs", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "not a lacvit run" in err
