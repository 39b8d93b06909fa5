"""`vitrieval-index bench --copy-detection DIR --save-copies DIR2 --out REPORT`: the
copies as PNG files, REPORT/ranks.csv reproduced by an independent baseline from them,
one decode per photo for all its copies, and the timings in the report."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py
from PIL import Image


@pytest.fixture(scope="module")
def small_photos(tmp_path_factory) -> Path:
    """Three small generated photos (smooth gradients plus noise), JPEG and PNG, one in
    a subfolder."""
    root = tmp_path_factory.mktemp("small_photos")
    rng = np.random.default_rng(5)
    for i, name in enumerate(("a.jpg", "b.png", "sub/c.jpg")):
        y, x = np.mgrid[0:72, 0:96]
        base = np.stack([x * (2 + i), y * (3 - i), (x + y) * (i + 1)], axis=-1) % 256
        noisy = base + rng.integers(0, 40, base.shape)
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(root / name, quality=90)
    return root


def test_save_copies_writes_copies_ranks_and_timings(
    tmp_path, capsys, small_photos, tiny_onnx, monkeypatch
):
    """The interface as documented; an independent baseline (the saved PNG copies and
    the original files embedded again, ranked with numpy) reproduces ranks.csv; each
    photo is decoded once for the gallery and once for all its copies."""
    import vitrieval.index.evaluation.datasets as datasets_module
    from vitrieval.index.runtime.embedder import Embedder

    decoded = Counter()
    real_open = datasets_module.open_image

    def counting_open(source, *args, **kwargs):
        decoded[Path(source).name] += 1
        return real_open(source, *args, **kwargs)

    monkeypatch.setattr(datasets_module, "open_image", counting_open)
    copies, out = tmp_path / "copies", tmp_path / "report"
    argv = ("bench", "--model", tiny_onnx, "--copy-detection", small_photos)
    code, stdout, err = run(capsys, *argv, "--save-copies", copies, "--out", out)
    assert code == 0, err
    assert decoded == {"a.jpg": 2, "b.png": 2, "c.jpg": 2}  # gallery + once for 5 copies
    monkeypatch.undo()

    report = json.loads((out / "report.json").read_text())
    assert report["copies_photo_decodes"] == 3 and report["n_queries"] == 15
    for key in ("copies_decode_seconds", "copies_model_seconds", "gallery_model_seconds"):
        assert report[key] > 0, key
    assert report["copies_save_seconds"] > 0 and report["copies_dir"] == str(copies)
    assert "decoding 3 photos for their copies took" in stdout

    with open(out / "ranks.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["query"] for r in rows] == [
        f"{photo}#copy{q}" for photo in ("a.jpg", "b.png", "sub/c.jpg") for q in range(5)
    ]
    saved = sorted(str(p.relative_to(copies)) for p in copies.rglob("*.png"))
    assert saved == sorted(r["copy_file"] for r in rows)
    assert rows[0]["copy_file"] == "a.jpg.copy0.png" and rows[-1]["original"] == "sub/c.jpg"
    assert all(r["edits"] and 2 <= len(r["edits"].split("+")) <= 4 for r in rows)

    embedder = Embedder(tiny_onnx)
    originals = ["a.jpg", "b.png", "sub/c.jpg"]
    gallery = embedder.embed_sources([small_photos / k for k in originals]).embeddings
    queries = embedder.embed_sources([copies / r["copy_file"] for r in rows]).embeddings
    scores = queries @ gallery.T
    target = np.array([originals.index(r["original"]) for r in rows])
    own = scores[np.arange(len(rows)), target]
    np.testing.assert_allclose([float(r["score"]) for r in rows], own, atol=1e-5)
    baseline_ranks = 1 + (scores > own[:, None]).sum(axis=1)
    assert [int(r["rank"]) for r in rows] == baseline_ranks.tolist()
    assert report["recall@1"] == float(np.mean(baseline_ranks == 1))


def test_ranks_without_saved_copies(tmp_path, capsys, small_photos, tiny_onnx):
    out = tmp_path / "report"
    argv = ("bench", "--model", tiny_onnx, "--copy-detection", small_photos, "--out", out)
    code, _, err = run(capsys, *argv, "--queries-per-image", "2")
    assert code == 0, err
    lines = (out / "ranks.csv").read_text().splitlines()
    assert lines[0] == "query,copy_file,original,rank,score,edits" and len(lines) == 1 + 6
    assert lines[1].startswith("a.jpg#copy0,,a.jpg,")


@pytest.mark.parametrize(
    ("where", "needle"),
    [
        ("INSIDE", "is inside --copy-detection"),
        ("FILE", "is a file; the copies need a folder"),
        ("NO-COPY-DETECTION", "apply to --copy-detection only"),
    ],
)
def test_save_copies_refused_before_embedding(tmp_path, capsys, small_photos, where, needle):
    (tmp_path / "file").write_text("x")
    target = {"INSIDE": small_photos / "copies", "FILE": tmp_path / "file"}.get(where, tmp_path)
    source = [] if where == "NO-COPY-DETECTION" else ["--copy-detection", small_photos]
    argv = ["bench", "--model", "M.onnx", *source, "--save-copies", target, "--out", tmp_path / "r"]
    code, _, err = run(capsys, *argv)
    assert code == 2 and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
