"""Safe decoding: orientation, colour modes, limits and broken files."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata

from vitrieval.index.runtime.images import (
    ImageDecodeError,
    ImageTooLargeError,
    UnsupportedFormatError,
    open_image,
)
from vitrieval.index.runtime.vips_decode import DECODER_ENV


@pytest.fixture(autouse=True)
def pillow_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests pin the Pillow path (its strips and plans); tests/test_decoders.py
    holds libvips's to the same results."""
    monkeypatch.setenv(DECODER_ENV, "pillow")


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
    with pytest.raises(UnsupportedFormatError, match="not a recognised image file of an accepted"):
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


@pytest.mark.timeout(30)  # without the check, opening the FIFO waits for good
def test_a_pipe_or_folder_named_as_an_image_is_refused_without_waiting(tmp_path):
    # opening a FIFO for reading waits for a writer: a decode must refuse it at once
    os.mkfifo(tmp_path / "pipe.png")
    with pytest.raises(ImageDecodeError, match="not a regular file"):
        open_image(tmp_path / "pipe.png")
    with pytest.raises(ImageDecodeError, match="not a regular file"):
        open_image(tmp_path)


# -- decoding memory: the plan, strip-wise reduction, the shared budget ------------------


def test_decode_plan_is_read_from_the_header() -> None:
    from vitrieval.index.runtime.images import STRIP_BYTES_PER_PIXEL, plan_decode

    palette = Image.new("P", (4000, 3000))
    plan = plan_decode(encode(palette, "PNG", transparency=0), draft_size=200)
    assert (plan.format, plan.mode, plan.size, plan.frame, plan.reduce) == (
        "PNG",
        "P",
        (4000, 3000),
        (4000, 3000),
        15,  # 3000 // 200: both sides stay >= 200
    )
    assert plan.output_size == (267, 200)
    strip_rows = 255  # 2**20 // 4000 = 262 rows, cut to a multiple of 15
    assert plan.peak_bytes == 4000 * 3000 * 1 + strip_rows * 4000 * STRIP_BYTES_PER_PIXEL + (
        267 * 200 * 4
    )
    grey16 = plan_decode(encode(Image.new("I;16", (100, 50)), "PNG"))
    assert grey16.mode == "I;16" and grey16.frame_bytes == 100 * 50 * 2 and grey16.reduce == 1
    jpeg = plan_decode(encode(Image.new("RGB", (1600, 1200)), "JPEG"), draft_size=150)
    assert jpeg.frame == (200, 150) and jpeg.reduce == 1  # DCT scaling by 1/8
    odd = plan_decode(encode(Image.new("RGB", (6001, 3001)), "JPEG"), draft_size=300)
    assert odd.frame == (751, 376) and odd.decoder_bytes == 0  # ceil(6001 / 8), baseline
    progressive = encode(Image.new("RGB", (640, 480)), "JPEG", progressive=True)
    assert plan_decode(progressive, draft_size=100).decoder_bytes == 640 * 480 * 3 * 2
    assert plan_decode(encode(Image.new("RGB", (64, 32)), "WEBP")).decoder_bytes == 2 * 64 * 32 * 4


def test_the_planned_jpeg_draft_size_is_what_pillow_decodes() -> None:
    from vitrieval.index.runtime.images import plan_decode

    for size, draft in (((1601, 1203), 150), ((999, 333), 100), ((640, 480), 300)):
        data = encode(Image.new("RGB", size, (10, 20, 30)), "JPEG")
        assert plan_decode(data, draft_size=draft).frame == open_image(data, draft_size=draft).size


@pytest.mark.parametrize("mode", ["P", "RGBA", "LA", "I;16", "RGB", "L"])
def test_strip_wise_reduction_equals_converting_then_reducing(mode) -> None:
    from vitrieval.index.runtime import images

    rng = np.random.default_rng(0)
    if mode == "I;16":
        source = Image.fromarray(rng.integers(0, 65535, (1500, 1100), dtype=np.uint16))
    else:
        source = Image.fromarray(rng.integers(0, 255, (1500, 1100, 4), dtype=np.uint8), "RGBA")
        source = source.convert(mode)
    data = encode(source, "PNG", **({"transparency": 3} if mode == "P" else {}))
    whole = images._to_rgb(Image.open(io.BytesIO(data))).reduce(7)
    old_strip = images.STRIP_PIXELS
    images.STRIP_PIXELS = 1100 * 50  # many strips of 49 rows (a multiple of 7)
    try:
        stripped = open_image(data, draft_size=150)  # 1100 // 150 = 7
    finally:
        images.STRIP_PIXELS = old_strip
    assert stripped.size == whole.size == (158, 215)
    assert np.array_equal(np.asarray(stripped), np.asarray(whole))


def test_orientation_is_applied_after_the_reduction() -> None:
    wide = Image.new("RGB", (1200, 600), (200, 10, 10))
    wide.paste((0, 0, 255), (0, 0, 100, 100))  # a blue corner, top left as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated 90 degrees clockwise
    decoded = open_image(encode(wide, "PNG", exif=exif), draft_size=100)
    assert decoded.size == (100, 200)  # reduced by 6, then turned upright
    assert decoded.getpixel((95, 2))[2] > 200  # the blue corner is now top right


def test_strips_beyond_the_aspect_ratio_limit_are_refused_before_decoding() -> None:
    from vitrieval.index.runtime.images import MAX_ASPECT_RATIO, ImageShapeError

    with pytest.raises(ImageShapeError, match="more than 100:1"):
        open_image(encode(Image.new("L", (MAX_ASPECT_RATIO * 3 + 1, 3)), "PNG"))
    assert open_image(encode(Image.new("L", (MAX_ASPECT_RATIO * 3, 3)), "PNG")).size == (300, 3)


def test_png_text_chunks_cannot_cost_memory() -> None:
    """A small PNG can carry tens of MB of compressed text, expanded when the header is
    read; vitrieval reads none of it, so it is capped and such a file refused."""
    import zlib

    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("note", "x" * (8 << 20), zip=True)  # 8 MB of text, ~8 KB compressed
    data = encode(Image.new("L", (8, 8)), "PNG", pnginfo=info)
    assert len(data) < 50_000 and len(zlib.compress(b"x" * (8 << 20))) < 50_000
    with pytest.raises(ImageDecodeError):
        open_image(data)


def test_decode_budget_refuses_waits_and_gives_back() -> None:
    import threading

    from vitrieval.index.runtime.images import DecodeBudget, DecodeBudgetBusy

    budget = DecodeBudget(100, wait_s=0.2)
    with pytest.raises(ImageTooLargeError, match="decode memory budget"), budget.reserve(101):
        pass
    with budget.reserve(60):
        # 60 + 50 > 100 for longer than wait_s
        with pytest.raises(DecodeBudgetBusy), budget.reserve(50):
            pass
        assert budget.used_bytes == 60
    assert budget.used_bytes == 0
    order: list[str] = []
    first = budget.reserve(80)
    first.__enter__()
    held = []

    def second() -> None:
        held.append(budget.reserve(50))
        held[0].__enter__()
        order.append("second in")

    waiter = threading.Thread(target=second)
    budget.wait_s = 5
    waiter.start()
    order.append("first out")
    first.__exit__(None, None, None)
    waiter.join(5)
    assert order == ["first out", "second in"] and budget.used_bytes == 50
