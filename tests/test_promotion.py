"""`vitrieval-index promote` (index/promotion.py): an alias moves to a candidate
collection only when the candidate's leave-one-out metric is at least the current
one's plus the gain asked for; a switch meanwhile is not overwritten."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py

from vitrieval.index.collections import MODELS_DIR, DataFolder, NameTaken
from vitrieval.index.promotion import promote, wins
from vitrieval.index.store import IndexStore, StoreError

LABELS = [f"c{i % 4}" for i in range(80)]


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture
def data(tmp_path: Path, tiny_onnx: Path, tiny_onnx_other: Path) -> DataFolder:
    """v1 (random vectors: a poor model) and v2 (the same items, vectors clustered by
    label: a good one), alias prod -> v1."""
    folder = DataFolder(tmp_path)
    shutil.copy(tiny_onnx, tmp_path / MODELS_DIR / "old.onnx")
    shutil.copy(tiny_onnx_other, tmp_path / MODELS_DIR / "new.onnx")
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((4, 128))
    clustered = unit(
        np.stack([centres[i % 4] for i in range(80)]) + 0.3 * rng.standard_normal((80, 128))
    )
    keys = [f"item/{i:03d}" for i in range(80)]
    for name, model, vectors in (("v1", "old.onnx", unit(rng.standard_normal((80, 128)))),
                                 ("v2", "new.onnx", clustered)):  # fmt: skip
        folder.create(name, model)
        with IndexStore.open(folder.path(name)) as store:
            store.add(keys, vectors, labels=LABELS)
            store.save()
    folder.set_alias("prod", "v1")
    return folder


def test_a_better_candidate_is_promoted_and_a_worse_one_is_not(data: DataFolder) -> None:
    kept = promote(data, "prod", "v2", min_gain=1.0)  # better, but not by a whole 1.0
    assert not kept.switched and data.resolve("prod") == "v1"
    won = promote(data, "prod", "v2")
    assert won.switched and data.resolve("prod") == "v2"
    assert won.candidate.metrics["map"] > won.current.metrics["map"]
    assert won.current.metrics["n_items"] == won.candidate.metrics["n_items"] == 80
    lost = promote(data, "prod", "v1", metric="recall@1")
    assert not lost.switched and data.resolve("prod") == "v2"
    assert "kept prod on v2" in lost.summary()
    with pytest.raises(StoreError, match="no metric 'ndcg'"):
        promote(data, "prod", "v1", metric="ndcg")


def test_the_decision_rule() -> None:
    assert wins({"map": 0.5}, {"map": 0.5}, "map", 0.0)
    assert not wins({"map": 0.5}, {"map": 0.55}, "map", 0.1)
    assert not wins({"map": float("nan")}, {"map": 0.9}, "map", 0.0)
    assert not wins({"map": 0.5}, {"map": None}, "map", 0.0)


def test_a_switch_meanwhile_is_not_overwritten(data: DataFolder) -> None:
    data.set_alias("prod", "v2")  # someone else, after our evaluation read "v1"
    with pytest.raises(NameTaken, match="switched meanwhile"):
        data.set_alias("prod", "v2", expected="v1")
    assert data.resolve("prod") == "v2"


def test_the_command(data: DataFolder, capsys) -> None:
    code, out, err = run(capsys, "promote", data.root, "prod", "v2", "--json", "--ks", 1, 4)
    assert code == 0, err
    answer = json.loads(out)
    assert answer["switched"] and "recall@4" in answer["candidate"]
    code, _, err = run(capsys, "promote", data.root, "nope", "v2")
    assert code == 2 and "no alias named 'nope'" in err
