"""Image -> model input, from the preprocessing an exported model declares.

Reproduces timm's evaluation transform (the one training validated with): resize the
short side to floor(S / crop_pct) keeping the aspect ratio, centre-crop S x S, scale to
[0, 1], subtract `mean`, divide by `std`. A test checks it against timm's transform.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from .model_metadata import ModelMetadata

_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}


DRAFT_FACTOR = 2
"""JPEGs are decoded at reduced scale down to this multiple of the size the preprocessing
resizes them to (`vitrieval.index.runtime.images.open_image`'s draft), so the final antialiased
resize
still sees every detail it keeps. The Embedder decodes so, and `fit` decodes its
held-out images the same way: one model, the same figures in both."""


def scale_size(size: int, crop_pct: float) -> int:
    """The shorter side an image is resized to before the centre crop of `size`."""
    return math.floor(size / crop_pct)


def draft_size(size: int, crop_pct: float) -> int:
    """The reduced-scale decoding bound of a model with input `size` and `crop_pct`."""
    return DRAFT_FACTOR * scale_size(size, crop_pct)


class Preprocessor:
    """Callable RGB PIL image -> float32 array (3, S, S)."""

    def __init__(self, meta: ModelMetadata):
        _, height, width = meta.input_size
        if height != width:
            raise ValueError(f"only square inputs are supported, model declares {height}x{width}")
        if meta.interpolation not in _RESAMPLE:
            raise ValueError(f"unknown interpolation {meta.interpolation!r}")
        self.size = height
        self.scale_size = scale_size(height, meta.crop_pct)
        self.draft_size = draft_size(height, meta.crop_pct)
        self.resample = _RESAMPLE[meta.interpolation]
        self.mean = np.asarray(meta.mean, dtype=np.float32).reshape(3, 1, 1)
        self.std = np.asarray(meta.std, dtype=np.float32).reshape(3, 1, 1)

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """The size an image of width x height is resized to before the centre crop."""
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.scale_size, int(self.scale_size * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)

    def peak_bytes(self, size: tuple[int, int]) -> int:
        """Bound on the memory preprocessing an RGB image of `size` allocates: the
        resized image (4 bytes a pixel in Pillow) and the float32 crops."""
        new_w, new_h = self.resized(*size)
        return new_w * new_h * 4 + 4 * 3 * self.size * self.size * 4

    def __call__(self, image: Image.Image) -> np.ndarray:
        if image.mode != "RGB":
            image = image.convert("RGB")
        w, h = image.size
        new_w, new_h = self.resized(w, h)
        if (new_w, new_h) != (w, h):
            image = image.resize((new_w, new_h), self.resample)
        top = round((new_h - self.size) / 2.0)
        left = round((new_w - self.size) / 2.0)
        image = image.crop((left, top, left + self.size, top + self.size))
        pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0
        return (pixels - self.mean) / self.std

    def batch(self, images: list[Image.Image]) -> np.ndarray:
        """List of images -> float32 (B, 3, S, S)."""
        return (
            np.stack([self(im) for im in images])
            if images
            else np.zeros((0, 3, self.size, self.size), np.float32)
        )
