"""`vitrieval-index calibrate`: the duplicate threshold of a precision, measured on copies
of the index's own images; its threshold choice and Wilson intervals against hand
computations, its precision checked on held-out copies, and `duplicates --precision`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py
from PIL import Image
from skimage import data as skdata

from vitrieval.index.calibration import (
    MIN_IMAGES,
    NEIGHBOURS,
    CopyScores,
    calibrate,
    choose_level,
    draw_images,
    embed_copies,
    search_copies,
    wilson_interval,
)
from vitrieval.index.cli import main
from vitrieval.index.evaluation.datasets import Item
from vitrieval.index.runtime.embedder import EmbedResult
from vitrieval.index.shards import open_index
from vitrieval.index.store import IndexStore, StoreError
from vitrieval.index.store import manifest as mf

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "coins", "moon", "page",
          "immunohistochemistry", "hubble_deep_field", "text", "clock")  # fmt: skip


def scores(positives: list[float], negatives: list[list[float]]) -> CopyScores:
    n = len(positives)
    return CopyScores(
        np.array(positives, dtype=np.float64),
        [np.array(neg, dtype=np.float64) for neg in negatives],
        [False] * n,
        [-np.inf] * n,
    )


def test_the_threshold_is_the_lowest_that_reaches_the_precision() -> None:
    # pairs by score: 0.95+ 0.9- 0.85+ 0.8+ 0.7- 0.6+ (+: a copy and its original)
    s = scores([0.95, 0.85, 0.8, 0.6], [[0.9], [0.7], [], []])
    # at 0.8: 3 positives, 1 negative -> 0.75; at 0.6: 4 and 2 -> 0.667; at 0.95: 1.0
    level = choose_level(s, 0.75)
    assert level.threshold == 0.8 and level.reached
    assert level.measured_precision == 0.75 and level.recall == 0.75 and level.pairs == 4
    assert choose_level(s, 0.6).threshold == 0.6
    top = choose_level(s, 0.99)
    assert top.threshold == 0.95 and top.recall == 0.25 and top.measured_precision == 1.0


def test_a_negatives_score_is_never_the_threshold() -> None:
    # 0.85 (a negative) reaches 0.6 too, with the same recall as 0.9 and a false pair more
    s = scores([0.95, 0.9], [[0.85], [0.5]])
    level = choose_level(s, 0.6)
    assert level.threshold == 0.9 and level.measured_precision == 1.0 and level.recall == 1.0


def test_malformed_calibrations_are_refused() -> None:
    level = mf.CalibrationLevel(0.99, 0.9, True, 1.0, (0.9, 1.0), 0.5, (0.4, 0.6), 7)
    good = mf.CalibrationEntry(0.99, (level,), 20, 100, 0, 48, "2026-01-01T00:00:00Z").to_json()
    assert mf.CalibrationEntry.from_json(good) is not None
    for field, value in [("threshold", float("nan")), ("threshold", 3.0), ("recall", 1.5),
                         ("pairs", -1), ("precision", 1.0)]:  # fmt: skip
        bad = {**good, "levels": [{**good["levels"][0], field: value}]}
        assert mf.CalibrationEntry.from_json(bad) is None, (field, value)
    twice = {**good, "levels": [good["levels"][0]] * 2}
    assert mf.CalibrationEntry.from_json(twice) is None
    assert mf.CalibrationEntry.from_json({**good, "images": -3}) is None


def test_an_unreachable_precision_keeps_the_best_and_says_so() -> None:
    s = scores([0.5, 0.4], [[0.9, 0.6], [0.45]])  # negatives above every positive
    level = choose_level(s, 0.9)
    assert not level.reached
    # precision at 0.5: 1/3, at 0.45: 1/4, at 0.4: 2/5 -> the best is 0.4
    assert level.threshold == 0.4 and level.measured_precision == pytest.approx(0.4)


def test_a_missed_original_counts_against_recall_only() -> None:
    s = scores([0.9, -np.inf], [[], []])
    level = choose_level(s, 0.99)
    assert level.threshold == 0.9 and level.recall == 0.5 and level.measured_precision == 1.0


def test_wilson_interval_against_a_hand_computation() -> None:
    # 8 of 10, z = 1.96: centre (0.8 + 0.19208) / 1.38416, spread 1.96 sqrt(0.016 + 0.0096)
    z = 1.959963984540054
    centre = 0.8 + z * z / 20
    spread = z * math.sqrt(0.8 * 0.2 / 10 + z * z / 400)
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx((centre - spread) / (1 + z * z / 10))
    assert hi == pytest.approx((centre + spread) / (1 + z * z / 10))
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0)


def tiles(root: Path, side: int) -> list[Path]:
    """The side x side tiles of 12 of scikit-image's photos, as PNG files: distinct real
    pictures (no two share a pixel)."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in PHOTOS:
        photo = Image.fromarray(getattr(skdata, name)()).convert("RGB")
        w, h = photo.size
        for i in range(side):
            for j in range(side):
                box = (i * w // side, j * h // side, (i + 1) * w // side, (j + 1) * h // side)
                paths.append(root / f"{name}-{i}{j}.png")
                photo.crop(box).save(paths[-1])
    return paths


class ThumbnailEmbedder:
    """A small, transparent copy detector: the 16x16 grey thumbnail, centred and
    L2-normalised. Crops and rotations defeat it often; what it finds it finds
    consistently, which is what a calibration needs to be checked against."""

    def embed_items(self, items, progress: bool = False) -> EmbedResult:
        rows = []
        for item in items:
            grey = item.open().convert("L").resize((16, 16), Image.Resampling.BILINEAR)
            x = np.asarray(grey, np.float64).ravel()
            x -= x.mean()
            rows.append(x / max(np.linalg.norm(x), 1e-9))
        return EmbedResult(np.asarray(rows, np.float32), list(range(len(rows))))


def test_calibration_reaches_its_precision_on_held_out_copies(tmp_path) -> None:
    paths = tiles(tmp_path / "images", 4)  # 192 pictures
    embedder = ThumbnailEmbedder()
    vectors = embedder.embed_items([Item(p.name, None, p) for p in paths]).embeddings
    store = IndexStore.create(tmp_path / "index", dim=vectors.shape[1])
    store.add([p.name for p in paths], vectors, paths=[str(p) for p in paths])
    entry = calibrate(store, embedder, 0.9, images=100, copies=4, seed=0)
    assert (entry.images, entry.copies, entry.items) == (100, 400, 192)
    assert [level.precision for level in entry.levels] == [0.9, 0.95, 0.99, 0.999]
    level = entry.level(0.9)
    assert level.reached and level.measured_precision >= 0.9 and level.recall > 0.1
    lo, hi = level.precision_interval
    assert lo < level.measured_precision <= hi
    # held out: other images' copies with other edits (seed 7), at the chosen threshold:
    # the precision is inside what the calibration's interval allows
    photos = draw_images(store, 100, seed=7)
    assert {p.key for p in photos} != {p.key for p in draw_images(store, 100, seed=0)}
    copies, originals = embed_copies(embedder, photos, 4, seed=7)
    held = search_copies(store, copies, originals, lambda _scores: level.threshold)
    tp, fp = held.counts(level.threshold)
    assert tp >= 20 and tp / (tp + fp) >= lo
    # a higher level: a higher threshold, no more recall
    strict = entry.level(0.99)
    assert strict.threshold >= level.threshold and strict.recall <= level.recall
    assert (
        store.calibration == entry and store.info()["calibration"]["threshold"] == level.threshold
    )


@pytest.fixture(scope="module")
def photo_index(tmp_path_factory, tiny_onnx) -> Path:
    """An index of the 48 quarters of 12 photos, built with the exported tiny model."""
    root = tmp_path_factory.mktemp("calibration")
    tiles(root / "images", 2)
    argv = ["build", "--model", tiny_onnx, "--images", root / "images", "--out", root / "index"]
    assert main([str(a) for a in argv]) == 0
    return root / "index"


def test_calibrate_records_the_threshold_and_duplicates_uses_it(
    photo_index, capsys, tmp_path
) -> None:
    import shutil

    index = tmp_path / "index"
    shutil.copytree(photo_index, index)
    argv = ("calibrate", index, "--precision", "0.95", "--images", 40, "--copies", 2)
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "80 copies of 40 images searched among 48 items" in out
    assert "* precision 0.95: threshold" in out
    with open_index(index) as store:  # saved: read back from the manifest
        entry = store.calibration
        assert entry.precision == 0.95 and entry.copies == 80
        threshold = entry.threshold
    code, out, err = run(capsys, "info", index, "--json")
    assert json.loads(out)["calibration"]["threshold"] == threshold
    out_file = tmp_path / "groups.json"
    code, out, err = run(capsys, "duplicates", index, "--precision", "0.95", "--out", out_file)
    assert code == 0, err
    assert f"the calibrated threshold is {threshold:.4f}" in out
    argv = ("duplicates", index, "--threshold", threshold, "--out", tmp_path / "t.json")
    assert run(capsys, *argv)[0] == 0
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(out_file.read_text())
    code, _, err = run(capsys, "duplicates", index, "--precision", "0.8", "--out", out_file)
    assert code != 0 and "calibrated for precision 0.9, 0.95, 0.99, 0.999" in err


def test_too_few_images_is_one_clear_line(photo_index, capsys, tmp_path) -> None:
    code, _, err = run(
        capsys, "duplicates", photo_index, "--precision", "0.99", "--out", tmp_path / "g.json"
    )
    assert code != 0 and "no calibrated duplicate threshold" in err and "Traceback" not in err
    code, _, err = run(capsys, "calibrate", photo_index, "--images", 5)
    assert code != 0 and f"at least {MIN_IMAGES}" in err


def test_the_manifest_entry_round_trips_and_refuses_nonsense() -> None:
    level = mf.CalibrationLevel(0.99, 0.9, True, 1.0, (0.9, 1.0), 0.5, (0.4, 0.6), 7)
    entry = mf.CalibrationEntry(0.99, (level,), 20, 100, 0, 48, "2026-01-01T00:00:00Z")
    assert mf.CalibrationEntry.from_json(json.loads(json.dumps(entry.to_json()))) == entry
    broken = entry.to_json() | {"precision": 0.5}  # no level for it
    assert mf.CalibrationEntry.from_json(broken) is None
    with pytest.raises(StoreError, match="precision must be"):
        from vitrieval.index.calibration import check_precision

        check_precision(1.0)


def test_copies_are_searched_deeper_until_no_negative_above_the_bound_is_unseen(
    tmp_path,
) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    store = IndexStore.create(tmp_path / "index", dim=8)
    keys = [f"k{i:03d}" for i in range(100)]
    store.add(keys, x)
    queries = x[:5] + 0.05 * rng.standard_normal((5, 8)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    # a bound below every score: every copy is read to the end (16, then 64, then 256)
    found = search_copies(store, queries, keys[:5], lambda _scores: -2.0)
    exact = queries.astype(np.float64) @ x.T.astype(np.float64)
    for c in range(5):
        assert found.positives[c] == pytest.approx(exact[c, c], abs=1e-5)
        others = np.sort(np.delete(exact[c], c))
        assert np.allclose(np.sort(found.negatives[c]), others, atol=1e-5)
    # a bound above every score: one search of NEIGHBOURS each
    shallow = search_copies(store, queries, keys[:5], lambda _scores: 2.0)
    assert all(len(n) == NEIGHBOURS - 1 for n in shallow.negatives)


def test_an_indexed_duplicate_of_the_original_is_not_a_false_pair(tmp_path) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((50, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    store = IndexStore.create(tmp_path / "index", dim=8)
    keys = [f"k{i:02d}" for i in range(50)]
    store.add(keys, x)
    store.add(["k00-again"], x[:1])  # the catalogue's own copy of k00
    copy = x[:1] + 0.1 * rng.standard_normal((1, 8)).astype(np.float32)
    copy /= np.linalg.norm(copy)
    found = search_copies(store, copy, ["k00"], lambda _scores: -2.0)
    exact = copy.astype(np.float64) @ x.T.astype(np.float64)
    assert found.positives[0] == pytest.approx(exact[0, 0], abs=1e-5)
    # every other item is a negative, k00-again (1.0 against k00, above the copy) is not
    assert np.allclose(np.sort(found.negatives[0]), np.sort(exact[0, 1:]), atol=1e-5)
