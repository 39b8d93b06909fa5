"""`fit` on a split the user prepared (`--val`), without a held-out split
(`--test-fraction 0`) and without training (`--epochs 0`)."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import vitrieval.training.data as data_module
from vitrieval.index.evaluation.datasets import load_dataset
from vitrieval.training.cli import main

FAST = ["--preset", "tiny", "--batch-size", "64", "--workers", "0", "--warmup-epochs", "1"]
N_TRAIN, N_VAL = 40, 20  # 4 and 2 images of each digit


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, Path]:
    """Digits written as PNG files: train/ and val/ folders (one sub-folder per digit)
    and TRAIN.csv / VAL.csv listing the same files."""
    root = tmp_path_factory.mktemp("prepared")
    items = load_dataset("digits", image_size=32).train
    per_class: dict[str, list] = {}
    for item in items:
        per_class.setdefault(item.label, []).append(item)
    lists = {"train": [], "val": []}
    for label, members in sorted(per_class.items()):
        for side, chosen in (("train", members[:4]), ("val", members[4:6])):
            for item in chosen:
                path = root / side / label / (item.key.replace("/", "_") + ".png")
                path.parent.mkdir(parents=True, exist_ok=True)
                item.open().save(path)
                lists[side].append((path.relative_to(root).as_posix(), label))
    for side, rows in lists.items():
        with open(root / f"{side.upper()}.csv", "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["path", "label"])
            writer.writerows(rows)
    assert len(lists["train"]) == N_TRAIN and len(lists["val"]) == N_VAL
    return {
        "TRAIN.csv": root / "TRAIN.csv",
        "VAL.csv": root / "VAL.csv",
        "train": root / "train",
        "val": root / "val",
    }


@pytest.fixture
def fetched(monkeypatch) -> Counter:
    """Counts every image the training and evaluation loaders read, by file path."""
    seen: Counter = Counter()
    original = data_module.ImageDataset.__getitem__

    def counting(self, index):
        seen[self.items[index].path] += 1
        return original(self, index)

    monkeypatch.setattr(data_module.ImageDataset, "__getitem__", counting)
    return seen


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("dataset", "train", "val"), [("csv", "TRAIN.csv", "VAL.csv"), ("folder", "train", "val")]
)
def test_fit_trains_on_every_training_row_and_evaluates_on_val(
    tmp_path, capsys, prepared, fetched, dataset, train, val
):
    run = tmp_path / "run"
    argv = ["fit", "--dataset", dataset, "--data-root", str(prepared[train])]
    code = main([*argv, "--val", str(prepared[val]), "--epochs", "1", *FAST, "--out", str(run)])
    assert code == 0, capsys.readouterr().err
    # every training image read once in the epoch (one batch of 40), nothing of val
    trained = {p: n for p, n in fetched.items() if prepared["train"] in p.parents}
    evaluated = {p: n for p, n in fetched.items() if prepared["val"] in p.parents}
    assert len(trained) == N_TRAIN and set(trained.values()) == {1}
    assert len(evaluated) == N_VAL and set(evaluated.values()) == {1}
    assert len(fetched) == N_TRAIN + N_VAL
    (row,) = _rows(run)
    # leave-one-out over VAL: every one of its rows is a query with a same-digit image
    assert row["n_queries"] == N_VAL and row["n_dropped"] == 0
    assert 0.0 <= row["recall@1"] <= 1.0
    out = capsys.readouterr().out
    assert f"on {dataset}/val ({N_TRAIN} train / {N_VAL} held-out images, 10 classes)" in out
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["val"] == str(prepared[val]) and saved["test_fraction"] == 0.3


def test_epochs_0_saves_and_evaluates_the_initial_model_and_resumes(tmp_path, capsys, prepared):
    from vitrieval.training.config import FitConfig
    from vitrieval.training.export import init_only_model

    data = ["--dataset", "csv", "--data-root", str(prepared["TRAIN.csv"])]
    data += ["--val", str(prepared["VAL.csv"])]
    run = tmp_path / "run"
    assert main(["fit", *data, *FAST, "--epochs", "0", "--out", str(run)]) == 0
    (row,) = _rows(run)
    assert row["epoch"] == 0 and row["loss"] is None
    assert row["n_queries"] == N_VAL and 0.0 < row["recall@1"] <= 1.0
    assert "epoch 0 (the initial model): R@1" in capsys.readouterr().out
    # the weights are the model fit starts from, as `export --init-only` builds it
    initial, _ = init_only_model(FitConfig(out="", backbone="tiny", seed=0))
    saved = load_file(str(run / "model.safetensors"))
    assert saved.keys() == initial.state_dict().keys()
    for key, value in initial.state_dict().items():
        torch.testing.assert_close(saved[key], value, atol=0, rtol=0, msg=key)
    assert json.loads((run / "checkpoint" / "state.json").read_text())["epoch"] == 0
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "m.onnx"), "--no-check"]) == 0

    # --resume reads --val back from config.yaml and trains on: the same weights as a
    # run of one epoch from the start
    assert main(["fit", "--out", str(run), "--resume", "--epochs", "1"]) == 0
    straight = tmp_path / "straight"
    assert main(["fit", *data, *FAST, "--epochs", "1", "--out", str(straight)]) == 0
    a, b = load_file(str(run / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0, msg=key)
    rows = _rows(run)
    assert [r["epoch"] for r in rows] == [0, 1]
    assert rows[1]["n_queries"] == N_VAL and rows[1]["loss"] == _rows(straight)[0]["loss"]
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_test_fraction_0_trains_on_everything_without_evaluation(
    tmp_path, capsys, prepared, fetched
):
    run = tmp_path / "run"
    data = ["--dataset", "csv", "--data-root", str(prepared["TRAIN.csv"])]
    code = main(["fit", *data, "--test-fraction", "0", *FAST, "--epochs", "1", "--out", str(run)])
    assert code == 0, capsys.readouterr().err
    assert len(fetched) == N_TRAIN and set(fetched.values()) == {1}  # trained on, no eval
    (row,) = _rows(run)
    assert row["epoch"] == 1 and row["loss"] > 0
    assert not {"recall@1", "map", "n_queries"} & set(row)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "no evaluation" in line]
    assert lines == [
        f"no held-out split (--test-fraction 0): training on all {N_TRAIN} images, no evaluation"
    ]
    assert "(40 train / 0 held-out images" in out
    assert (run / "model.safetensors").is_file()

    # with --epochs 0 too: the initial model saved, nothing measured
    bare = tmp_path / "bare"
    code = main(["fit", *data, "--test-fraction", "0", *FAST, "--epochs", "0", "--out", str(bare)])
    assert code == 0
    assert [set(r) for r in _rows(bare)] == [{"epoch", "loss", "lr"}]
    assert (bare / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--epochs", "-1"], "--epochs must be >= 0, got -1"),
        (["--test-fraction", "1"], "--test-fraction must lie in [0, 1), got 1.0"),
        (["--val", "VAL.csv"], "--val applies to --dataset folder and csv, not digits"),
        (
            [
                "--dataset",
                "csv",
                "--data-root",
                "TRAIN.csv",
                "--val",
                "VAL.csv",
                "--test-fraction",
                "0.2",
            ],
            "--test-fraction: not with --val",
        ),
        (
            [
                "--dataset",
                "csv",
                "--data-root",
                "TRAIN.csv",
                "--val",
                "VAL.csv",
                "--split",
                "disjoint",
            ],
            "--split: not with --val",
        ),
        (
            ["--dataset", "csv", "--data-root", "TRAIN.csv", "--val", "/nonexistent/v.csv"],
            "/nonexistent/v.csv: CSV list not found",
        ),
        (["--test-fraction", "0", "--split", "disjoint"], "--test-fraction 0 applies to strat"),
        (["--method", "lacvit", "--epochs", "0"], "--epochs 0 applies to --method metric"),
        (["--method", "ce", "--test-fraction", "0"], "--method ce reports held-out results"),
    ],
)
def test_bad_combinations_are_one_line(tmp_path, capsys, prepared, args, needle):
    names = {"TRAIN.csv": str(prepared["TRAIN.csv"]), "VAL.csv": str(prepared["VAL.csv"])}
    run = tmp_path / "run"
    argv = ["fit", *(names.get(a, a) for a in args), "--out", str(run), "--workers", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
    assert not run.exists()  # nothing of value: the folder fit created is gone
