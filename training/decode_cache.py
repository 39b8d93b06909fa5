"""Training input decoded once: every image file shrunk to a working size and reused.

A training run reads every image once per epoch, and a 12-megapixel photo takes a
large share of a second to decode while the model sees 32 to 224 pixels of it. The
readability check that starts every run (`vitrieval.training.data.drop_unreadable`) decodes each
file anyway; with a `DecodeCache` that pass keeps the result, reduced so that its
shorter side is `working_side(...)` pixels (never enlarged, aspect ratio kept), and
every epoch after it starts from that copy instead of the file.

Where the copies live (`--decode-cache`, training/config.py):

- `memory`: uint8 (H, W, 3) arrays in the items themselves (`Item.pixels`), made in
  the main process before any data-loader exists, so forked workers share them
  (copy-on-write pages that nobody writes); nothing is decoded in a worker.
- `disk`: one `.npy` file per image in a cache folder, named by a hash of the file's
  absolute path, size, modification time, the working side and `FORMAT_VERSION`, so a
  changed file (or another working size) misses and is decoded again. A later run, or
  `--resume`, finds the copies and decodes nothing; workers read the small files.
- `auto` (the default): memory up to the budget (`memory_budget()`), the images beyond
  it on disk; copies already on disk are used as they are.

Decoding goes through `Item.open` (index.runtime.images.open_image: format allowlist, pixel
and shape limits, EXIF orientation, JPEG reduced-scale decoding), so unreadable files
raise the same `ImageDecodeError` as before.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from PIL import Image

from vitrieval.index.evaluation.datasets import DEFAULT_MAX_PIXELS, Item

from .config import DECODE_CACHE_MEMORY_CAP, DECODE_CACHE_MEMORY_SHARE, DECODE_CACHE_MODES

logger = logging.getLogger("vitrieval.train")

CACHE_DIRNAME = "decode-cache"
"""The on-disk cache's folder inside the run folder when no `--decode-cache-dir` is given."""

CROP_MARGIN = 2.0
"""Every crop the transforms take must hold at least this many source pixels per output
pixel, the rule `vitrieval.index.runtime.embedder.Embedder` decodes JPEGs by: the final antialiased
resize
then still sees every detail it keeps, so the cached copy gives (nearly) the tensor the
full-resolution file gives."""

MIN_CROP_ASPECT = 3 / 4
"""The narrowest aspect ratio of the random resized crops (timm's and torchvision's
default range, 3/4 to 4/3, which training/augment.py keeps)."""

RESAMPLE = Image.Resampling.BICUBIC
"""The filter that brings a decoded image down to the working side (antialiased)."""

DRAFT_HEADROOM = 2
"""The reduced-scale decode (JPEG DCT scaling, then a box reduction by an integer
factor) stops at this multiple of the working side; the bicubic resize does the rest.
Box-reducing straight to the working side aliased: the tiny preset's evaluation tensors
then differed from the full file's by 0.046 on average (normalised units) on a 2000 px
photo, against 0.012 with this headroom."""

FORMAT_VERSION = 1
"""Part of every disk cache key: raise it when the cached content changes meaning."""


def working_side(input_size: int, crop_pct: float, crop_scale: float) -> int:
    """Shorter side, in pixels, the cache keeps of an image for a model of `input_size`.

    The smallest random resized crop covers `crop_scale` of the image's area at an
    aspect ratio down to `MIN_CROP_ASPECT`, so its sides are at least
    short_side * sqrt(MIN_CROP_ASPECT * crop_scale); the evaluation transform resizes the
    shorter side to input_size / crop_pct. Both must still get `CROP_MARGIN` source
    pixels per output pixel.
    """
    if not 0 < crop_scale <= 1 or not 0 < crop_pct <= 1:
        raise ValueError(f"crop_scale and crop_pct must lie in (0, 1]: {crop_scale}, {crop_pct}")
    needed = max(1 / math.sqrt(MIN_CROP_ASPECT * crop_scale), 1 / crop_pct)
    return math.ceil(CROP_MARGIN * input_size * needed)


def memory_budget() -> int:
    """Bytes `auto` keeps in memory: `DECODE_CACHE_MEMORY_SHARE` of the machine's RAM,
    at most `DECODE_CACHE_MEMORY_CAP` (the cap alone where RAM cannot be read)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return DECODE_CACHE_MEMORY_CAP
    return min(DECODE_CACHE_MEMORY_CAP, int(ram * DECODE_CACHE_MEMORY_SHARE))


def reduce_to_side(image: Image.Image, side: int) -> Image.Image:
    """`image` with its shorter side brought down to `side` (aspect kept); an image no
    larger is returned as it is, never enlarged."""
    width, height = image.size
    short = min(width, height)
    if short <= side:
        return image
    # the long side is rounded up: the transforms floor the sizes they derive from it,
    # and rounding down here made them lose a pixel (a 2% stretch) far more often
    size = (
        (side, math.ceil(height * side / width))
        if width <= height
        else (math.ceil(width * side / height), side)
    )
    return image.resize(size, RESAMPLE)


@dataclass(frozen=True)
class CachedFileItem(Item):
    """An image file whose working-size copy is `cache_file` (uint8 (H, W, 3) `.npy`).

    Opening reads the copy; if it has gone or is damaged since, the original `path` is
    decoded and reduced to `side` again, so a run never fails on the cache.
    """

    cache_file: Path | None = None
    side: int = 0

    def open(
        self, max_pixels: int = DEFAULT_MAX_PIXELS, draft_size: int | None = None
    ) -> Image.Image:
        try:
            return Image.fromarray(read_cached(self.cache_file))
        except (OSError, ValueError):
            return decode_reduced(Item(self.key, self.label, self.path), self.side, max_pixels)


def decode_reduced(item: Item, side: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode `item`'s file at reduced scale (JPEG draft, box reduction: still at least
    `DRAFT_HEADROOM` x `side`), then resize its shorter side to `side`. Raises
    `ImageDecodeError` as `Item.open`."""
    return reduce_to_side(item.open(max_pixels, draft_size=DRAFT_HEADROOM * side), side)


def read_cached(path: Path | None) -> np.ndarray:
    """The uint8 (H, W, 3) array of a cache file; ValueError if it is not one."""
    if path is None:
        raise ValueError("no cache file")
    array = np.load(path, allow_pickle=False)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"{path}: not a cached RGB image ({array.dtype}, {array.shape})")
    return array


@dataclass
class CacheStats:
    """What a fill did: images decoded, copies found on disk, and where they are kept."""

    decoded: int = 0
    reused: int = 0
    in_memory: int = 0
    memory_bytes: int = 0
    on_disk: int = 0
    disk_bytes: int = 0
    write_failed: int = 0  # copies the disk folder could not take (decoded every epoch)


@dataclass
class DecodeCache:
    """Turns file items into items that open their working-size copy (see the module).

    `mode` is one of DECODE_CACHE_MODES but "off" (no cache then: `for_run` gives
    None); `folder` is where `auto` and `disk` keep files; `budget` the bytes `auto`
    keeps in memory (None: `memory_budget()`).
    """

    mode: str
    side: int
    folder: Path | None = None
    budget: int | None = None
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        if self.mode not in DECODE_CACHE_MODES or self.mode == "off":
            raise ValueError(f"decode cache mode must be auto, memory or disk, not {self.mode!r}")
        if self.mode != "memory" and self.folder is None:
            raise ValueError(f"decode cache mode {self.mode} needs a folder")
        if self.budget is None:
            self.budget = memory_budget()

    @classmethod
    def for_run(
        cls,
        mode: str,
        folder: str | None,
        run: Path,
        data_config: dict,
        crop_scale: float,
    ) -> DecodeCache | None:
        """The cache of a training run (None for mode "off"): the working side from the
        model's `data_config` (input_size (3, H, W), crop_pct) and the run's
        `crop_scale`; the disk folder `folder` or RUN/decode-cache."""
        if mode == "off":
            return None
        side = working_side(
            max(data_config["input_size"][1:]), float(data_config["crop_pct"]), crop_scale
        )
        return cls(mode, side, Path(folder) if folder else run / CACHE_DIRNAME)

    def load(self, item: Item) -> Item:
        """`item` as an item that opens its working-size copy, decoding the file only if
        no valid copy is on disk. Items without a file are returned as they are.
        Raises `ImageDecodeError` for a file that cannot be decoded."""
        if item.path is None:
            return item
        target = self._disk_file(item) if self.mode != "memory" else None
        if target is not None and _complete(target):
            self.stats.reused += 1
            return self._on_disk(item, target)
        array = np.asarray(decode_reduced(item, self.side))
        self.stats.decoded += 1
        keep_in_memory = self.mode == "memory" or (
            self.mode == "auto" and self.stats.memory_bytes + array.nbytes <= self.budget
        )
        if keep_in_memory or target is None:
            self.stats.in_memory += 1
            self.stats.memory_bytes += array.nbytes
            # Item.open serves `pixels` before `path`: the file is not read again
            return replace(item, pixels=array)
        try:
            _write(target, array)
        except OSError as exc:
            # the cache only saves time: a folder that cannot take the copy (full,
            # read-only, not a folder) leaves the item to be decoded every epoch
            if not self.stats.write_failed:
                logger.warning("decode cache: cannot write to %s (%s); images it cannot "
                               "hold are decoded every epoch", target.parent, exc)  # fmt: skip
            self.stats.write_failed += 1
            return item
        return self._on_disk(item, target)

    def summary(self) -> str:
        """One line for the console: working side, decodes, reuse, where the copies are."""
        s = self.stats
        where = [f"{s.in_memory:,} in memory ({s.memory_bytes / 2**20:,.1f} MiB)"]
        if s.on_disk:
            mib = s.disk_bytes / 2**20
            where.append(f"{s.on_disk:,} on disk ({mib:,.1f} MiB in {self.folder})")
        return (
            f"decode cache ({self.mode}): shorter side {self.side} px; {s.decoded:,} images "
            f"decoded, {s.reused:,} found on disk; {', '.join(where)}"
        )

    def _disk_file(self, item: Item) -> Path | None:
        """The cache file of `item`'s file as it is now (None if it cannot be stat'ed:
        decoding then reports why)."""
        try:
            path = os.path.abspath(item.path)
            info = os.stat(path)
        except OSError:
            return None
        key = f"{FORMAT_VERSION}\0{self.side}\0{path}\0{info.st_size}\0{info.st_mtime_ns}"
        digest = hashlib.sha256(key.encode()).hexdigest()
        return self.folder / digest[:2] / f"{digest}.npy"

    def _on_disk(self, item: Item, target: Path) -> CachedFileItem:
        self.stats.on_disk += 1
        self.stats.disk_bytes += target.stat().st_size
        return CachedFileItem(item.key, item.label, item.path, cache_file=target, side=self.side)


_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def _complete(path: Path) -> bool:
    """Whether `path` is a whole uint8 (H, W, 3) `.npy` file, judged by its header and
    size (a copy cut short by a crash is decoded again)."""
    try:
        with open(path, "rb") as fh:
            read_header = _HEADER_READERS.get(np.lib.format.read_magic(fh))
            if read_header is None:
                return False
            shape, fortran, dtype = read_header(fh)
            offset = fh.tell()
        size = path.stat().st_size
    except (OSError, ValueError):
        return False
    return (
        dtype == np.uint8
        and not fortran
        and len(shape) == 3
        and shape[2] == 3
        and size == offset + math.prod(shape)
    )


def _write(target: Path, array: np.ndarray) -> None:
    """Write `array` to `target` via a temporary file and a rename, so a reader (another
    run sharing the folder) never sees half a file. Not fsynced: a copy lost in a crash
    is only decoded again."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as fh:
            np.save(fh, np.ascontiguousarray(array), allow_pickle=False)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
