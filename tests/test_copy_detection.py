"""Copy-detection benchmark: query generation (determinism, edit coverage, each edit's
effect), the one-relevant-item metrics against a naive reference, and
`vitrieval-index bench --copy-detection` end to end on real photos."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py
from PIL import Image
from skimage import data as skdata

from vitrieval.index.evaluation.copy_detection import (
    CROP_AREA,
    JPEG_QUALITY,
    KINDS,
    RESIZE_SCALE,
    copy_queries,
    make_copy,
    plan,
    read_photos,
)
from vitrieval.index.evaluation.datasets import DatasetError, Item
from vitrieval.index.evaluation.metrics import retrieval_metrics, target_metrics, target_ranks

# RGB and grey, JPEG and PNG, landscape and square: skimage's bundled real photos
PHOTOS = {
    "astronaut.jpg": "astronaut",
    "coffee.png": "coffee",
    "sub/chelsea.jpg": "chelsea",
    "sub/deeper/rocket.jpg": "rocket",
    "camera.png": "camera",
}


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    for name, attr in PHOTOS.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(getattr(skdata, attr)()).save(path, quality=90)
    return root


@pytest.fixture(scope="module")
def small_photo() -> Image.Image:
    """A real photo at 160x107, small enough for many copies in a test."""
    return Image.fromarray(skdata.chelsea()).resize((160, 107), Image.Resampling.BICUBIC)


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


# --- query generation -------------------------------------------------------------


def test_same_seed_same_pixels_different_seed_different(small_photo):
    first = [pixels(make_copy(small_photo, 0, "cat.jpg", q)[0]) for q in range(5)]
    # again, in reverse order: nothing depends on what was generated before
    again = [pixels(make_copy(small_photo, 0, "cat.jpg", q)[0]) for q in reversed(range(5))]
    for a, b in zip(first, reversed(again), strict=True):
        assert a.shape == b.shape and np.array_equal(a, b)
    other_seed = [pixels(make_copy(small_photo, 1, "cat.jpg", q)[0]) for q in range(5)]
    other_key = [pixels(make_copy(small_photo, 0, "dog.jpg", q)[0]) for q in range(5)]
    for a, b, c in zip(first, other_seed, other_key, strict=True):
        assert a.shape != b.shape or not np.array_equal(a, b)
        assert a.shape != c.shape or not np.array_equal(a, c)
    # copies of one photo differ from each other
    assert len({a.tobytes() for a in first}) == 5


def test_plan_composition_covers_every_kind():
    counts: Counter[str] = Counter()
    sizes: Counter[int] = Counter()
    n_photos, per_image = 60, 5
    for p in range(n_photos):
        kinds_of_photo = set()
        for q in range(per_image):
            kinds, _ = plan(0, f"photo{p}.jpg", q)
            assert list(kinds) == [k for k in KINDS if k in kinds]  # application order
            assert 2 <= len(kinds) <= 4
            sizes[len(kinds)] += 1
            counts.update(kinds)
            kinds_of_photo.update(kinds)
        # the primary edit cycles: a photo's five copies use every kind
        assert kinds_of_photo == set(KINDS)
    total = n_photos * per_image
    assert set(sizes) == {2, 3, 4}
    for kind in KINDS:
        # each kind in 60% of the queries (1/5 primary + 4/5 * 2/4 extra)
        assert 0.5 < counts[kind] / total < 0.7, (kind, counts[kind] / total)
    with pytest.raises(ValueError, match="unknown edit kind"):
        plan(0, "a", 0, ("blur",))
    with pytest.raises(ValueError, match="seed"):
        plan(-1, "a", 0)


def test_adding_photos_keeps_the_other_photos_copies(photo_dir):
    photos = read_photos(photo_dir)
    astronaut = next(p for p in photos if p.key == "astronaut.jpg")
    alone = copy_queries([astronaut], 2, seed=3)
    among = [q for q in copy_queries(photos, 2, seed=3) if q.source == "astronaut.jpg"]
    assert [q.kinds for q in alone] == [q.kinds for q in among]
    for a, b in zip(alone, among, strict=True):
        assert np.array_equal(pixels(a.open(draft_size=72)), pixels(b.open(draft_size=72)))


def test_query_count_and_order(photo_dir):
    photos = read_photos(photo_dir)
    assert [p.key for p in photos] == sorted(PHOTOS)  # recursive, sorted, relative keys
    queries = copy_queries(photos, 3)
    assert len(queries) == 3 * len(photos)
    assert [(q.source, q.index) for q in queries] == [(p.key, i) for p in photos for i in range(3)]
    assert all(isinstance(q, Item) and q.label == q.source for q in queries)
    with pytest.raises(ValueError, match="positive"):
        copy_queries(photos, 0)


def test_each_edit_does_what_it_documents(small_photo):
    width, height = small_photo.size
    original = pixels(small_photo)
    # an empty plan is the identity: the sanity baseline of the benchmark
    same, edits = make_copy(small_photo, 0, "k", 0, kinds=())
    assert edits == [] and np.array_equal(pixels(same), original)
    for q in range(20):
        crop, (edit,) = make_copy(small_photo, 0, "k", q, kinds=("crop",))
        left, top, right, bottom = edit["box"]
        assert crop.size == (right - left, bottom - top)
        assert CROP_AREA[0] - 0.02 <= edit["area"] <= CROP_AREA[1] + 1e-9
        assert np.array_equal(pixels(crop), original[top:bottom, left:right])

        rotated, (edit,) = make_copy(small_photo, 0, "k", q, kinds=("rotate",))
        assert -30 <= edit["degrees"] <= 30
        if abs(edit["degrees"]) > 2:
            assert rotated.width > width and rotated.height > height  # expanded canvas
            assert (pixels(rotated)[0, 0] == 0).all()  # black corner

        resized, (edit,) = make_copy(small_photo, 0, "k", q, kinds=("resize",))
        assert RESIZE_SCALE[0] <= edit["scale"] <= RESIZE_SCALE[1]
        expected = (
            (width, height)
            if edit["back"]
            else (
                round(width * edit["scale"]),
                round(height * edit["scale"]),
            )
        )
        assert resized.size == expected

        coloured, (edit,) = make_copy(small_photo, 0, "k", q, kinds=("colour",))
        assert coloured.size == small_photo.size
        assert 0.6 <= edit["brightness"] <= 1.4 and abs(edit["hue_turns"]) <= 0.1
        assert not np.array_equal(pixels(coloured), original)

        jpeg, (edit,) = make_copy(small_photo, 0, "k", q, kinds=("jpeg",))
        assert JPEG_QUALITY[0] <= edit["quality"] <= JPEG_QUALITY[1]
        # the artefacts are kept: exactly Pillow's own encode + decode at that quality
        buffer = io.BytesIO()
        small_photo.save(buffer, format="JPEG", quality=edit["quality"])
        assert np.array_equal(pixels(jpeg), pixels(Image.open(buffer)))
        assert not np.array_equal(pixels(jpeg), original)


def test_read_photos_errors(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        read_photos(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no photos here")
    with pytest.raises(DatasetError, match="no image files"):
        read_photos(tmp_path / "empty")


def test_generation_never_imports_torch():
    code = (
        "import sys, index.evaluation.copy_detection, index.evaluation.benchmark, index.cli; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


# --- metrics -------------------------------------------------------------------


def naive_ranks(queries: np.ndarray, gallery: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Full ranking per query: score descending, then gallery index ascending."""
    out = []
    for q, t in zip(queries.astype(np.float64), targets, strict=True):
        scores = gallery.astype(np.float64) @ q
        order = np.lexsort((np.arange(len(gallery)), -scores))
        out.append(int(np.flatnonzero(order == t)[0]) + 1)
    return np.asarray(out)


def test_target_ranks_hand_computed_ties():
    gallery = np.array([[1, 0], [0, 1], [1, 0], [0.6, 0.8]], dtype=np.float32)
    queries = np.array([[1, 0], [1, 0], [0, 1], [0.6, 0.8]], dtype=np.float32)
    # query 0 -> item 0, tied with item 2 at a higher index: rank 1
    # query 1 -> item 2, tied with item 0 at a lower index: rank 2
    # query 2 -> item 1 (score 1), query 3 -> item 0 (0.6, below item 3 at 1.0 and item 1 at 0.8)
    ranks = target_ranks(queries, gallery, [0, 2, 1, 0])
    assert ranks.tolist() == [1, 2, 1, 3]
    metrics = target_metrics(ranks, (1, 2, 4))
    assert metrics["recall@1"] == pytest.approx(0.5)
    assert metrics["recall@2"] == pytest.approx(0.75)
    assert metrics["recall@4"] == 1.0
    assert metrics["map"] == pytest.approx((1 + 0.5 + 1 + 1 / 3) / 4)
    assert metrics["median_rank"] == 1.5 and metrics["n_queries"] == 4


@pytest.mark.parametrize(("step", "chunk_size"), [(2.0**-11, 7), (2.0**-2, 3), (2.0**-1, 1024)])
def test_target_ranks_match_naive_reference(step, chunk_size):
    """Quantised vectors make every dot product exact, so ties (many with coarse steps,
    plus duplicated gallery rows) are real ties in both implementations."""
    rng = np.random.default_rng(0)
    gallery = rng.standard_normal((40, 8))
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    gallery = (np.round(gallery / step) * step).astype(np.float32)
    gallery[30:] = gallery[:10]  # exact duplicates: ties at both lower and higher index
    targets = rng.integers(0, 40, size=50)
    queries = gallery[targets] + (np.round(rng.standard_normal((50, 8)) / 4 / step) * step)
    queries = queries.astype(np.float32)
    ranks = target_ranks(queries, gallery, targets, chunk_size=chunk_size)
    expected = naive_ranks(queries, gallery, targets)
    assert np.array_equal(ranks, expected)
    assert (expected > 1).any()  # the case is not trivial
    # the same numbers as the label-based metrics with one label per gallery item
    ks = (1, 2, 4, 8)
    ours = target_metrics(ranks, ks)
    theirs = retrieval_metrics(
        queries,
        targets.tolist(),
        ks,
        gallery_embeddings=gallery,
        gallery_labels=list(range(40)),
    )
    for key in ("recall@1", "recall@2", "recall@4", "recall@8", "map"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-12), key
    assert ours["n_queries"] == theirs["n_queries"] == 50


@pytest.mark.parametrize(
    ("targets", "message"),
    [([0, 5], r"\[0, 2\)"), ([0], "one entry per query"), ([0.0, 1.0], "integer")],
)
def test_target_ranks_validation(targets, message):
    vectors = np.eye(2, dtype=np.float32)
    with pytest.raises(ValueError, match=message):
        target_ranks(vectors, vectors, targets)


def test_target_metrics_empty_is_nan():
    metrics = target_metrics([], (1,))
    assert np.isnan(metrics["recall@1"]) and np.isnan(metrics["map"])
    assert metrics["n_queries"] == 0


# --- the benchmark ---------------------------------------------------------------


def test_cli_summary_follows_the_ks_asked_for(tmp_path, capsys, photo_dir, tiny_onnx):
    argv = ("bench", "--model", tiny_onnx, "--copy-detection", photo_dir, "--out", tmp_path)
    code, stdout, err = run(capsys, *argv, "--ks", "5", "10", "--queries-per-image", "1")
    assert code == 0, err
    summary = stdout.strip().splitlines()[-1]
    assert " recall@5 " in summary and "recall@1 " not in summary


def test_cli_end_to_end(tmp_path, capsys, photo_dir, tiny_onnx):
    photos = tmp_path / "photos"
    import shutil

    shutil.copytree(photo_dir, photos)
    (photos / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    distractors = tmp_path / "distractors"
    distractors.mkdir()
    for attr in ("coins", "immunohistochemistry"):
        Image.fromarray(getattr(skdata, attr)()).save(distractors / f"{attr}.png")
    out = tmp_path / "report"
    argv = ("bench", "--model", tiny_onnx, "--copy-detection", photos, "--out", out)
    code, stdout, err = run(capsys, *argv, "--distractors", distractors)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["protocol"] == "copy-detection"
    assert report["n_originals"] == 5 and report["n_distractors"] == 2
    assert report["n_gallery"] == 7
    assert report["n_queries"] == 5 * 5 and report["queries_per_image"] == 5
    assert report["unreadable_images"] == 1
    assert report["unreadable"][0]["key"].endswith("broken.jpg")
    assert "skipped" in stdout and "broken.jpg" in stdout
    assert 0.0 <= report["recall@1"] <= report["recall@2"] <= report["recall@4"] <= 1.0
    assert report["recall@8"] == 1.0  # 7 gallery items: every original is in the top 8
    assert 1 / 7 <= report["map"] <= 1.0 and report["recall@1"] <= report["map"]
    assert set(report["by_transform"]) == set(KINDS)
    assert sum(v["n_queries"] for v in report["by_transform"].values()) >= 2 * 25
    generation = report["query_generation"]
    assert generation["seed"] == 0 and generation["queries_per_image"] == 5
    assert generation["jpeg"]["quality"] == [20, 80]
    for key in ("embed_images_per_s", "query_images_per_s", "search_qps", "model_fingerprint"):
        assert key in report
    assert stdout.strip().splitlines()[-1].startswith("copy detection: 25 copies of 5 photos")
    assert (out / "report.md").read_text().startswith("| metric | value |")

    # the same seed gives the same report; another seed other copies
    again = tmp_path / "again"
    assert run(capsys, *argv[:-1], again, "--distractors", distractors)[0] == 0
    repeated = json.loads((again / "report.json").read_text())
    assert repeated["recall@1"] == report["recall@1"] and repeated["map"] == report["map"]
    code, _, err = run(capsys, *argv[:-1], again, "--seed", "7", "--queries-per-image", "2")
    assert code == 0, err
    other = json.loads((again / "report.json").read_text())
    assert other["n_queries"] == 10 and other["n_gallery"] == 5
    assert other["query_generation"]["seed"] == 7


def test_identical_copies_are_found_first(photo_dir, tiny_onnx):
    """Sanity: a copy with no edit reproduces its original's vector exactly (the same
    decoding as the gallery), so R@1 = mAP = 1 whatever the model."""
    from vitrieval.index.evaluation.benchmark import run_copy_detection
    from vitrieval.index.runtime.embedder import Embedder

    report = run_copy_detection(Embedder(tiny_onnx), read_photos(photo_dir), per_image=2, kinds=())
    assert report["n_queries"] == 10
    assert report["recall@1"] == 1.0 and report["map"] == 1.0 and report["median_rank"] == 1.0


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--copy-detection", "/nonexistent/photos"], "not found"),
        (["--copy-detection", "EMPTY"], "no image files"),
        (["--copy-detection", "PHOTOS", "--gallery", "g.csv"], "cannot be combined with --gallery"),
        (["--copy-detection", "PHOTOS", "--dataset", "digits"], "--dataset"),
        (["--copy-detection", "PHOTOS", "--queries-per-image", "0"], "at least 1"),
        (["--copy-detection", "PHOTOS", "--distractors", "PHOTOS"], "nobody's original"),
        (["--queries-per-image", "3"], "--copy-detection only"),
        (["--distractors", "PHOTOS"], "--copy-detection only"),
    ],
)
def test_bad_input_one_line(tmp_path, capsys, photo_dir, extra, needle):
    (tmp_path / "empty").mkdir()
    names = {"EMPTY": str(tmp_path / "empty"), "PHOTOS": str(photo_dir)}
    argv = ["bench", "--model", "M.onnx", "--out", tmp_path / "r", *extra]
    code, _, err = run(capsys, *(names.get(str(a), a) for a in argv))
    assert code == 2 and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--ks", "1", "0"], "--ks must all be >= 1"),
        (["--factory", "Nonsense42"], "invalid FAISS factory 'Nonsense42'"),
        (["--out", "FILE"], "is a file; the report needs a folder"),
    ],
)
@pytest.mark.parametrize("source", ["copy-detection", "dataset"])
def test_bench_options_checked_before_embedding(
    tmp_path, capsys, photo_dir, tiny_onnx, monkeypatch, extra, needle, source
):
    """Options that could only fail after every image is embedded fail first instead."""
    from vitrieval.index.runtime.embedder import Embedder

    def no_embedding(*args, **kwargs):
        raise AssertionError("embedded before checking the options")

    monkeypatch.setattr(Embedder, "embed_items", no_embedding)
    (tmp_path / "file").write_text("x")
    names = {"FILE": str(tmp_path / "file")}
    data = ["--copy-detection", str(photo_dir)] if source == "copy-detection" else []
    argv = ["bench", "--model", tiny_onnx, "--out", tmp_path / "r", *data, *extra]
    code, _, err = run(capsys, *(names.get(str(a), a) for a in argv))
    assert code == 2 and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


# --- label-aware copy detection (--labels-from-folders) ---------------------------


class _VectorEmbedder:
    """Stands in for `Embedder`: a photo embeds to `vectors[key]`, a copy of it to
    `copies[key]` (or the photo's vector), so the ranking is known by hand."""

    fingerprint = "stub"

    def __init__(self, vectors: dict[str, list[float]], copies: dict | None = None):
        self.vectors = {k: np.asarray(v, dtype=np.float32) for k, v in vectors.items()}
        self.copies = {k: np.asarray(v, dtype=np.float32) for k, v in (copies or {}).items()}
        self.dim = len(next(iter(self.vectors.values())))

    def embed_items(self, items, *, progress=False):
        from vitrieval.index.evaluation.copy_detection import CopyQuery
        from vitrieval.index.runtime.embedder import EmbedResult

        rows = []
        for item in items:
            if isinstance(item, CopyQuery):
                rows.append(self.copies.get(item.source, self.vectors[item.source]))
            else:
                rows.append(self.vectors[item.key])
        return EmbedResult(np.stack(rows), list(range(len(items))), [])


def _photo(key: str, labelled: bool = True) -> Item:
    label = key.split("/")[0] if labelled and "/" in key else None
    return Item(key=key, label=label, path=Path("/nowhere") / key)


def test_label_mode_counts_another_version_of_the_design():
    """Hand-computed: design/a.png and design/b.png are two versions of one design.
    The copy of a ranks b (0.936), the distractor e (0.8), d (0.576), then a (0.28):
    a miss at rank 4 by default, a hit in label mode (b is relevant too). The copy of d
    (no label) ranks b (1.0), e (0.96), a (0.6), then d (0.48): a miss in both modes."""
    from vitrieval.index.evaluation.benchmark import run_copy_detection

    vectors = {
        "d.png": [0, 0.6, 0.8],  # directly in DIR: no label, its own design
        "design/a.png": [1, 0, 0],
        "design/b.png": [0.6, 0.8, 0],
        "other/c.png": [0, 0, 1],
        "e.png": [0.8, 0.6, 0],  # a distractor: never relevant
    }
    copies = {"d.png": [0.6, 0.8, 0], "design/a.png": [0.28, 0.96, 0]}
    embedder = _VectorEmbedder(vectors, copies)
    photos = [_photo(k) for k in ("d.png", "design/a.png", "design/b.png", "other/c.png")]
    distractors = [_photo("e.png")]
    common = dict(per_image=1, kinds=(), ks=(1, 2, 4))

    plain = run_copy_detection(embedder, photos, distractors, **common)
    # ranks of the original: d 4, a 4, b 1, c 1
    assert plain["relevant"] == "original"
    assert plain["recall@1"] == 0.5 and plain["recall@2"] == 0.5 and plain["recall@4"] == 1.0
    assert plain["map"] == pytest.approx((1 / 4 + 1 / 4 + 1 + 1) / 4)
    assert plain["median_rank"] == 2.5

    labelled = run_copy_detection(embedder, photos, distractors, relevant="label", **common)
    # first relevant rank: d 4 (unlabelled: b is no sibling of it), a 1 (b), b 1, c 1.
    # AP: d 1/4; a: b at 1, a at 4 -> (1/1 + 2/4) / 2; b: b at 1, a at 3 (after e)
    # -> (1/1 + 2/3) / 2; c 1
    assert labelled["relevant"] == "label" and labelled["n_labels"] == 3
    assert labelled["recall@1"] == 0.75 and labelled["recall@2"] == 0.75
    assert labelled["recall@4"] == 1.0
    assert labelled["map"] == pytest.approx((1 / 4 + 0.75 + 5 / 6 + 1) / 4)
    assert labelled["median_rank"] == 1.0 and labelled["n_queries"] == 4
    # precision@2: d 0, a 1 (b), b 1 (b), c 1 (c) of 2 each; R-precision (R = 1 or 2):
    # d 0, a 1/2 (b of {a, b} in the top 2), b 1/2, c 1
    assert labelled["precision@2"] == pytest.approx((0 + 0.5 + 0.5 + 0.5) / 4)
    assert labelled["r_precision"] == pytest.approx((0 + 0.5 + 0.5 + 1) / 4)

    # without labels (every photo its own design) the label mode is the default mode
    bare = [_photo(p.key, labelled=False) for p in photos]
    same = run_copy_detection(embedder, bare, distractors, relevant="label", **common)
    for key in ("recall@1", "recall@2", "recall@4", "map", "median_rank"):
        assert same[key] == pytest.approx(plain[key]), key
    with pytest.raises(ValueError, match="relevant"):
        run_copy_detection(embedder, photos, relevant="folder", **common)


def _naive_label_metrics(queries, gallery, query_class, gallery_class, ks):
    """Full stable sort per query (score descending, then gallery index), then every
    metric from the list of relevant positions."""
    out = {f"recall@{k}": [] for k in ks} | {f"precision@{k}": [] for k in ks}
    out |= {"map": [], "map_at_r": [], "r_precision": [], "first": []}
    for q, c in zip(queries.astype(np.float64), query_class, strict=True):
        scores = (gallery.astype(np.float32) @ q.astype(np.float32)).astype(np.float64)
        order = np.lexsort((np.arange(len(gallery)), -scores))
        hits = gallery_class[order] == c
        ranks = np.flatnonzero(hits) + 1
        n_rel = len(ranks)
        precision = np.arange(1, n_rel + 1) / ranks
        for k in ks:
            out[f"recall@{k}"].append(float(ranks[0] <= k))
            out[f"precision@{k}"].append(hits[:k].sum() / k)
        out["map"].append(precision.mean())
        out["map_at_r"].append(precision[ranks <= n_rel].sum() / n_rel)
        out["r_precision"].append(hits[:n_rel].sum() / n_rel)
        out["first"].append(ranks[0])
    return {k: np.asarray(v) for k, v in out.items()}


def test_label_mode_matches_a_naive_full_sort():
    from vitrieval.index.evaluation.benchmark import run_copy_detection

    rng = np.random.default_rng(1)
    step = 2.0**-3  # coarse steps: exact score ties between items
    keys = [f"root{i}.png" for i in range(2)]
    keys += [f"design{d}/v{v}.png" for d in range(4) for v in range(3)]
    vectors, copies = {}, {}
    for key in [*keys, "x0.png", "x1.png", "x2.png"]:
        v = np.round(rng.standard_normal(6) / step) * step
        vectors[key] = v / np.linalg.norm(v)
    vectors["design3/v2.png"] = vectors["design3/v0.png"]  # identical versions: a tie
    for key in keys:
        # copies keyed by photo: all copies of one photo share the vector (per_image 3)
        noisy = vectors[key] + np.round(rng.standard_normal(6) * 0.6 / step) * step
        copies[key] = noisy / np.linalg.norm(noisy)
    embedder = _VectorEmbedder(vectors, copies)
    photos = [_photo(k) for k in keys]
    distractors = [_photo(k, labelled=False) for k in ("x0.png", "x1.png", "x2.png")]
    ks = (1, 2, 4, 8)
    report = run_copy_detection(embedder, photos, distractors, per_image=3, ks=ks, relevant="label")

    gallery = np.stack([embedder.vectors[k] for k in [*keys, "x0.png", "x1.png", "x2.png"]])
    classes = {key: key.split("/")[0] if "/" in key else key for key in keys}
    gallery_class = np.array([*(classes[k] for k in keys), "#x0", "#x1", "#x2"])
    query_keys = [k for k in keys for _ in range(3)]
    queries = np.stack([embedder.copies[k] for k in query_keys])
    naive = _naive_label_metrics(
        queries, gallery, [classes[k] for k in query_keys], gallery_class, ks
    )
    for name in [
        *(f"recall@{k}" for k in ks),
        *(f"precision@{k}" for k in ks),
        "map",
        "map_at_r",
        "r_precision",
    ]:
        assert report[name] == pytest.approx(naive[name].mean(), abs=1e-12), name
    assert report["median_rank"] == float(np.median(naive["first"]))
    assert report["n_queries"] == 3 * len(keys) and report["n_labels"] == 6
    assert 0 < report["recall@1"] < 1  # the case is not trivial
    assert (
        report["recall@1"]
        > run_copy_detection(embedder, photos, distractors, per_image=3, ks=ks)["recall@1"]
    )
    # by edit kind: the same per-query values, averaged over the copies with that kind
    copy_kinds = [q.kinds for q in copy_queries(photos, 3, 0)]
    for kind, part in report["by_transform"].items():
        mask = np.array([kind in chosen for chosen in copy_kinds])
        assert part["n_queries"] == mask.sum()
        assert part["recall@1"] == pytest.approx(np.mean(naive["first"][mask] == 1), abs=1e-12)
        assert part["map"] == pytest.approx(naive["map"][mask].mean(), abs=1e-12)


def test_cli_labels_from_folders(tmp_path, capsys, photo_dir, tiny_onnx):
    """sub/chelsea.jpg and sub/deeper/rocket.jpg share the label `sub`: a copy of one
    finding the other counts in label mode, so recall@K can only rise."""
    reports = {}
    for mode, extra in (("original", []), ("label", ["--labels-from-folders"])):
        out = tmp_path / mode
        argv = ("bench", "--model", tiny_onnx, "--copy-detection", photo_dir, "--out", out)
        code, stdout, err = run(capsys, *argv, "--queries-per-image", "2", *extra)
        assert code == 0, err
        reports[mode] = json.loads((out / "report.json").read_text())
        assert reports[mode]["relevant"] == mode
    assert "a photo of the original's folder counts as found; 4 labels" in stdout
    labelled, plain = reports["label"], reports["original"]
    assert labelled["n_labels"] == 4 and labelled["n_queries"] == plain["n_queries"] == 10
    for k in (1, 2, 4, 8):
        assert labelled[f"recall@{k}"] >= plain[f"recall@{k}"]
    assert labelled["median_rank"] <= plain["median_rank"]
    assert "map_at_r" in labelled and "map_at_r" not in plain
