"""Safe image decoding: every image vitrieval reads goes through `open_image`.

Decoding untrusted files is where an image service gets hurt, so the rules live in
one place:

- a format allowlist (JPEG, PNG, WebP, BMP, GIF, TIFF): anything else is refused
  before the pixel data is touched;
- a pixel limit and an aspect-ratio limit checked from the header, before decoding,
  against decompression bombs (a small file that expands to gigabytes) and strips of
  pixels that would blow up in the resize;
- memory known before decoding (`plan_decode`): large images are shrunk strip by
  strip as they are converted, so no full-size RGBA or RGB copy is ever made;
- EXIF orientation applied, so a photo taken sideways is embedded upright;
- the result is always 3-channel RGB (palette, alpha and grey images converted;
  transparent areas composited on white).

Failures raise `ImageDecodeError` with a message meant for the user.

With the `vips` extra installed, libvips decodes the pixels of large PNG and WebP
files after these header checks (`index/runtime/vips_decode.py`, `VITRIEVAL_DECODER`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import stat
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import BinaryIO

from PIL import Image, ImageFile, PngImagePlugin, UnidentifiedImageError

# defined apart so that the decoders this module dispatches to need not import it back
from .image_errors import EXIF_ORIENTATION as EXIF_ORIENTATION
from .image_errors import ImageDecodeError as ImageDecodeError

ALLOWED_FORMATS: frozenset[str] = frozenset({"JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF", "MPO"})
"""PIL format names accepted by `open_image` (MPO is the multi-picture JPEG of phones)."""

DEFAULT_MAX_PIXELS = 40_000_000
"""Largest width x height decoded by default (a 40-megapixel photo)."""

MAX_ASPECT_RATIO = 100
"""Longest side / shortest side accepted: panoramas are 2:1 to 10:1; beyond 100:1 the
aspect-preserving resize of the preprocessing would build a huge intermediate image
for a picture that is a line of pixels."""

STRIP_PIXELS = 1 << 20
"""Pixels converted to RGB at once when a large image is reduced (see `_to_rgb_reduced`)."""
STRIP_BYTES_PER_PIXEL = 16
"""Bound on the bytes a strip pixel takes while converted: an RGBA copy, its alpha
channel and the RGB result (4 + 1 + 4, padded), or the 32-bit copy of a 16-bit pixel."""

# Truncated files must raise, not decode into half-grey images.
ImageFile.LOAD_TRUNCATED_IMAGES = False
# PNG text chunks are decompressed when the header is read; vitrieval uses none, so
# they may not cost more than this (Pillow allows 64 MB of them)
PngImagePlugin.MAX_TEXT_CHUNK = PngImagePlugin.MAX_TEXT_MEMORY = 256 * 1024


class ImageTooLargeError(ImageDecodeError):
    """The header announces more pixels (or decoded bytes) than the configured limit."""


class UnsupportedFormatError(ImageDecodeError):
    """The file is not an image, or not one of `ALLOWED_FORMATS`."""


class ImageShapeError(ImageDecodeError):
    """The image's aspect ratio is beyond `MAX_ASPECT_RATIO`."""


class DecodeBudgetBusy(RuntimeError):
    """No decode memory became free in time: the server is overloaded, the image is fine."""


Source = str | os.PathLike[str] | bytes


class DecodeBudget:
    """Bytes that concurrent decodes may hold at once, shared by threads.

    A decode reserves its `DecodePlan.peak_bytes` before touching pixels and gives them
    back when done, so the memory of all decodes in flight stays under `total_bytes`
    however many requests arrive: an image whose plan alone exceeds it is refused
    (`ImageTooLargeError`), one that does not fit now waits up to `wait_s` for others
    to finish, then `DecodeBudgetBusy`.
    """

    def __init__(self, total_bytes: int, wait_s: float = 10.0) -> None:
        if total_bytes < 1:
            raise ValueError(f"total_bytes must be >= 1, got {total_bytes}")
        self.total_bytes = total_bytes
        self.wait_s = wait_s
        self.used_bytes = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def reserve(self, nbytes: int, name: str = "<bytes>") -> Iterator[None]:
        if nbytes > self.total_bytes:
            raise ImageTooLargeError(
                f"{name}: decoding needs about {nbytes / 2**20:,.0f} MiB, more than the "
                f"decode memory budget of {self.total_bytes / 2**20:,.0f} MiB"
            )
        with self._changed:
            fits = self._changed.wait_for(
                lambda: self.used_bytes + nbytes <= self.total_bytes, timeout=self.wait_s
            )
            if not fits:
                raise DecodeBudgetBusy(f"no decode memory came free within {self.wait_s:g} s")
            self.used_bytes += nbytes
        try:
            yield
        finally:
            with self._changed:
                self.used_bytes -= nbytes
                self._changed.notify_all()


@dataclass(frozen=True)
class DecodePlan:
    """How an image will be decoded, decided from its header before any pixel is read.

    `frame` is the size of the decoded frame (after a JPEG's reduced-scale decoding),
    `reduce` the integer factor it is then shrunk by, and `peak_bytes` a bound on the
    memory the decode holds at once: the frame in its decoded mode, one strip being
    converted, and the RGB result (Pillow stores 3-band images in 4 bytes a pixel).
    """

    format: str
    size: tuple[int, int]
    mode: str
    frame: tuple[int, int]
    reduce: int
    decoder_bytes: int = 0  # what the format's decoder holds beside the frame
    decoder: str = "pillow"  # or "vips" (index/runtime/vips_decode.py)

    @property
    def frame_bytes(self) -> int:
        return self.frame[0] * self.frame[1] * _pixel_bytes(self.mode)

    @property
    def output_size(self) -> tuple[int, int]:
        return (-(-self.frame[0] // self.reduce), -(-self.frame[1] // self.reduce))

    @property
    def peak_bytes(self) -> int:
        width, height = self.output_size
        strip = min(self.frame[1], _strip_rows(self.frame[0], self.reduce)) * self.frame[0]
        return (
            self.frame_bytes
            + self.decoder_bytes
            + strip * STRIP_BYTES_PER_PIXEL
            + width * height * 4
        )


def plan_decode(
    source: Source, max_pixels: int = DEFAULT_MAX_PIXELS, draft_size: int | None = None
) -> DecodePlan:
    """Read only the header of `source` and return its `DecodePlan`; the same checks
    as `open_image` (format, pixel limit, aspect ratio) raise the same errors."""
    with _opened(source) as (image, name):
        return _plan(image, name, max_pixels, draft_size)


def open_image(
    source: Source, max_pixels: int = DEFAULT_MAX_PIXELS, draft_size: int | None = None
) -> Image.Image:
    """Decode `source` (a path or the encoded bytes) into an upright RGB image.

    `draft_size`: the caller will shrink the image to about this size anyway, so it may
    be decoded smaller while both sides stay >= draft_size: JPEG in the DCT domain (by
    1/2, 1/4 or 1/8, Pillow's `draft`), then every format by an integer box reduction
    done strip by strip, so a large palette, alpha or 16-bit image never exists in
    full as RGBA/RGB. A model that shrinks to that size gets nearly the same input
    (cosine agreement of embeddings >= 0.999 in the tests) for a fraction of the time
    and memory. Without it, every pixel is kept.

    Memory is bounded by `plan_decode(...).peak_bytes`, known before decoding.
    Raises `ImageDecodeError` (or a subclass) for a missing, corrupt, truncated,
    oversized, oddly shaped or disallowed file.
    """
    with _opened(source) as (image, name):
        plan = _plan(image, name, max_pixels, draft_size)  # sets a JPEG's draft too
        if plan.decoder == "vips":
            from . import vips_decode

            reduced = vips_decode.decode(source, image, plan.reduce, name)
            if reduced is not None:
                return _upright(reduced, vips_decode.header_orientation(image))
        try:
            image.load()
            if image.size != plan.frame:  # the decoder chose otherwise: plan again
                plan = replace(plan, frame=image.size, mode=image.mode)
            orientation = image.getexif().get(EXIF_ORIENTATION, 1)
            # reduce first, turn upright after: the turn copies only the small result
            return _upright(_to_rgb_reduced(image, plan.reduce), orientation)
        except Image.DecompressionBombError as exc:
            raise ImageTooLargeError(f"{name}: {exc}") from None
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            raise ImageDecodeError(f"{name}: corrupt or truncated image ({exc})") from None


NON_BLOCKING = getattr(os, "O_NONBLOCK", 0)  # POSIX; 0 elsewhere (no FIFOs to wait on)


def _regular_file(path: str | os.PathLike[str], name: str) -> BinaryIO:
    """`path` opened for reading, refused unless it is a regular file: opening a FIFO
    waits for a writer and reading a device never ends, so a decode would hang on one
    (opened non-blocking to look, then read as a file is)."""
    fd = os.open(path, os.O_RDONLY | NON_BLOCKING)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ImageDecodeError(f"{name}: not a regular file (a folder, pipe, device or socket)")
        if NON_BLOCKING:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")  # owns the descriptor from here


@contextlib.contextmanager
def _opened(source: Source) -> Iterator[tuple[Image.Image, str]]:
    """`Image.open` with the allowlist applied: the header is parsed, no pixels read."""
    name = "<bytes>" if isinstance(source, bytes) else str(source)
    try:
        fp = io.BytesIO(source) if isinstance(source, bytes) else _regular_file(source, name)
    except OSError as exc:
        raise ImageDecodeError(f"{name}: cannot read file ({exc.strerror or exc})") from None
    with fp:
        try:
            with warnings.catch_warnings():
                # PIL warns (DecompressionBombWarning) before it raises; our own limit
                # is what decides, so the warning is noise.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                # only the allowed formats' plugins ever parse an untrusted header
                image = Image.open(fp, formats=_open_formats())
        except UnidentifiedImageError:
            raise UnsupportedFormatError(
                f"{name}: not a recognised image file of an accepted format "
                f"({', '.join(sorted(ALLOWED_FORMATS))})"
            ) from None
        except Image.DecompressionBombError as exc:
            raise ImageTooLargeError(f"{name}: {exc}") from None
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            raise ImageDecodeError(f"{name}: cannot decode image ({exc})") from None
        if image.format not in ALLOWED_FORMATS:
            raise UnsupportedFormatError(
                f"{name}: format {image.format} is not accepted "
                f"(allowed: {', '.join(sorted(ALLOWED_FORMATS))})"
            )
        yield image, name


@functools.cache
def _open_formats() -> list[str]:
    """The plugins `Image.open` may try: the allowed formats that have one (an MPO
    file is opened by the JPEG plugin)."""
    Image.init()
    return [name for name in sorted(ALLOWED_FORMATS) if name in Image.OPEN]


def _plan(image: Image.Image, name: str, max_pixels: int, draft_size: int | None) -> DecodePlan:
    width, height = image.size
    if width * height > max_pixels:
        raise ImageTooLargeError(
            f"{name}: {width}x{height} = {width * height:,} pixels exceeds the limit "
            f"of {max_pixels:,}"
        )
    if width == 0 or height == 0:
        raise ImageDecodeError(f"{name}: image has no pixels ({width}x{height})")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ImageShapeError(
            f"{name}: {width}x{height} is more than {MAX_ASPECT_RATIO}:1 (a strip, not a picture)"
        )
    frame, mode = (width, height), image.mode
    decoder = 0
    if image.format in ("JPEG", "MPO"):
        if image.info.get("progressive") or image.info.get("progression"):
            # libjpeg keeps every coefficient of a progressive file at full size,
            # whatever the scale it decodes to: 2 bytes a sample
            decoder = width * height * len(image.getbands()) * 2
        if draft_size:
            image.draft("RGB", (draft_size, draft_size))  # sets the size it will decode to
            frame, mode = image.size, image.mode
    elif image.format == "WEBP":
        decoder = 2 * width * height * 4  # libwebp's buffer and the canvas it is copied to
    reduce = max(1, min(frame) // draft_size) if draft_size else 1
    from . import vips_decode  # imports this module: loaded on first use

    if vips_decode.active_decoder() == "vips" and vips_decode.handles(image, reduce):
        decoder += vips_decode.VIPS_FIXED_BYTES
        return DecodePlan(image.format, (width, height), mode, frame, reduce, decoder, "vips")
    vips_decode.hint_if_missing(image, reduce)
    return DecodePlan(image.format, (width, height), mode, frame, reduce, decoder)


def _pixel_bytes(mode: str) -> int:
    """Bytes a pixel takes in Pillow's memory for `mode`: 1 for 1/L/P, 2 for the 16-bit
    modes, 4 for every multi-band and 32-bit mode (3-band images are padded to 4)."""
    if mode in ("1", "L", "P"):
        return 1
    if mode.startswith("I;16"):
        return 2
    return 4


def _strip_rows(width: int, factor: int) -> int:
    """Rows converted at once: about STRIP_PIXELS pixels, a multiple of the reduction."""
    rows = max(1, STRIP_PIXELS // max(1, width))
    return max(factor, rows - rows % factor)


def _to_rgb_reduced(image: Image.Image, factor: int) -> Image.Image:
    """`image` as RGB, box-reduced by `factor`, converted a strip of rows at a time so
    the RGBA/RGB copies of a large image are never whole. Strips start at multiples of
    `factor`, so the result equals converting the whole image, then reducing it."""
    if factor == 1 and image.mode == "RGB":
        return image
    width, height = image.size
    rows = _strip_rows(width, factor)
    if rows >= height:
        rgb = _to_rgb(image)
        return rgb.reduce(factor) if factor > 1 else rgb
    out = Image.new("RGB", (-(-width // factor), -(-height // factor)))
    for top in range(0, height, rows):
        strip = _to_rgb(image.crop((0, top, width, min(height, top + rows))))
        out.paste(strip.reduce(factor) if factor > 1 else strip, (0, top // factor))
    return out


_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
"""EXIF orientation -> the transposition that shows the image upright."""


def _upright(image: Image.Image, orientation: object) -> Image.Image:
    method = _UPRIGHT.get(orientation) if isinstance(orientation, int) else None
    return image.transpose(method) if method is not None else image


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit greyscale: scale into 8 bits rather than clipping.
        image = image.point(lambda v: v / 256).convert("L")
    return image.convert("RGB")
