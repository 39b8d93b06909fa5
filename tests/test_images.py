"""Safe decoding: orientation, colour modes, limits and broken files."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata

from index.images import (
    ImageDecodeError,
    ImageTooLargeError,
    UnsupportedFormatError,
    open_image,
)


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP"])
def test_real_photo_round_trips_as_rgb(fmt):
    photo = Image.fromarray(skdata.coffee())
    decoded = open_image(encode(photo, fmt))
    assert decoded.mode == "RGB" and decoded.size == photo.size
    diff = np.abs(np.asarray(decoded, np.int16) - np.asarray(photo, np.int16)).mean()
    assert diff < 6  # lossless formats give 0, JPEG/WebP (quality 75) about 4


def test_exif_orientation_is_applied():
    wide = Image.new("RGB", (40, 20), (200, 10, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    decoded = open_image(encode(wide, "JPEG", exif=exif))
    assert decoded.size == (20, 40)


def test_grey_palette_and_alpha_become_rgb(tmp_path):
    grey = Image.fromarray(skdata.camera())
    assert open_image(encode(grey, "PNG")).mode == "RGB"
    transparent = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    assert open_image(encode(transparent, "PNG")).getpixel((0, 0)) == (255, 255, 255)
    palette = grey.convert("P")
    path = tmp_path / "p.gif"
    palette.save(path)
    assert open_image(path).mode == "RGB"


def test_pixel_limit_is_checked_before_decoding():
    big = encode(Image.new("L", (3000, 3000)), "PNG")
    with pytest.raises(ImageTooLargeError, match="exceeds the limit"):
        open_image(big, max_pixels=1_000_000)
    assert open_image(big, max_pixels=10_000_000).size == (3000, 3000)


def test_disallowed_format_is_refused():
    with pytest.raises(UnsupportedFormatError, match="not accepted"):
        open_image(encode(Image.new("RGB", (8, 8)), "PPM"))


@pytest.mark.parametrize(
    "payload",
    [b"", b"hello, not an image", encode(Image.fromarray(skdata.coffee()), "JPEG")[:2000]],
    ids=["empty", "text", "truncated-jpeg"],
)
def test_broken_input_raises_decode_error(payload):
    with pytest.raises(ImageDecodeError):
        open_image(payload)


def test_missing_file(tmp_path):
    with pytest.raises(ImageDecodeError, match="cannot read"):
        open_image(tmp_path / "none.jpg")
