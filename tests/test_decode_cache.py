"""The training decode cache: each file decoded once, at a working size, reused every epoch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitrieval.index.evaluation.datasets as datasets_module
from vitrieval.index.evaluation.datasets import Item
from vitrieval.index.runtime.images import open_image
from vitrieval.training.cli import main
from vitrieval.training.config import FitConfig
from vitrieval.training.data import ImageDataset, build_transforms, drop_unreadable, epoch_loader
from vitrieval.training.decode_cache import (
    CACHE_DIRNAME,
    CachedFileItem,
    DecodeCache,
    reduce_to_side,
    working_side,
)
from vitrieval.training.epochs import seed_everything

# the tiny preset's data config (32 px, crop_pct 1) and fit's default crop scale
DATA_CONFIG = {
    "input_size": (3, 32, 32),
    "interpolation": "bicubic",
    "mean": (0.5, 0.5, 0.5),
    "std": (0.5, 0.5, 0.5),
    "crop_pct": 1.0,
}
SIDE = working_side(32, 1.0, 0.8)


def photo(path: Path, width: int, height: int, seed: int = 0) -> Path:
    """A photo-like image (smooth shapes, texture, noise) saved as PNG or JPEG by suffix."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = []
    for c in range(3):
        fx, fy, phase = rng.uniform(2, 9), rng.uniform(2, 9), rng.uniform(0, 6)
        wave = np.sin(x / width * fx * np.pi + phase) * np.cos(y / height * fy * np.pi)
        channels.append(128 + 90 * wave + 20 * np.sin((x + y) / 7.0 + c))
    pixels = np.stack(channels, axis=-1) + rng.normal(0, 6, (height, width, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".png":
        image.save(path, compress_level=1)
    else:
        image.save(path, quality=92)
    return path


class DecodeCounter:
    """Counts file decodes, in this process and in forked data-loader workers (a line
    per decode appended to a file); calling it gives the count so far. `decode` is
    what a counted call then runs (the real decoder unless a test swaps it)."""

    def __init__(self, log: Path):
        self.log = log
        self.log.touch()
        self.decode = datasets_module.open_image

    def open_image(self, *args, **kwargs) -> Image.Image:
        with open(self.log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        return self.decode(*args, **kwargs)

    def __call__(self) -> int:
        return len(self.log.read_text().splitlines())


@pytest.fixture
def decodes(tmp_path, monkeypatch) -> DecodeCounter:
    counter = DecodeCounter(tmp_path / "decodes.log")
    monkeypatch.setattr(datasets_module, "open_image", counter.open_image)
    return counter


@pytest.fixture
def photos(tmp_path) -> list[Item]:
    """Six 1-2 MP files, PNG and JPEG, in two classes."""
    sizes = [(1600, 1200), (1200, 1500), (1400, 1000)]
    items = []
    for i in range(6):
        width, height = sizes[i % 3]
        path = photo(tmp_path / "photos" / f"{i}.{'png' if i % 2 else 'jpg'}", width, height, i)
        items.append(Item(f"{i}", f"class_{i % 2}", path))
    return items


def test_working_side_keeps_every_crop_at_twice_the_input_size():
    assert working_side(32, 1.0, 0.8) == 83  # fit on the tiny preset
    assert working_side(32, 1.0, 0.2) == 166  # pretrain (crop area from 0.2)
    assert working_side(224, 0.9, 0.8) == 579  # ViT-S/16
    # where the evaluation resize is the larger (224 / 0.8 = 280), it gets twice its size
    assert working_side(224, 0.8, 1.0) == 560
    for crop_scale in (0.08, 0.2, 0.5, 1.0):
        side = working_side(64, 1.0, crop_scale)
        smallest_crop_side = side * np.sqrt(0.75 * crop_scale)
        assert smallest_crop_side >= 2 * 64


def test_reduction_keeps_the_aspect_and_never_enlarges():
    small = Image.new("RGB", (60, 40))
    assert reduce_to_side(small, SIDE) is small
    assert reduce_to_side(Image.new("RGB", (1600, 1200)), SIDE).size == (111, 83)
    assert reduce_to_side(Image.new("RGB", (1200, 1600)), SIDE).size == (83, 111)


def test_a_file_that_needs_no_reduction_gives_the_same_eval_tensor(tmp_path):
    _, evaluation = build_transforms(DATA_CONFIG, 0.8, 0.5)
    for name in ("small.png", "small.jpg"):
        path = photo(tmp_path / name, 70, 50)  # shorter side 50 <= SIDE: kept as decoded
        cached = DecodeCache("memory", SIDE).load(Item(name, "a", path))
        assert np.array_equal(cached.pixels, np.asarray(open_image(path)))
        assert torch.equal(evaluation(cached.open()), evaluation(open_image(path)))


@pytest.mark.parametrize("name", ["large.png", "large.jpg"])
def test_a_reduced_file_gives_nearly_the_same_eval_tensor(tmp_path, name):
    """The copy is resampled (and its long side rounded to a whole pixel), so the tensor
    differs slightly; on this 1800x1200 file the mean difference is about 0.002-0.02 in
    normalised units (1/255 of the range is 0.008)."""
    _, evaluation = build_transforms(DATA_CONFIG, 0.8, 0.5)
    path = photo(tmp_path / name, 1800, 1200, seed=3)
    cached = DecodeCache("memory", SIDE).load(Item(name, "a", path))
    assert cached.pixels.shape == (SIDE, 125, 3)
    full, copy = evaluation(open_image(path)), evaluation(cached.open())
    assert full.shape == copy.shape == (3, 32, 32)
    assert float((full - copy).abs().mean()) < 0.03
    assert float(torch.nn.functional.cosine_similarity(full.flatten(), copy.flatten(), 0)) > 0.999


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_files_are_decoded_once_and_never_again_across_epochs_and_workers(
    tmp_path, photos, decodes, mode
):
    cache = DecodeCache(mode, SIDE, tmp_path / "cache")
    items, bad = drop_unreadable(photos, "training images", cache)
    assert bad == [] and len(items) == 6
    assert decodes() == 6  # the readability check filled the cache
    train, _ = build_transforms(DATA_CONFIG, 0.8, 0.5, "rand-m9-mstd0.5")
    dataset = ImageDataset(items, {"class_0": 0, "class_1": 1}, train)
    cfg = FitConfig(out=str(tmp_path / "run"), workers=2, batch_size=3).resolved()
    for epoch in (1, 2):
        batches = list(epoch_loader(dataset, cfg, epoch))
        assert [tuple(images.shape) for images, _ in batches] == [(3, 3, 32, 32)] * 2
    assert decodes() == 6


def test_the_decode_counter_sees_data_loader_workers(tmp_path, photos, decodes):
    """Without the cache every epoch opens every file again, in the workers, and the
    counter above sees those opens. (A stand-in decoder makes blank images here: a
    worker forked after this process decoded with libvips must not use libvips.)"""
    decodes.decode = lambda *args, **kwargs: Image.new("RGB", (40, 40))
    train, _ = build_transforms(DATA_CONFIG, 0.8, 0.5, "rand-m9-mstd0.5")
    plain = ImageDataset(photos, {"class_0": 0, "class_1": 1}, train)
    cfg = FitConfig(out=str(tmp_path / "run"), workers=2, batch_size=3).resolved()
    for epoch in (1, 2):
        list(epoch_loader(plain, cfg, epoch))
    assert decodes() == 12
    # two workers per epoch, none of them this process
    pids = set(decodes.log.read_text().split())
    assert len(pids) == 4 and str(os.getpid()) not in pids


def test_training_tensors_are_made_from_the_cached_images(tmp_path, photos, decodes):
    items, _ = drop_unreadable(photos, "training images", DecodeCache("memory", SIDE))
    train, _ = build_transforms(DATA_CONFIG, 0.8, 0.5, "rand-m9-mstd0.5")
    dataset = ImageDataset(items, {"class_0": 0, "class_1": 1}, train)
    before = decodes()
    for i, item in enumerate(items):
        assert min(item.pixels.shape[:2]) == SIDE
        seed_everything(i)  # the augmentations draw from random, numpy and torch
        tensor, _ = dataset[i]
        seed_everything(i)
        assert torch.equal(tensor, train(Image.fromarray(item.pixels)))
    assert decodes() == before


_FILL = """
import sys
from pathlib import Path
from vitrieval.index.evaluation.datasets import Item
from vitrieval.training.decode_cache import DecodeCache
cache = DecodeCache("disk", int(sys.argv[1]), Path(sys.argv[2]))
for path in sys.argv[3:]:
    cache.load(Item(Path(path).name, "a", Path(path)))
print(cache.stats.decoded)
"""


def test_the_disk_cache_survives_a_new_process_and_misses_changed_files(tmp_path, photos, decodes):
    folder = tmp_path / "cache"
    paths = [str(item.path) for item in photos]
    done = subprocess.run(
        [sys.executable, "-c", _FILL, str(SIDE), str(folder), *paths],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.stdout.split() == ["6"]
    assert len(list(folder.rglob("*.npy"))) == 6

    cache = DecodeCache("disk", SIDE, folder)
    items, _ = drop_unreadable(photos, "training images", cache)
    assert decodes() == 0 and cache.stats.reused == 6
    assert all(isinstance(item, CachedFileItem) for item in items)
    first = np.asarray(items[0].open())

    # a changed file has another size or modification time: its copy is made again
    photo(photos[0].path, 1000, 1400, seed=42)
    stat = photos[0].path.stat()
    os.utime(photos[0].path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    cache = DecodeCache("disk", SIDE, folder)
    items, _ = drop_unreadable(photos, "training images", cache)
    assert decodes() == 1 and cache.stats.reused == 5
    assert np.asarray(items[0].open()).shape == (117, SIDE, 3) != first.shape
    # another working size is another key
    other = DecodeCache("disk", 2 * SIDE, folder)
    drop_unreadable(photos, "training images", other)
    assert other.stats.decoded == 6


def test_a_damaged_or_vanished_copy_is_decoded_again(tmp_path, photos, decodes):
    folder = tmp_path / "cache"
    items, _ = drop_unreadable(photos[:2], "images", DecodeCache("disk", SIDE, folder))
    expected = np.asarray(items[0].open())
    items[0].cache_file.unlink()  # gone after the check: opening decodes the file
    assert np.array_equal(np.asarray(items[0].open()), expected)
    with open(items[1].cache_file, "r+b") as fh:  # cut short: the next run decodes it
        fh.truncate(200)
    before = decodes()
    cache = DecodeCache("disk", SIDE, folder)
    drop_unreadable(photos[:2], "images", cache)
    assert cache.stats.decoded == 2 and decodes() == before + 2


def test_unreadable_files_are_reported_as_without_the_cache(tmp_path, photos):
    broken = tmp_path / "photos" / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 truncated")
    text = tmp_path / "photos" / "notes.png"
    text.write_text("not an image")
    listed = [*photos[:2], Item("broken", "a", broken), Item("notes", "a", text)]
    listed.append(Item("missing", "a", tmp_path / "nowhere.png"))
    plain_good, plain_bad = drop_unreadable(listed, "images")
    for mode in ("memory", "disk", "auto"):
        good, bad = drop_unreadable(listed, "images", DecodeCache(mode, SIDE, tmp_path / "c"))
        assert bad == plain_bad and [i.key for i in good] == [i.key for i in plain_good]
    assert [key for key, _ in plain_bad] == ["broken", "notes", "missing"]


def test_items_without_a_file_pass_through():
    digit = Item("d0", "0", pixels=np.zeros((8, 8), np.uint8))
    cache = DecodeCache("memory", SIDE)
    good, bad = drop_unreadable([digit], "digits", cache)
    assert good[0] is digit and bad == [] and cache.stats.decoded == 0


def test_auto_keeps_what_fits_the_budget_in_memory_and_the_rest_on_disk(tmp_path, photos):
    one_copy = 117 * SIDE * 3  # the largest copy of the six (1400x1000 -> 117x83)
    cache = DecodeCache("auto", SIDE, tmp_path / "cache", budget=2 * one_copy)
    items, _ = drop_unreadable(photos, "images", cache)
    assert cache.stats.in_memory == 2 and cache.stats.on_disk == 4
    assert [item.pixels is not None for item in items] == [True, True] + [False] * 4
    assert len(list((tmp_path / "cache").rglob("*.npy"))) == 4


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--decode-cache", "sometimes"], "--decode-cache must be one of"),
        (["--decode-cache", "off", "--decode-cache-dir", "x"], "--decode-cache off writes none"),
    ],
)
def test_decode_cache_flags_are_checked(tmp_path, capsys, flags, needle):
    assert main(["fit", "--out", str(tmp_path / "run"), *flags]) == 2
    assert main(["pretrain", "--out", str(tmp_path / "pre"), "--images", ".", *flags]) == 2
    assert capsys.readouterr().err.count(needle) == 2


def test_fit_and_resume_with_the_disk_cache_decode_each_file_once(tmp_path, capsys, decodes):
    root = tmp_path / "data"
    for c in range(3):
        for i in range(4):
            photo(root / f"class_{c}" / f"{i}.{'png' if i % 2 else 'jpg'}", 900, 700, 10 * c + i)
    run = tmp_path / "run"
    args = ["fit", "--dataset", "folder", "--data-root", str(root), "--preset", "tiny"]
    args += ["--out", str(run), "--batch-size", "4", "--workers", "1", "--warmup-epochs", "0"]
    assert main([*args, "--epochs", "1", "--decode-cache", "disk"]) == 0
    out = capsys.readouterr().out
    # the 9 training images are cached; the 3 held-out ones are decoded as the exported
    # model's Embedder decodes them, by the check and by every evaluation
    assert "decode cache (disk): shorter side 83 px; 9 images decoded, 0 found on disk" in out
    assert len(list((run / CACHE_DIRNAME).rglob("*.npy"))) == 9
    assert decodes() == 9 + 3 + 3  # the check, one epoch and the held-out evaluation
    assert main(["fit", "--out", str(run), "--resume", "--epochs", "2"]) == 0
    assert "0 images decoded, 9 found on disk" in capsys.readouterr().out
    assert decodes() == 15 + 3 + 3  # only the held-out images: the check, epoch 2


def test_pretrain_fills_the_cache_in_memory_by_default(tmp_path, capsys, decodes):
    images = tmp_path / "images"
    for i in range(4):
        photo(images / f"{i}.jpg", 800, 600, i)
    run = tmp_path / "pre"
    argv = ["pretrain", "--images", str(images), "--preset", "tiny", "--out", str(run)]
    argv += ["--epochs", "1", "--batch-size", "4", "--workers", "1", "--warmup-epochs", "0"]
    assert main(argv) == 0
    assert "decode cache (auto): shorter side 166 px; 4 images decoded" in capsys.readouterr().out
    assert decodes() == 4
    assert not (run / CACHE_DIRNAME).exists()


def test_a_folder_that_cannot_take_the_copies_leaves_the_items_uncached(tmp_path, photos, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    cache = DecodeCache("disk", SIDE, blocker / "cache")
    with caplog.at_level("WARNING", logger="vitrieval.train"):
        items, bad = drop_unreadable(photos[:2], "images", cache)
    assert not bad and [i.key for i in items] == [p.key for p in photos[:2]]
    assert items[0] is photos[0] or items[0] == photos[0]  # uncached: the original file
    assert cache.stats.write_failed == 2 and cache.stats.on_disk == 0
    assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1
