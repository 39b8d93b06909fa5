"""Copy-detection queries: every photo of a folder, edited into near-duplicate copies.

`vitrieval-index bench --copy-detection DIR` measures whether the model finds the
original of an edited copy (a crop, a re-save, a filter) among a gallery of photos,
the task behind duplicate and copyright search. There is no labelled data to find:
each photo below DIR (walked recursively, the `vitrieval.index.pipeline.sources` image-file rule)
is a
gallery item, and `per_image` copies of it, made here, are the queries whose one
relevant item is that photo (with `--labels-from-folders`, every photo of its folder:
`vitrieval.index.evaluation.benchmark.run_copy_detection`). Optional distractor photos join the
gallery
and are nobody's original.

Edits (Pillow + numpy), always applied in this order when chosen:

1. ``crop``: area fraction a ~ U(0.40, 0.90) of the image and aspect change
   r ~ log-uniform(3/4, 4/3); the box is round(W sqrt(a r)) x round(H sqrt(a / r))
   (clamped to the image, so a can end slightly lower), at a uniformly random
   position.
2. ``rotate``: angle ~ U(-30, 30) degrees, bicubic, the canvas expanded to hold the
   whole rotated picture, the corners filled black.
3. ``resize``: both sides scaled by s ~ U(0.3, 0.8) (bicubic, antialiased); with
   probability 1/2 scaled back up to the size before (the lost detail stays lost).
4. ``colour``: brightness b ~ U(0.6, 1.4), then contrast c ~ U(0.6, 1.4), then
   saturation ~ U(0.5, 1.5) (PIL ImageEnhance factors, 1 = unchanged), then a hue
   shift ~ U(-0.1, 0.1) of a turn (up to 36 degrees; 8-bit HSV hue, wrapping).
5. ``jpeg``: re-saved by Pillow as JPEG at quality ~ U{20, ..., 80} (integers,
   default 4:2:0 chroma subsampling) and decoded again, so the query carries the
   compression artefacts. It is last, as a re-save is the last thing done to a copy.

Composition: query q of a photo always gets a *primary* edit, ``KINDS[(o + q) % 5]``
with o ~ U{0..4} drawn once per photo, so a photo's first 5 copies cycle through
all five kinds and each kind is the primary of 1/5 of the queries (exactly, when the
copies per photo are a multiple of 5; in expectation otherwise); plus m ~ U{1, 2, 3}
other kinds drawn without replacement. Every query thus has 2 to 4 edits, each kind
is in 1/5 + 4/5 * 2/4 = 60% of the queries on average, and no query has all five.

Determinism: every draw of a query comes from its own numpy Generator seeded from
(seed, sha256 of the photo's key, q + 1) (the photo's offset o from
(seed, key hash, 0)); the key is the photo's path relative to DIR. The same seed and
photos give bit-identical queries in any order and on any thread (with the same
Pillow build: JPEG encoding is libjpeg's), and adding, removing or renaming other
photos changes nothing about a photo's copies.

Decoding: a copy is made from the photo as the gallery embedding decodes it
(`Item.open` with the embedder's draft size: a JPEG is decoded at 1/2, 1/4 or 1/8
scale while both sides stay at least twice the model's resize size, e.g. 64 px for a
32 px model with crop_pct 1), so a query with no edit reproduces the gallery vector
bit for bit, and edits run on a small image. Copies are made lazily in the
embedder's decoding threads (`CopyQuery.open`) and never mixed with the gallery.
With a `CopySession` (what the benchmark uses) a photo is decoded once for all its
copies, which are consecutive queries: decoding a large original costs far more than
editing and embedding a small copy. The session keeps a photo only until its last
copy is made, so memory stays at a couple of batches whatever the number of photos;
it also times decoding, editing and saving, and with `save_dir` writes every copy as
a PNG file (lossless: an independent baseline reads exactly the pixels the model saw).
"""

from __future__ import annotations

import hashlib
import io
import math
import numbers
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

from ..pipeline.sources import walk_images
from ..runtime.images import DEFAULT_MAX_PIXELS, open_image
from .datasets import IMAGE_EXTENSIONS, DatasetError, Item

KINDS: tuple[str, ...] = ("crop", "rotate", "resize", "colour", "jpeg")
"""The edit kinds, in the order they are applied."""

DEFAULT_PER_IMAGE = 5

CROP_AREA = (0.40, 0.90)
CROP_ASPECT = (3 / 4, 4 / 3)
ROTATE_DEGREES = 30.0
RESIZE_SCALE = (0.3, 0.8)
RESIZE_BACK_PROBABILITY = 0.5
BRIGHTNESS = (0.6, 1.4)
CONTRAST = (0.6, 1.4)
SATURATION = (0.5, 1.5)
HUE_TURNS = 0.1
JPEG_QUALITY = (20, 80)
EXTRA_EDITS = (1, 3)
"""Each query: its primary edit plus this many (inclusive range) others."""

_RESAMPLE = Image.Resampling.BICUBIC


def describe(seed: int, per_image: int, kinds: Sequence[str] | None = None) -> dict:
    """The query-generation settings, as `report.json` records them."""
    return {
        "seed": seed,
        "queries_per_image": per_image,
        "order": list(KINDS),
        "composition": (
            f"every query: exactly {list(kinds)}"
            if kinds is not None
            else (
                "primary kind cycling per photo (KINDS[(o + q) % 5], o random per photo) "
                f"+ {EXTRA_EDITS[0]}-{EXTRA_EDITS[1]} other kinds at random"
            )
        ),
        "crop": {"area": list(CROP_AREA), "aspect_change": list(CROP_ASPECT)},
        "rotate": {"degrees": [-ROTATE_DEGREES, ROTATE_DEGREES], "expand": True, "fill": "black"},
        "resize": {"scale": list(RESIZE_SCALE), "back_probability": RESIZE_BACK_PROBABILITY},
        "colour": {
            "brightness": list(BRIGHTNESS),
            "contrast": list(CONTRAST),
            "saturation": list(SATURATION),
            "hue_turns": [-HUE_TURNS, HUE_TURNS],
        },
        "jpeg": {"quality": list(JPEG_QUALITY)},
    }


def _key_words(key: str) -> list[int]:
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return [int.from_bytes(digest[i : i + 4], "little") for i in (0, 4)]


def _rng(seed: int, key: str, stream: int) -> np.random.Generator:
    # Always four words: numpy's SeedSequence would confuse [a, b] with [a, b, 0].
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative int; got {seed!r}")
    return np.random.default_rng([int(seed), *_key_words(key), stream])


def plan(
    seed: int, key: str, index: int, kinds: Sequence[str] | None = None
) -> tuple[tuple[str, ...], np.random.Generator]:
    """The edit kinds of copy `index` of photo `key`, in application order, and the
    Generator (already past the composition draws) that draws their parameters.

    `kinds` forces the edits instead (e.g. ``()`` for an identical copy).
    """
    rng = _rng(seed, key, index + 1)
    if kinds is not None:
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"unknown edit kind(s) {unknown}; choose from {', '.join(KINDS)}")
        return tuple(k for k in KINDS if k in kinds), rng
    offset = int(_rng(seed, key, 0).integers(len(KINDS)))
    primary = KINDS[(offset + index) % len(KINDS)]
    others = [k for k in KINDS if k != primary]
    extra = int(rng.integers(EXTRA_EDITS[0], EXTRA_EDITS[1] + 1))
    chosen = {primary, *(others[i] for i in rng.choice(len(others), extra, replace=False))}
    return tuple(k for k in KINDS if k in chosen), rng


def make_copy(
    image: Image.Image, seed: int, key: str, index: int, kinds: Sequence[str] | None = None
) -> tuple[Image.Image, list[dict]]:
    """Copy `index` of photo `key` (an RGB image): the edited image and, per edit
    applied, its kind and drawn parameters."""
    chosen, rng = plan(seed, key, index, kinds)
    image = image.convert("RGB")
    edits = []
    for kind in chosen:
        image, params = _EDITS[kind](image, rng)
        edits.append({"kind": kind, **params})
    return image, edits


def _crop(image: Image.Image, rng: np.random.Generator) -> tuple[Image.Image, dict]:
    width, height = image.size
    area = rng.uniform(*CROP_AREA)
    aspect = math.exp(rng.uniform(math.log(CROP_ASPECT[0]), math.log(CROP_ASPECT[1])))
    w = min(width, max(1, round(width * math.sqrt(area * aspect))))
    h = min(height, max(1, round(height * math.sqrt(area / aspect))))
    left = int(rng.integers(0, width - w + 1))
    top = int(rng.integers(0, height - h + 1))
    box = (left, top, left + w, top + h)
    return image.crop(box), {"box": list(box), "area": w * h / (width * height)}


def _rotate(image: Image.Image, rng: np.random.Generator) -> tuple[Image.Image, dict]:
    angle = float(rng.uniform(-ROTATE_DEGREES, ROTATE_DEGREES))
    rotated = image.rotate(angle, resample=_RESAMPLE, expand=True, fillcolor=(0, 0, 0))
    return rotated, {"degrees": angle}


def _resize(image: Image.Image, rng: np.random.Generator) -> tuple[Image.Image, dict]:
    width, height = image.size
    scale = float(rng.uniform(*RESIZE_SCALE))
    back = bool(rng.random() < RESIZE_BACK_PROBABILITY)
    small = image.resize((max(1, round(width * scale)), max(1, round(height * scale))), _RESAMPLE)
    return (small.resize((width, height), _RESAMPLE) if back else small), {
        "scale": scale,
        "back": back,
    }


def _colour(image: Image.Image, rng: np.random.Generator) -> tuple[Image.Image, dict]:
    brightness = float(rng.uniform(*BRIGHTNESS))
    contrast = float(rng.uniform(*CONTRAST))
    saturation = float(rng.uniform(*SATURATION))
    hue = float(rng.uniform(-HUE_TURNS, HUE_TURNS))
    image = ImageEnhance.Brightness(image).enhance(brightness)
    image = ImageEnhance.Contrast(image).enhance(contrast)
    image = ImageEnhance.Color(image).enhance(saturation)
    shift = round(hue * 256)
    h, s, v = image.convert("HSV").split()
    h = h.point(lambda x: (x + shift) % 256)
    image = Image.merge("HSV", (h, s, v)).convert("RGB")
    params = {"brightness": brightness, "contrast": contrast, "saturation": saturation}
    return image, {**params, "hue_turns": hue}


def _jpeg(image: Image.Image, rng: np.random.Generator) -> tuple[Image.Image, dict]:
    quality = int(rng.integers(JPEG_QUALITY[0], JPEG_QUALITY[1] + 1))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    # decoded in full (no reduced-scale draft): the artefacts are the point
    decoded = open_image(buffer.getvalue(), max_pixels=image.width * image.height)
    return decoded, {"quality": quality, "bytes": buffer.tell()}


_EDITS = {"crop": _crop, "rotate": _rotate, "resize": _resize, "colour": _colour, "jpeg": _jpeg}


def copy_filename(key: str) -> str:
    """The file a copy is saved as, relative to the save folder: the query key with
    '#' made a '.' and '.png' added (``sub/cat.jpg#copy2`` -> ``sub/cat.jpg.copy2.png``),
    so the copies keep the photos' folders and two photos never share a name."""
    return key.replace("#", ".") + ".png"


@dataclass
class _Photo:
    lock: threading.Lock
    left: int
    image: Image.Image | None = None
    error: Exception | None = None


class CopySession:
    """Decodes each photo once for all its copies (`uses` of them), optionally saves
    every copy under `save_dir`, and times the work.

    Thread-safe: the embedder's decoding threads make a photo's copies concurrently;
    the first decodes it and the others wait for that decode. The photo is dropped
    when its last copy has been made. Times are summed over threads (CPU-bound work
    in parallel threads can add up to more than the wall time).
    """

    def __init__(self, uses: int, save_dir: Path | None = None) -> None:
        self.uses = uses
        self.save_dir = save_dir
        self.decodes = 0
        self.decode_seconds = 0.0
        self.edit_seconds = 0.0
        self.save_seconds = 0.0
        self._lock = threading.Lock()
        self._photos: dict[str, _Photo] = {}

    def photo(self, query: CopyQuery, max_pixels: int, draft_size: int | None) -> Image.Image:
        """The decoded photo of `query`, decoded by the first of its copies to ask."""
        with self._lock:
            entry = self._photos.get(query.source)
            if entry is None:
                entry = self._photos[query.source] = _Photo(threading.Lock(), self.uses)
        try:
            with entry.lock:
                if entry.image is None and entry.error is None:
                    started = time.perf_counter()
                    try:
                        entry.image = Item.open(query, max_pixels, draft_size)
                    except Exception as exc:
                        entry.error = exc
                    with self._lock:
                        self.decodes += 1
                        self.decode_seconds += time.perf_counter() - started
        finally:
            with self._lock:
                entry.left -= 1
                if entry.left <= 0:
                    self._photos.pop(query.source, None)
        if entry.error is not None:
            raise entry.error
        return entry.image

    def made(self, key: str, image: Image.Image, edit_seconds: float) -> None:
        """Count a copy's editing time and save it when asked to."""
        saved = 0.0
        if self.save_dir is not None:
            started = time.perf_counter()
            path = self.save_dir / copy_filename(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            # compress_level 1: lossless like any level, several times faster to write
            image.save(path, format="PNG", compress_level=1)
            saved = time.perf_counter() - started
        with self._lock:
            self.edit_seconds += edit_seconds
            self.save_seconds += saved


@dataclass(frozen=True)
class CopyQuery(Item):
    """Copy `index` of the photo at `path` (key `source`), made when opened.

    An `Item`, so the embedder's pipeline makes copies in its decoding threads like it
    decodes files; `label` is the source photo's key. `kinds` is the edit plan (known
    without pixels), for per-kind results. With a `session`, the photo is decoded once
    for all its copies (and each copy saved if the session says so).
    """

    source: str = ""
    index: int = 0
    seed: int = 0
    kinds: tuple[str, ...] = ()
    forced: tuple[str, ...] | None = None
    session: CopySession | None = field(default=None, compare=False, repr=False)

    def open(
        self, max_pixels: int = DEFAULT_MAX_PIXELS, draft_size: int | None = None
    ) -> Image.Image:
        """The edited copy, from the photo decoded exactly as the gallery decodes it."""
        if self.session is None:
            photo = super().open(max_pixels, draft_size)
            return make_copy(photo, self.seed, self.source, self.index, self.forced)[0]
        photo = self.session.photo(self, max_pixels, draft_size)
        started = time.perf_counter()
        copy = make_copy(photo, self.seed, self.source, self.index, self.forced)[0]
        self.session.made(self.key, copy, time.perf_counter() - started)
        return copy


def copy_queries(
    photos: Sequence[Item],
    per_image: int = DEFAULT_PER_IMAGE,
    seed: int = 0,
    kinds: Sequence[str] | None = None,
    session: CopySession | None = None,
) -> list[CopyQuery]:
    """`per_image` copies of each photo (file items), photo-major: copy q of photo p is
    at p * per_image + q. `kinds` forces every copy's edits (None: the random plan);
    `session` (made for `per_image` uses) decodes each photo once for its copies."""
    if isinstance(per_image, bool) or not isinstance(per_image, int) or per_image < 1:
        raise ValueError(f"queries per image must be a positive int; got {per_image!r}")
    if session is not None and session.uses != per_image:
        raise ValueError(f"the session is for {session.uses} copies per photo, not {per_image}")
    forced = None if kinds is None else tuple(kinds)
    queries = []
    for photo in photos:
        if photo.path is None:
            raise ValueError(f"photo {photo.key!r} has no file path")
        for q in range(per_image):
            chosen, _ = plan(seed, photo.key, q, forced)
            queries.append(
                CopyQuery(
                    key=f"{photo.key}#copy{q}",
                    label=photo.key,
                    path=photo.path,
                    source=photo.key,
                    index=q,
                    seed=seed,
                    kinds=chosen,
                    forced=forced,
                    session=session,
                )
            )
    return queries


def read_photos(
    root: str | Path, what: str = "--copy-detection", labels_from_folders: bool = False
) -> list[Item]:
    """Every image file below `root` (recursive, hidden files skipped), sorted; keys are
    paths relative to `root`, labels (with `labels_from_folders`) the first folder below
    `root`, as `build --labels-from-folders` gives them (None for a file directly in
    `root`). A missing folder or one without images is an error."""
    root = Path(root)
    if not root.exists():
        raise DatasetError(f"{what} folder not found: {root}")
    if not root.is_dir():
        raise DatasetError(f"{what} {root} is not a folder")
    photos = walk_images(root, labels_from_folders)
    if not photos:
        raise DatasetError(
            f"{what} {root} holds no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})"
        )
    return photos
