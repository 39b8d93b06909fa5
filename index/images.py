"""Safe image decoding: every image vitrieval reads goes through `open_image`.

Decoding untrusted files is where an image service gets hurt, so the rules live in
one place:

- a format allowlist (JPEG, PNG, WebP, BMP, GIF, TIFF): anything else is refused
  before the pixel data is touched;
- a pixel limit checked from the header, before decoding, against decompression
  bombs (a small file that expands to gigabytes);
- EXIF orientation applied, so a photo taken sideways is embedded upright;
- the result is always 3-channel RGB (palette, alpha and grey images converted;
  transparent areas composited on white).

Failures raise `ImageDecodeError` with a message meant for the user.
"""

from __future__ import annotations

import io
import os
import warnings

from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

ALLOWED_FORMATS: frozenset[str] = frozenset({"JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF", "MPO"})
"""PIL format names accepted by `open_image` (MPO is the multi-picture JPEG of phones)."""

DEFAULT_MAX_PIXELS = 40_000_000
"""Largest width x height decoded by default (a 40-megapixel photo)."""

# Truncated files must raise, not decode into half-grey images.
ImageFile.LOAD_TRUNCATED_IMAGES = False


class ImageDecodeError(ValueError):
    """An image could not be decoded safely; `str(error)` says why."""


class ImageTooLargeError(ImageDecodeError):
    """The header announces more pixels than the configured limit."""


class UnsupportedFormatError(ImageDecodeError):
    """The file is not an image, or not one of `ALLOWED_FORMATS`."""


Source = str | os.PathLike[str] | bytes


def open_image(
    source: Source, max_pixels: int = DEFAULT_MAX_PIXELS, draft_size: int | None = None
) -> Image.Image:
    """Decode `source` (a path or the encoded bytes) into an upright RGB image.

    `draft_size`: for JPEG, let the decoder scale down by 1/2, 1/4 or 1/8 in the DCT
    domain while both sides stay >= draft_size. A model that will shrink the image to
    that size anyway gets nearly the same input (cosine agreement of embeddings >= 0.999
    in the tests) at a fraction of the decoding time.

    Raises `ImageDecodeError` (or a subclass) for a missing, corrupt, truncated,
    oversized or disallowed file.
    """
    name = "<bytes>" if isinstance(source, bytes) else str(source)
    try:
        fp = io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")  # noqa: SIM115
    except OSError as exc:
        raise ImageDecodeError(f"{name}: cannot read file ({exc.strerror or exc})") from None
    with fp:
        try:
            with warnings.catch_warnings():
                # PIL warns (DecompressionBombWarning) before it raises; our own limit
                # below is what decides, so the warning is noise.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(fp, formats=None)
        except UnidentifiedImageError:
            raise UnsupportedFormatError(f"{name}: not a recognised image file") from None
        except Image.DecompressionBombError as exc:
            raise ImageTooLargeError(f"{name}: {exc}") from None
        except OSError as exc:
            raise ImageDecodeError(f"{name}: cannot decode image ({exc})") from None

        if image.format not in ALLOWED_FORMATS:
            raise UnsupportedFormatError(
                f"{name}: format {image.format} is not accepted "
                f"(allowed: {', '.join(sorted(ALLOWED_FORMATS))})"
            )
        width, height = image.size
        if width * height > max_pixels:
            raise ImageTooLargeError(
                f"{name}: {width}x{height} = {width * height:,} pixels exceeds the limit "
                f"of {max_pixels:,}"
            )
        if width == 0 or height == 0:
            raise ImageDecodeError(f"{name}: image has no pixels ({width}x{height})")
        try:
            if draft_size and image.format in ("JPEG", "MPO"):
                image.draft("RGB", (draft_size, draft_size))
            image.load()
            image = ImageOps.exif_transpose(image)
            return _to_rgb(image)
        except Image.DecompressionBombError as exc:
            raise ImageTooLargeError(f"{name}: {exc}") from None
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            raise ImageDecodeError(f"{name}: corrupt or truncated image ({exc})") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image.convert("RGBA"), mask=image.convert("RGBA").getchannel("A"))
        return background
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit greyscale: scale into 8 bits rather than clipping.
        image = image.point(lambda v: v / 256).convert("L")
    return image.convert("RGB")
