"""Augmentations of the two-stage methods (`fit --method lacvit | ce`), torchvision v2.

LaCViT's stage 1 (its "Data augmentation" paragraph) draws two views of every image
from a composition of "random crop (with flip and resize), different rotations, colour
distortion and Gaussian blur". The paper gives no strengths; those below are SimCLR's
and SupCon's (Chen et al. 2020, Khosla et al. 2020), whose augmentation module LaCViT
says it follows:

| step | setting | why |
|---|---|---|
| random resized crop | area `crop_scale`..1, aspect 3/4..4/3 | the project's `--crop-scale` |
| horizontal flip | probability `hflip` | 0 for digits (a mirrored 2 is not a 2) |
| rotation | uniform in +-15 degrees, p 0.5 | large rotations turn a 6 into a 9 |
| colour distortion | jitter (0.4, 0.4, 0.4, 0.1) p 0.8, grayscale p 0.2 | SimCLR, strength 0.5 |
| Gaussian blur | sigma 0.1..max(0.5, 2 side / 224) px, p 0.5 | SimCLR's 0.1..2 px at 224 px |

The blur is Pillow's (`ImageFilter.GaussianBlur`, whose radius is the standard
deviation): torchvision's blur of a PIL image converts it to a tensor and convolves
with torch's thread pool, which ran at about 40 images/s on the 2-core machine, while
Pillow's takes microseconds. The sigma range is SimCLR's scaled to the image side (at
least 0.5 px, so it still blurs at 32 px; 2 px would erase a 32 px digit's strokes).

Stage 2 sees one "lightly augmented" view: the random resized crop and flip only.
Every transform ends with the model's own normalisation (mean, std of its data
config), so a view is the float32 (3, H, W) tensor the model expects.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from PIL import Image, ImageFilter
from torchvision.transforms import InterpolationMode, v2

ROTATION_DEGREES = 15.0
COLOR_JITTER = (0.4, 0.4, 0.4, 0.1)  # brightness, contrast, saturation, hue

_INTERPOLATION = {
    "bilinear": InterpolationMode.BILINEAR,
    "bicubic": InterpolationMode.BICUBIC,
    "nearest": InterpolationMode.NEAREST,
}


class RandomGaussianBlur:
    """PIL image -> the image blurred with sigma uniform in `sigma` (drawn from torch's RNG,
    so the per-epoch reseeding makes it reproducible)."""

    def __init__(self, sigma: tuple[float, float]):
        self.sigma = sigma

    def __call__(self, image: Image.Image) -> Image.Image:
        low, high = self.sigma
        sigma = low + (high - low) * float(torch.rand(()))
        return image.filter(ImageFilter.GaussianBlur(radius=sigma))

    def __repr__(self) -> str:
        return f"RandomGaussianBlur(sigma={self.sigma})"


def _size_and_interpolation(data_config: dict) -> tuple[int, InterpolationMode]:
    size = int(data_config["input_size"][-1])
    return size, _INTERPOLATION.get(str(data_config["interpolation"]), InterpolationMode.BICUBIC)


def _to_model_input(data_config: dict) -> list[v2.Transform]:
    return [
        v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=list(data_config["mean"]), std=list(data_config["std"])),
    ]


def contrastive_view_transform(
    data_config: dict, crop_scale: float, hflip: float, rotation: bool = True
) -> v2.Compose:
    """PIL image -> one strongly augmented view, float32 (3, H, W) normalised (table above).

    `rotation=False` leaves the rotation step out (SimCLR's and DenseCL++'s views,
    `vitrieval-train pretrain`)."""
    size, interpolation = _size_and_interpolation(data_config)
    blur = RandomGaussianBlur((0.1, max(0.5, 2.0 * size / 224)))
    rotate = v2.RandomApply([v2.RandomRotation(ROTATION_DEGREES, interpolation=interpolation)], 0.5)
    return v2.Compose(
        [
            v2.RandomResizedCrop(
                size, scale=(crop_scale, 1.0), interpolation=interpolation, antialias=True
            ),
            v2.RandomHorizontalFlip(p=hflip),
            *([rotate] if rotation else []),
            v2.RandomApply([v2.ColorJitter(*COLOR_JITTER)], p=0.8),
            v2.RandomGrayscale(p=0.2),
            v2.RandomApply([blur], p=0.5),
            *_to_model_input(data_config),
        ]
    )


def light_transform(data_config: dict, crop_scale: float, hflip: float) -> v2.Compose:
    """PIL image -> a lightly augmented view (crop and flip only), float32 (3, H, W)."""
    size, interpolation = _size_and_interpolation(data_config)
    return v2.Compose(
        [
            v2.RandomResizedCrop(
                size, scale=(crop_scale, 1.0), interpolation=interpolation, antialias=True
            ),
            v2.RandomHorizontalFlip(p=hflip),
            *_to_model_input(data_config),
        ]
    )


class TwoViews:
    """PIL image -> (view_1, view_2): the same random transform drawn twice.

    The two draws are independent, so the views of one image differ; they form the
    positive pair that every anchor of the supervised contrastive loss is guaranteed.
    """

    def __init__(self, transform: Callable[[Image.Image], torch.Tensor]):
        self.transform = transform

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(image), self.transform(image)

    def __repr__(self) -> str:
        return f"TwoViews({self.transform!r})"
