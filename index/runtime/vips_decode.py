"""Optional libvips decoding of large PNG and WebP files (`pip install 'vitrieval[vips]'`).

`vitrieval.index.runtime.images.open_image` stays the one entry point and keeps every check: the
file's
header is read by Pillow first (`plan_decode`: format allowlist, pixel limit, aspect
ratio, memory plan, the same errors), and only then, for an image this module
reproduces, libvips decodes the pixels instead of Pillow:

- PNG streamed a band of rows at a time, then the same integer box reduction as the
  Pillow path; WebP with libwebp's scaled decoding to about the same reduced size.
  Pillow decodes both at full size (`draft` is JPEG-only), which is what makes them
  slow: libvips is 1.1-2.1x faster on PNG (median 1.5x) and 1.8-2.4x on WebP from
  4 MP (bench/decoders.py, docs/benchmarks.md);
- JPEG stays with Pillow: its `draft` already decodes at reduced scale, and libvips
  measured no faster (its jpegload shrink-on-load 0.45-1.5x, about 1x at 12-18 MP;
  `pyvips.Image.thumbnail` 0.1-0.8x);
- only 8-bit greyscale, RGB and their alpha variants whose libvips header agrees with
  Pillow's (size, bands, 8 bits), from `VIPS_MIN_PIXELS` on, and WebP only when it is
  reduced: palette, 16-bit, colour-keyed PNG, small files and every other format go
  to Pillow, whose conversions are the reference;
- alpha is composited on white before the reduction, EXIF orientation (read from the
  header by Pillow) applied after it, as in the Pillow path; ICC profiles are ignored
  by both. The result equals Pillow's within rounding, or within the difference of
  libwebp's resampler for a reduced WebP (`tests/test_decoders.py`);
- each format's loader is named explicitly (`pngload`, `webpload`), so no other
  libvips loader ever parses an untrusted file, and untrusted loaders are blocked;
- a truncated file raises (`fail_on="truncated"`), like Pillow without
  `LOAD_TRUNCATED_IMAGES`; every libvips error becomes `ImageDecodeError`.

Memory: a libvips decode is planned as Pillow's (`plan_decode`) plus `VIPS_FIXED_BYTES`
(its thread and buffers), and `plan.decoder` says which decoder the plan is for. libvips
streams a PNG and decodes a WebP at the reduced size, so it mostly holds far less (18 MP:
41 MiB for PNG, 12 MiB for WebP, against 80 and 280 MiB with Pillow), but its buffers
grow with the width, so it is used only up to `VIPS_MAX_WIDTH` and `VIPS_MAX_ASPECT`:1,
where its measured peak stays within the plan (`tests/test_decoders.py` checks it).

`VITRIEVAL_DECODER` chooses: `auto` (the default: libvips when `pyvips` imports and
libvips starts, Pillow otherwise), `pillow`, or `vips` (an error if libvips cannot be
used). libvips is told to use one worker thread per decode and to cache nothing: the
embedder already decodes in parallel threads, and a cached decode would hold memory
outside the budget.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType
from typing import Any

import numpy as np
from PIL import Image

from .image_errors import EXIF_ORIENTATION, ImageDecodeError

logger = logging.getLogger(__name__)

DECODER_ENV = "VITRIEVAL_DECODER"
"""Environment variable naming the decoder: one of `DECODERS`."""
DECODERS = ("auto", "pillow", "vips")

_LOADERS = {"PNG": "pngload", "WEBP": "webpload"}
"""Pillow format -> the libvips loader used for it; other formats are Pillow's."""
_BANDS = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}
"""Pillow modes libvips decodes (8 bits a sample), with their band counts."""
VIPS_MIN_PIXELS = {"PNG": 250_000, "WEBP": 3_000_000}
"""Smallest image (width x height) each format goes to libvips at: below, a libvips
call's set-up costs more than it saves (bench/decoders.py; docs/index.md)."""
VIPS_MAX_WIDTH = 8192
VIPS_MAX_ASPECT = 3
"""libvips's buffers grow with the image's width (a 30000 x 1000 RGBA PNG peaked at
304 MiB, twice Pillow's plan): it decodes only the shapes where its measured peak stays
within the plan below; wider images and panoramas go to Pillow."""
VIPS_FIXED_BYTES = 16 << 20
"""Added to the Pillow plan for a libvips decode: its worker thread, region buffers and
caches, which a small image's plan would not cover."""


class VipsUnavailableError(RuntimeError):
    """`VITRIEVAL_DECODER=vips` was asked for, but pyvips or libvips cannot be used."""


def decoder_setting() -> str:
    """The decoder `VITRIEVAL_DECODER` asks for (`auto` when unset)."""
    value = os.environ.get(DECODER_ENV, "auto").strip().lower() or "auto"
    if value not in DECODERS:
        raise ValueError(f"{DECODER_ENV}={value!r}: expected one of {', '.join(DECODERS)}")
    return value


_started_in: int | None = None
"""The process that started libvips (None: not started here or in a parent)."""


def forked_after_start() -> bool:
    """Whether this process is a fork of one that had started libvips.

    libvips runs threads of its own (even with `concurrency_set(1)`); a fork copies
    their locks in whatever state they were, so a decode in the child can wait forever
    (DataLoader workers forked by a training run that decoded a PNG first). Such a
    child decodes with Pillow."""
    return _started_in is not None and _started_in != os.getpid()


@functools.cache
def _load_pyvips() -> tuple[ModuleType | None, str]:
    """pyvips set up for untrusted files, or None and why not (imported once)."""
    global _started_in
    try:
        import pyvips
    except (ImportError, OSError) as exc:
        return None, f"pyvips does not import ({exc})"
    _started_in = os.getpid()
    try:
        pyvips.cache_set_max(0)  # a cached decode would hold memory outside the budget
        pyvips.concurrency_set(1)  # the embedder's decode threads are the parallelism
        pyvips.block_untrusted_set(True)
        pyvips.Image.black(1, 1).avg()  # libvips itself starts and runs
    except Exception as exc:  # pyvips.Error, or a libvips too old for the calls above
        return None, f"libvips does not work ({exc})"
    return pyvips, ""


def active_decoder() -> str:
    """`vips` or `pillow`: what `open_image` decodes with under the current setting."""
    setting = decoder_setting()
    if setting == "pillow" or forked_after_start():
        return "pillow"
    pyvips, why = _load_pyvips()
    if pyvips is None:
        if setting == "vips":
            raise VipsUnavailableError(
                f"{DECODER_ENV}=vips but {why}; install it with pip install 'vitrieval[vips]'"
            )
        return "pillow"
    return "vips"


_hinted = False


def hint_if_missing(image: Image.Image, reduce: int) -> None:
    """Once per process, when Pillow decodes a file libvips would have taken because
    pyvips is not installed (or libvips does not start) under the `auto` setting, say
    that the `vips` extra exists: nothing else would tell why large PNG and WebP files
    decode about 2x slower, with more memory (docs/benchmarks.md)."""
    global _hinted
    if _hinted or decoder_setting() != "auto" or forked_after_start():
        return
    if not handles(image, reduce):
        return
    pyvips, why = _load_pyvips()
    if pyvips is not None:
        return
    _hinted = True  # a race may say it twice; a lock per decode would cost more
    logger.warning(
        "large %s files are decoded by Pillow because %s: pip install 'vitrieval[vips]' "
        "decodes them about 2x faster with less memory (said once)",
        image.format,
        why,
    )


def handles(image: Image.Image, reduce: int) -> bool:
    """Whether libvips decodes this opened image, `reduce` its plan's box reduction:
    PNG, and WebP that is reduced (libvips is faster only by decoding a WebP scaled),
    in an 8-bit grey or RGB mode (with alpha), from `VIPS_MIN_PIXELS` on, up to
    `VIPS_MAX_WIDTH` wide and `VIPS_MAX_ASPECT`:1."""
    minimum = VIPS_MIN_PIXELS.get(image.format or "")
    width, height = image.size
    return (
        minimum is not None
        and image.mode in _BANDS
        and width * height >= minimum
        and width <= VIPS_MAX_WIDTH
        and max(width, height) <= VIPS_MAX_ASPECT * min(width, height)
        and (image.format != "WEBP" or reduce > 1)
    )


def decode(
    source: str | os.PathLike[str] | bytes,
    image: Image.Image,
    reduce: int,
    name: str,
) -> Image.Image | None:
    """Decode `source` with libvips into the RGB image the Pillow path reduces it to,
    before EXIF orientation (`header_orientation` gives it; the caller turns it).

    `image` is the Pillow image whose header was read and checked (`handles(image,
    reduce)`), `reduce` the plan's box reduction. Returns None when
    libvips reads the header otherwise than Pillow (the caller decodes with Pillow);
    raises `ImageDecodeError` when libvips fails on the pixels.
    """
    pyvips, _ = _load_pyvips()
    assert pyvips is not None, "decode() without active_decoder() == 'vips'"
    options: dict[str, Any] = {"access": "sequential", "fail_on": "truncated"}
    loader = _LOADERS[image.format or ""]
    factor = reduce
    if loader == "webpload" and reduce > 1:
        options["scale"], factor = 1 / reduce, 1  # libwebp's own scaled decoding
    try:
        if isinstance(source, bytes):
            vimage = getattr(pyvips.Image, loader + "_buffer")(source, **options)
        else:
            vimage = getattr(pyvips.Image, loader)(os.fspath(source), **options)
        header_agrees = vimage.format == "uchar" and vimage.bands == _BANDS[image.mode]
        if factor == reduce:  # not scaled on load: the full size
            header_agrees &= (vimage.width, vimage.height) == image.size
        if not header_agrees:
            logger.debug("%s: libvips reads the header otherwise, decoding with Pillow", name)
            return None
        if vimage.hasalpha() or factor > 1:
            # in float, rounded once at the end, as Pillow rounds its compositing and
            # its `reduce` (libvips truncates both in 8 bits: half a level darker)
            vimage = vimage.cast("float")
            if vimage.hasalpha():
                vimage = vimage.flatten(background=[255] * (vimage.bands - 1))
            if factor > 1:
                # ceil: the partial boxes at the right and bottom edges are kept, as
                # Pillow keeps them, so both give the plan's output size
                vimage = vimage.shrink(factor, factor, ceil=True)
            vimage = (vimage + 0.5).cast("uchar")
        pixels = vimage.numpy()
    except pyvips.Error as exc:
        detail = " ".join(str(exc).split())[:200]
        raise ImageDecodeError(f"{name}: corrupt or truncated image ({detail})") from None
    if pixels.ndim == 2 or pixels.shape[2] == 1:
        pixels = np.repeat(pixels.reshape(pixels.shape[0], pixels.shape[1], 1), 3, axis=2)
    return Image.fromarray(np.ascontiguousarray(pixels), "RGB")


def header_orientation(image: Image.Image) -> object:
    """The EXIF orientation from the header Pillow read. A PNG's eXIf chunk counts only
    before the pixel data (where the PNG specification puts it): asking Pillow for one
    after it would decode the whole image."""
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    return image.getexif().get(EXIF_ORIENTATION, 1)
