"""`vitrieval-index reembed` (index/reembed.py): a new index of an index's items with
another model, equal to embedding their files with it; items without an image listed;
a run killed by SIGKILL and started again ends with the unbroken run's index."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py

from vitrieval.index.reembed import REPORT_FILE
from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.store import IndexStore


@pytest.fixture
def source(digits_gallery: dict[str, Path], tmp_path: Path) -> Path:
    """The digits gallery (120 items with files) plus one item added as a vector and one
    whose file is gone."""
    index = tmp_path / "src"
    shutil.copytree(digits_gallery["index"], index)
    gone = tmp_path / "gone.png"
    shutil.copy(next(digits_gallery["images"].rglob("*.png")), gone)
    with IndexStore.open(index) as store:
        store.add(["vector-only"], np.eye(store.dim, dtype=np.float32)[:1])
        store.add(["gone"], np.eye(store.dim, dtype=np.float32)[1:2], paths=[str(gone)])
        store.save()
    gone.unlink()
    return index


def contents(index: Path) -> dict[str, tuple]:
    with IndexStore.open(index) as store:
        return {
            key: (r.label, r.metadata, r.path, r.vector.tobytes())
            for key in list(store.keys())
            if (r := store.get(key)) is not None
        }


def test_every_item_is_embedded_again_by_the_new_model(
    source: Path, tiny_onnx_other: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "dst"
    code, stdout, err = run(capsys, "reembed", source, "--model", tiny_onnx_other, "--out", out)
    assert code == 0, err
    assert "2 without an image left out" in stdout
    old, new = contents(source), contents(out)
    assert set(new) == set(old) - {"vector-only", "gone"} and len(new) == 120
    paths = [new[key][2] for key in sorted(new)]
    expected = Embedder(tiny_onnx_other).embed_sources(paths).embeddings
    for key, vector in zip(sorted(new), expected, strict=True):
        label, metadata, path, raw = new[key]
        assert (label, metadata, path) == old[key][:3]
        assert np.allclose(np.frombuffer(raw, np.float32), vector, atol=1e-6)
    with IndexStore.open(out) as store:
        assert store.fingerprint == Embedder(tiny_onnx_other).fingerprint
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["no_image"] == ["vector-only"] and report["image_gone"][0]["key"] == "gone"
    # the same model: refused; --out = SRC: refused
    code, _, err = run(capsys, "reembed", out, "--model", tiny_onnx_other, "--out", tmp_path / "x")
    assert code == 2 and "same fingerprint" in err


def test_a_killed_run_resumes_to_the_unbroken_result(
    source: Path, tiny_onnx_other: Path, tmp_path: Path, capsys
) -> None:
    whole = tmp_path / "whole"
    argv = ["reembed", source, "--model", tiny_onnx_other, "--save-every", 8]
    assert run(capsys, *argv, "--out", whole)[0] == 0
    broken = tmp_path / "broken"
    command = [sys.executable, "-m", "vitrieval.index.cli", *map(str, argv), "--out", str(broken)]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # killed once a few chunks are committed
        manifest = broken / "manifest.json"
        if manifest.exists() and json.loads(manifest.read_text())["count"] >= 24:
            break
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    with IndexStore.open(broken) as store:
        assert 24 <= len(store) < 120  # stopped half-way
    assert run(capsys, *argv, "--out", broken)[0] == 0
    assert contents(broken) == contents(whole)


def test_a_sharded_index_is_embedded_again_into_one_index(
    digits_gallery: dict[str, Path], tiny_onnx: Path, tiny_onnx_other: Path, tmp_path: Path, capsys
) -> None:
    emb, sharded, out = tmp_path / "emb", tmp_path / "sharded", tmp_path / "dst"
    code, _, err = run(
        capsys, "embed", "--model", tiny_onnx, "--images", digits_gallery["list"], "--out", emb
    )
    assert code == 0, err
    code, _, err = run(capsys, "build", "--embeddings", emb, "--out", sharded, "--shards", "2")
    assert code == 0, err
    code, _, err = run(capsys, "reembed", sharded, "--model", tiny_onnx_other, "--out", out)
    assert code == 0, err
    with IndexStore.open(out) as store:
        assert len(store) == 120 and store.fingerprint == Embedder(tiny_onnx_other).fingerprint
        assert store.info()["filter_fields"] is None  # the sharded index's: every field
