"""The two decoders behind `open_image`: Pillow always, libvips where `pyvips` is installed
(the `vips` extra, part of the test install). Both must give the same image, within
rounding, in every mode, and the same errors on hostile files."""

from __future__ import annotations

import importlib.util
import io
import logging
import os
from collections.abc import Callable

import numpy as np
import pytest
from hostile_images import fuzzed, png_bomb
from PIL import Image
from skimage import data as skdata

from vitrieval.index.runtime import vips_decode
from vitrieval.index.runtime.images import (
    ImageDecodeError,
    ImageShapeError,
    ImageTooLargeError,
    UnsupportedFormatError,
    open_image,
)

HAVE_VIPS = vips_decode._load_pyvips()[0] is not None
needs_vips = pytest.mark.skipif(not HAVE_VIPS, reason="pyvips / libvips not installed")


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def decode_with(decoder: str, monkeypatch: pytest.MonkeyPatch, *args, **kwargs) -> Image.Image:
    monkeypatch.setenv(vips_decode.DECODER_ENV, decoder)
    return open_image(*args, **kwargs)


def counting_vips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the decodes libvips actually finishes (not the ones it hands back)."""
    calls: list[int] = []
    real: Callable = vips_decode.decode

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(vips_decode, "decode", spy)
    return calls


@pytest.fixture
def small_files_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """libvips for images of any size, so the parity tests can use small ones."""
    monkeypatch.setattr(vips_decode, "VIPS_MIN_PIXELS", {"PNG": 1, "WEBP": 1})


def photo(size: tuple[int, int], alpha: bool = False) -> Image.Image:
    """A real photo (skimage's coffee) resized to `size`, with a gradient alpha."""
    image = Image.fromarray(skdata.coffee()).resize(size, Image.BICUBIC)
    if alpha:
        ramp = np.linspace(0, 255, size[0], dtype=np.uint8)[None, :].repeat(size[1], 0)
        image.putalpha(Image.fromarray(ramp))
    return image


# -- the setting --------------------------------------------------------------------------


def test_the_setting_is_read_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(vips_decode.DECODER_ENV, raising=False)
    assert vips_decode.decoder_setting() == "auto"
    monkeypatch.setenv(vips_decode.DECODER_ENV, "Pillow")
    assert vips_decode.decoder_setting() == "pillow" and vips_decode.active_decoder() == "pillow"
    monkeypatch.setenv(vips_decode.DECODER_ENV, "magick")
    with pytest.raises(ValueError, match="VITRIEVAL_DECODER='magick': expected one of auto"):
        vips_decode.decoder_setting()


def test_without_libvips_auto_is_pillow_and_vips_is_an_error(monkeypatch) -> None:
    monkeypatch.setattr(vips_decode, "_load_pyvips", lambda: (None, "pyvips does not import"))
    monkeypatch.setenv(vips_decode.DECODER_ENV, "auto")
    assert vips_decode.active_decoder() == "pillow"
    assert open_image(encode(photo((64, 48)), "PNG")).size == (64, 48)
    monkeypatch.setenv(vips_decode.DECODER_ENV, "vips")
    with pytest.raises(vips_decode.VipsUnavailableError, match=r"pip install 'vitrieval\[vips\]'"):
        open_image(encode(photo((64, 48)), "PNG"))


def test_without_libvips_a_large_png_or_webp_names_the_extra_once(monkeypatch, caplog) -> None:
    """A file libvips would decode, met without pyvips: one warning naming the extra for
    the whole process; small files, JPEG and VITRIEVAL_DECODER=pillow say nothing."""
    monkeypatch.setattr(vips_decode, "_load_pyvips", lambda: (None, "pyvips does not import"))
    monkeypatch.setattr(vips_decode, "_hinted", False)
    monkeypatch.setenv(vips_decode.DECODER_ENV, "pillow")
    large_png = encode(photo((640, 480)), "PNG")  # 0.31 MP: libvips's from 0.25 MP
    with caplog.at_level(logging.INFO, logger="vitrieval.index.runtime.vips_decode"):
        open_image(large_png, draft_size=128)
        monkeypatch.setenv(vips_decode.DECODER_ENV, "auto")
        open_image(encode(photo((64, 48)), "PNG"))
        open_image(encode(photo((640, 480)), "JPEG"), draft_size=128)
        assert not caplog.records
        for _ in range(3):
            open_image(large_png, draft_size=128)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "large PNG files are decoded by Pillow because pyvips does not import" in (
        record.getMessage()
    )
    assert "pip install 'vitrieval[vips]'" in record.getMessage()


def test_libvips_is_used_when_installed(monkeypatch) -> None:
    """The test install has the vips extra: CI must run the libvips path, not skip it."""
    if not HAVE_VIPS:
        if os.environ.get("CI") or importlib.util.find_spec("pyvips") is not None:
            pytest.fail(f"libvips path not testable: {vips_decode._load_pyvips()[1]}")
        pytest.skip("pyvips not installed")
    monkeypatch.delenv(vips_decode.DECODER_ENV, raising=False)
    assert vips_decode.active_decoder() == "vips"
    calls = counting_vips(monkeypatch)
    png, webp = vips_decode.VIPS_MIN_PIXELS["PNG"], vips_decode.VIPS_MIN_PIXELS["WEBP"]
    at = lambda least, width: (width, -(-least // width))  # noqa: E731  >= least pixels
    below = lambda least, width: (width, (least - 1) // width)  # noqa: E731
    cases = [  # (format, size, draft_size, decoded by libvips?)
        ("PNG", at(png, 600), None, True),
        ("PNG", below(png, 600), None, False),  # small: Pillow is as fast
        ("WEBP", at(webp, 2100), 200, True),
        ("WEBP", at(webp, 2100), None, False),  # not reduced: no scaled decoding to gain
        ("WEBP", below(webp, 2100), 200, False),
        ("JPEG", at(webp, 2100), 200, False),  # Pillow's draft is as fast
    ]
    for fmt, size, draft_size, by_vips in cases:
        before = len(calls)
        assert open_image(encode(photo(size), fmt), draft_size=draft_size).mode == "RGB"
        assert (len(calls) > before) == by_vips, (fmt, size, draft_size)
        assert all(calls), "libvips handed a decode back to Pillow"
    monkeypatch.setenv(vips_decode.DECODER_ENV, "pillow")
    count = len(calls)
    open_image(encode(photo((600, 500)), "PNG"), draft_size=64)
    assert len(calls) == count  # forced Pillow: libvips untouched


def _decode_in_fork(png: bytes, answers) -> None:
    answers.put((vips_decode.active_decoder(), open_image(png, draft_size=64).size))


@needs_vips
def test_a_fork_of_a_process_that_started_libvips_decodes_with_pillow(monkeypatch) -> None:
    """libvips's threads do not survive a fork (DataLoader workers hang in it): a forked
    child decodes with Pillow, and finishes."""
    import multiprocessing

    monkeypatch.delenv(vips_decode.DECODER_ENV, raising=False)
    png = encode(photo((600, 500)), "PNG")
    calls = counting_vips(monkeypatch)
    size = open_image(png, draft_size=64).size
    assert calls == [True]  # libvips started and used in this process
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    child = context.Process(target=_decode_in_fork, args=(png, answers))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung decoding a PNG")
    assert child.exitcode == 0
    assert answers.get(timeout=5) == ("pillow", size)
    assert vips_decode.active_decoder() == "vips"  # the parent keeps libvips


# -- same pixels on both paths ------------------------------------------------------------


def mode_cases() -> dict[str, tuple[bytes, bool]]:
    """Encoded files in every mode the decoding tests make -> whether libvips decodes them
    (False: the Pillow fallback must be taken)."""
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 255, (330, 470, 4), dtype=np.uint8), "RGBA")
    grey16 = Image.fromarray(rng.integers(0, 65535, (330, 470), dtype=np.uint16))
    rgb16 = np.zeros((330, 470, 3), np.uint16)  # PNG 16 bits a sample: Pillow says "RGB"
    rgb16_png = _png16(rgb16 + rng.integers(0, 65535, rgb16.shape, dtype=np.uint16))
    cmyk = photo((470, 330)).convert("CMYK")
    return {
        "png-RGB": (encode(noise.convert("RGB"), "PNG"), True),
        "png-RGBA": (encode(noise, "PNG"), True),
        "png-L": (encode(noise.convert("L"), "PNG"), True),
        "png-LA": (encode(noise.convert("LA"), "PNG"), True),
        "png-interlaced-RGB": (encode(photo((470, 330)), "PNG", interlace=1), True),
        "png-P-transparency": (encode(noise.convert("P"), "PNG", transparency=3), False),
        "png-I;16": (encode(grey16, "PNG"), False),
        "png-RGB-16bit": (rgb16_png, False),
        "png-RGB-colour-key": (encode(noise.convert("RGB"), "PNG", transparency=(0, 0, 0)), False),
        "webp-RGB": (encode(photo((470, 330)), "WEBP", quality=90), True),
        "webp-RGBA": (encode(photo((470, 330), alpha=True), "WEBP", quality=90), True),
        "webp-lossless-RGBA": (encode(photo((470, 330), alpha=True), "WEBP", lossless=True), True),
        "jpeg-RGB": (encode(photo((470, 330)), "JPEG", quality=90), False),
        "jpeg-L": (encode(photo((470, 330)).convert("L"), "JPEG"), False),
        "jpeg-CMYK": (encode(cmyk, "JPEG"), False),
        "gif-P": (encode(photo((470, 330)).convert("P"), "GIF"), False),
        "bmp-RGB": (encode(photo((470, 330)), "BMP"), False),
    }


def _png16(pixels: np.ndarray) -> bytes:
    """A 16-bit RGB PNG (Pillow cannot write one): IHDR, one IDAT, IEND."""
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    height, width = pixels.shape[:2]
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([16, 2, 0, 0, 0])
    rows = b"".join(b"\0" + row.astype(">u2").tobytes() for row in pixels)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


MODE_CASES = mode_cases()


@needs_vips
@pytest.mark.parametrize("draft_size", [None, 100, 40], ids=["full", "reduce3", "reduce8"])
@pytest.mark.parametrize("case", sorted(MODE_CASES))
@pytest.mark.usefixtures("small_files_too")
def test_both_decoders_give_the_same_image(case, draft_size, monkeypatch) -> None:
    data, by_vips = MODE_CASES[case]
    by_vips &= not (case.startswith("webp") and not draft_size)  # WebP only when reduced
    pillow = decode_with("pillow", monkeypatch, data, draft_size=draft_size)
    calls = counting_vips(monkeypatch)
    vips = decode_with("vips", monkeypatch, data, draft_size=draft_size)
    assert any(calls) == by_vips, f"{case}: libvips decoded it: {calls}"
    assert vips.mode == pillow.mode == "RGB"
    if case.startswith("webp") and draft_size:
        # libwebp's scaled decoding maps the whole image onto floor(side / reduce)
        # pixels with its own resampler; Pillow box-reduces to ceil(side / reduce),
        # the last partial box stretched to a whole pixel. Both are held to a LANCZOS
        # resize of the full decode: libvips must be as close to it as Pillow
        assert 0 <= pillow.width - vips.width <= 1 and 0 <= pillow.height - vips.height <= 1
        full = decode_with("pillow", monkeypatch, data)
        truth = np.asarray(full.resize(pillow.size, Image.LANCZOS), np.float32)
        vips_error = np.abs(np.asarray(vips.resize(pillow.size, Image.BICUBIC)) - truth).mean()
        pillow_error = np.abs(np.asarray(pillow) - truth).mean()
        assert vips_error <= min(4.0, pillow_error + 1.0), (case, vips_error, pillow_error)
        return
    assert vips.size == pillow.size
    diff = np.abs(np.asarray(vips, np.int16) - np.asarray(pillow, np.int16))
    # the same arithmetic up to rounding (compositing on white, box reduction); the
    # partial boxes of the last row and column are averaged otherwise by libvips
    inner = diff[:-1, :-1] if draft_size else diff
    assert inner.max() <= 1 and inner.mean() <= 0.15, case


@needs_vips
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.usefixtures("small_files_too")
def test_exif_orientation_is_the_same_on_both_paths(fmt, orientation, monkeypatch) -> None:
    wide = Image.new("RGB", (600, 300), (200, 10, 10))
    wide.paste((0, 0, 255), (0, 0, 100, 60))  # a blue corner, top left as stored
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(wide, fmt, exif=exif, **({"lossless": True} if fmt == "WEBP" else {}))
    for draft_size in (None, 60):
        pillow = decode_with("pillow", monkeypatch, data, draft_size=draft_size)
        vips = decode_with("vips", monkeypatch, data, draft_size=draft_size)
        assert vips.size == pillow.size
        blue = np.asarray(pillow)[..., 2] > 128
        assert np.mean((np.asarray(vips)[..., 2] > 128) == blue) > 0.99


# -- hostile files: the same errors --------------------------------------------------------


def hostile_cases() -> dict[str, tuple[bytes, type[ImageDecodeError], str]]:
    coffee = photo((470, 330))
    return {
        "bomb": (png_bomb(), ImageTooLargeError, "exceeds"),
        "ppm": (encode(coffee, "PPM"), UnsupportedFormatError, "not a recognised image file"),
        "strip": (encode(Image.new("L", (401, 4)), "PNG"), ImageShapeError, "more than 100:1"),
        "text": (b"hello, not an image", UnsupportedFormatError, "not a recognised"),
        "truncated-png": (encode(coffee, "PNG")[:20000], ImageDecodeError, "truncated"),
        "truncated-jpeg": (encode(coffee, "JPEG")[:3000], ImageDecodeError, "truncated"),
        "truncated-webp": (encode(coffee, "WEBP")[:3000], ImageDecodeError, "image"),
    }


@pytest.mark.parametrize("decoder", ["pillow", pytest.param("vips", marks=needs_vips)])
@pytest.mark.parametrize("case", sorted(hostile_cases()))
@pytest.mark.usefixtures("small_files_too")
def test_hostile_files_give_the_same_errors(case, decoder, monkeypatch) -> None:
    data, error, message = hostile_cases()[case]
    with pytest.raises(error, match=message) as raised:
        decode_with(decoder, monkeypatch, data, draft_size=64)
    with pytest.raises(ImageDecodeError) as reference:
        decode_with("pillow", monkeypatch, data, draft_size=64)
    assert type(raised.value) is type(reference.value)
    # the same sentence; only the decoder's own detail in brackets may differ
    assert str(raised.value).split(" (")[0] == str(reference.value).split(" (")[0]


@needs_vips
@pytest.mark.usefixtures("small_files_too")
def test_fuzzed_files_raise_decode_errors_or_decode_on_both_paths(monkeypatch) -> None:
    originals = [
        encode(photo((300, 200)), "PNG"),
        encode(photo((300, 200), alpha=True), "PNG"),
        encode(photo((300, 200)), "JPEG"),
        encode(photo((300, 200), alpha=True), "WEBP"),
    ]
    outcomes = {"pillow": [], "vips": []}
    for seed in range(300):
        data = fuzzed(seed, originals)
        for decoder, results in outcomes.items():
            try:
                image = decode_with(decoder, monkeypatch, data, draft_size=50)
                results.append(image.size)
                assert image.mode == "RGB"
            except ImageDecodeError:
                results.append("error")
    # the header checks are shared; the decoders may disagree only on damaged pixel data
    same = sum(a == b for a, b in zip(outcomes["pillow"], outcomes["vips"], strict=True))
    assert same >= 0.9 * len(outcomes["vips"])


@needs_vips
def test_embeddings_agree_across_decoders(tiny_onnx, tmp_path, monkeypatch) -> None:
    """What matters downstream: the model's vectors from either decoder (files large
    enough for libvips at its real thresholds)."""
    from vitrieval.index.runtime.embedder import Embedder

    files = []
    for i, (fmt, size) in enumerate([("PNG", (900, 600)), ("WEBP", (2200, 1400))]):
        for alpha in (False, True):
            path = tmp_path / f"{i}{alpha}.{fmt.lower()}"
            photo(size, alpha=alpha).save(path, fmt, quality=90)
            files.append(path)
    embedder = Embedder(tiny_onnx)
    monkeypatch.setenv(vips_decode.DECODER_ENV, "pillow")
    pillow = embedder.embed_sources(files).embeddings
    calls = counting_vips(monkeypatch)
    monkeypatch.setenv(vips_decode.DECODER_ENV, "vips")
    vips = embedder.embed_sources(files).embeddings
    assert calls == [True] * len(files)
    assert np.min(np.sum(pillow * vips, axis=1)) >= 0.999


PEAK_CHILD = """
import sys
from vitrieval.index.runtime.images import open_image, plan_decode
def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))
path, draft = sys.argv[1], int(sys.argv[2])
plan = plan_decode(path, draft_size=draft)
open_image(path, draft_size=draft)  # libvips started, its thread made: as in a server
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # peak RSS := current RSS
before = kib("VmRSS:")
open_image(path, draft_size=draft)
print(plan.decoder, plan.peak_bytes, (kib("VmHWM:") - before) * 1024)
"""


@needs_vips
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="Linux peak RSS")
@pytest.mark.parametrize(
    "size, mode, draft_size",
    [
        ((3000, 1000), "RGBA", 496),  # small: the fixed part of libvips's memory counts
        ((vips_decode.VIPS_MAX_WIDTH, -(-vips_decode.VIPS_MAX_WIDTH // 3)), "RGBA", 496),
        ((2000, 2000), "RGB", None),  # not reduced: the whole frame is the output
    ],
)
def test_libvips_stays_within_the_decode_plan(size, mode, draft_size, tmp_path) -> None:
    """What the decode budget reserves (`plan.peak_bytes`) bounds libvips's peak RSS at
    the widest shape it is given; wider images go to Pillow."""
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    noise = rng.integers(0, 255, (size[1] // 8, size[0] // 8, 4), dtype=np.uint8)
    path = tmp_path / "wide.png"
    Image.fromarray(noise, "RGBA").resize(size).convert(mode).save(path, compress_level=1)
    out = subprocess.run(
        [sys.executable, "-c", PEAK_CHILD, str(path), str(draft_size or 0)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, vips_decode.DECODER_ENV: "vips"},
    ).stdout.split()
    decoder, planned, peak = out[0], int(out[1]), int(out[2])
    assert decoder == "vips"
    assert peak <= planned, f"libvips peaked at {peak / 2**20:.0f} MiB, plan {planned / 2**20:.0f}"


def test_wider_images_and_panoramas_stay_with_pillow() -> None:
    def png(size: tuple[int, int]) -> Image.Image:
        return Image.open(io.BytesIO(encode(Image.new("RGB", size), "PNG")))

    width = vips_decode.VIPS_MAX_WIDTH
    assert vips_decode.handles(png((width, width // 2)), 2)
    assert not vips_decode.handles(png((width + 1, width // 2)), 2)
    assert not vips_decode.handles(png((3001, 1000)), 2)  # beyond 3:1
    assert not vips_decode.handles(png((1000, 3001)), 2)


def test_a_bad_decoder_setting_is_one_error_at_start(
    monkeypatch, tiny_onnx, tmp_path, capsys
) -> None:
    from vitrieval.index.cli import main
    from vitrieval.index.runtime.embedder import Embedder

    monkeypatch.setenv(vips_decode.DECODER_ENV, "magick")
    with pytest.raises(ValueError, match="VITRIEVAL_DECODER='magick'"):
        Embedder(tiny_onnx)  # before any image, not one decode error per image
    image = tmp_path / "a.png"
    Image.new("RGB", (40, 40)).save(image)
    code = main(
        [
            "embed",
            "--model",
            str(tiny_onnx),
            "--images",
            str(tmp_path),
            "--out",
            str(tmp_path / "e"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "VITRIEVAL_DECODER='magick'" in err
