"""Decoding large files: vitrieval's Pillow path against libvips, per format and size.

Makes large PNG, WebP and JPEG (quality 90) files from the photos scikit-image ships
(astronaut, coffee), upscaled with Pillow's LANCZOS to about 0.25, 1, 4, 12 and 18 MP with a
little Gaussian noise (sigma 3, as a camera's grain: without it an upscaled photo
compresses, and decodes, unlike a real one), and times, per file, the step the
embedder runs before preprocessing: file -> reduced RGB image, for a model whose
resize size is 248 (ViT-S/16 at 224 px, crop_pct 0.9) and 64 (the 64 px presets),
i.e. `open_image(path, draft_size=2 * resize)` as `Embedder` calls it:

- `pillow`: `open_image` with `VITRIEVAL_DECODER=pillow` (the path without libvips:
  JPEG draft, full decode otherwise, strip-wise box reduction);
- `vips`: `open_image` with `VITRIEVAL_DECODER=vips`, what vitrieval does with the
  `vips` extra (index/runtime/vips_decode.py: the same header checks, then libvips for PNG
  from 0.25 MP, streamed, and WebP from 3 MP, scaled on load; JPEG and smaller files
  stay with Pillow);
- `vips-any-size`: the same without the size thresholds (why they are there);
- `thumbnail`: bare `pyvips.Image.thumbnail` to the same shorter side, to a numpy
  array (libvips's own fast path, no checks, for reference);
- `pil-reduce`: Pillow without the strips (open, draft, load, convert, one `reduce`),
  to see whether a cheaper fix exists inside Pillow. Pillow has no scaled decoding
  for WebP or PNG (`draft` is a JPEG-only operation), so none is timed.

libvips runs with one worker thread (as in vitrieval: the embedder's decode threads
are the parallelism). Figures: median of `--repeats` per file, mean over the photos,
ms per image and the ratio pillow / method. `mad`: mean absolute difference (0-255)
against `pillow` of what the model sees (both outputs resized to the resize size,
bicubic, as the preprocessing does). Peak RSS: growth of a child process's maximum
resident set over one decode (`--rss`).

Run:  nice -n 10 .venv/bin/python bench/decoders.py [--sizes 0.25 1 4 12 18] [--repeats 3] [--rss]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from machine import cpu_model  # bench/machine.py (scripts run from bench/)
from PIL import Image
from skimage import data as skdata

from vitrieval.index.runtime import vips_decode
from vitrieval.index.runtime.images import open_image

FORMATS = {"PNG": {}, "WEBP": {"quality": 90}, "JPEG": {"quality": 90}}
RESIZES = (248, 64)  # the preprocessing's resize size: ViT-S/16 at 224 px, a 64 px preset
METHODS = ("pillow", "vips", "vips-any-size", "thumbnail", "pil-reduce")


def write_files(
    folder: Path, megapixels: list[float], seed: int = 0
) -> list[tuple[str, float, Path]]:
    """(format, MP, path) of each photo at each size in each format."""
    rng = np.random.default_rng(seed)
    files = []
    for index, photo in enumerate((skdata.astronaut(), skdata.coffee())):
        h, w = photo.shape[:2]
        for mp in megapixels:
            scale = (mp * 1e6 / (w * h)) ** 0.5
            big = Image.fromarray(photo).resize((round(w * scale), round(h * scale)), Image.LANCZOS)
            noisy = np.asarray(big, np.float32) + rng.normal(0, 3, (big.height, big.width, 3))
            big = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
            for fmt, options in FORMATS.items():
                path = folder / f"{index}_{mp:g}mp.{fmt.lower()}"
                big.save(path, fmt, **options)
                files.append((fmt, mp, path))
    return files


def decode(method: str, path: Path, draft: int) -> Image.Image:
    """File -> reduced RGB image, with `method` (see the module docstring)."""
    if method in ("pillow", "vips", "vips-any-size"):
        os.environ[vips_decode.DECODER_ENV] = method.split("-")[0]
        thresholds = vips_decode.VIPS_MIN_PIXELS
        if method == "vips-any-size":  # libvips's path below the thresholds too
            vips_decode.VIPS_MIN_PIXELS = dict.fromkeys(thresholds, 1)
        try:
            return open_image(path, draft_size=draft)
        finally:
            vips_decode.VIPS_MIN_PIXELS = thresholds
    if method == "thumbnail":
        import pyvips

        with Image.open(path) as header:
            w, h = header.size
        box = (draft, 10_000_000) if w <= h else (10_000_000, draft)
        image = pyvips.Image.thumbnail(str(path), box[0], height=box[1], size="down")
        return Image.fromarray(image.numpy())
    with Image.open(path) as image:  # pil-reduce
        image.draft("RGB", (draft, draft))
        image.load()
        factor = max(1, min(image.size) // draft)
        rgb = image.convert("RGB")
        return rgb.reduce(factor) if factor > 1 else rgb


def model_view(image: Image.Image, resize: int) -> np.ndarray:
    """What the preprocessing makes of `image` before the crop: the short side resized."""
    w, h = image.size
    size = (resize, round(h * resize / w)) if w <= h else (round(w * resize / h), resize)
    return np.asarray(image.resize(size, Image.BICUBIC), np.float32)


def timed(fn: Callable[..., object], args: tuple[object, ...], repeats: int) -> float:
    """Median seconds of `fn(*args)` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


RSS_CHILD = """
import sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r})
from decoders import decode
from vitrieval.index.runtime import vips_decode
vips_decode.active_decoder(); import pyvips; pyvips.Image.black(8, 8).numpy()
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current RSS
before = status("VmRSS:")
decode({method!r}, __import__("pathlib").Path({path!r}), {draft!r})
print(status("VmHWM:") - before)
"""


def peak_rss_mib(method: str, path: Path, draft: int) -> float:
    """Growth of a fresh process's peak RSS (Linux VmHWM, reset first) over one decode, MiB."""
    here = Path(__file__).resolve().parent
    code = RSS_CHILD.format(
        root=str(here.parent), bench=str(here), method=method, path=str(path), draft=draft
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.25, 1, 4, 12, 18])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rss", action="store_true", help="peak RSS per decode (child processes)")
    args = parser.parse_args()
    import pyvips

    vips_decode.active_decoder()  # one libvips thread, no cache (as vitrieval runs it)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()}")
    libvips = ".".join(str(pyvips.version(i)) for i in range(3))
    print(f"Pillow {Image.__version__}, libvips {libvips}, one libvips thread")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        files = write_files(Path(tmp), args.sizes)
        print(f"wrote {len(files)} files in {time.perf_counter() - start:.0f} s")
        for resize in RESIZES:
            draft = 2 * resize
            print(f"\nresize {resize} (draft_size {draft}): ms per image, pillow / method, mad")
            print(f"{'format':6} {'MP':>4} " + " ".join(f"{m:>22}" for m in METHODS))
            for fmt in FORMATS:
                for mp in args.sizes:
                    paths = [p for f, m, p in files if f == fmt and m == mp]
                    ms = {m: [] for m in METHODS}
                    mad = {m: [] for m in METHODS}
                    for path in paths:
                        reference = model_view(decode("pillow", path, draft), resize)
                        for method in METHODS:  # the first decode warms up, then timed
                            view = model_view(decode(method, path, draft), resize)
                            if view.shape == reference.shape:
                                mad[method].append(float(np.abs(view - reference).mean()))
                            seconds = timed(decode, (method, path, draft), args.repeats)
                            ms[method].append(1000 * seconds)
                    base = statistics.fmean(ms["pillow"])
                    cells = []
                    for method in METHODS:
                        mean = statistics.fmean(ms[method])
                        diff = f"{statistics.fmean(mad[method]):.2f}" if mad[method] else "size"
                        cells.append(f"{mean:8.1f} {base / mean:5.2f}x {diff:>6}")
                    print(f"{fmt:6} {mp:4g} " + " ".join(f"{c:>22}" for c in cells))
        if args.rss:
            print("\npeak RSS growth over one decode, MiB (resize 248):")
            for fmt in FORMATS:
                for mp in args.sizes:
                    path = next(p for f, m, p in files if f == fmt and m == mp)
                    cells = [f"{m} {peak_rss_mib(m, path, 496):6.0f}" for m in METHODS[:4]]
                    print(f"{fmt:6} {mp:4g} " + "  ".join(cells))
    print(f"\nload average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
