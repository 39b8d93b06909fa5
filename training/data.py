"""Torch views of `vitrieval.index.evaluation.datasets` items: transforms from timm and a
readability
check."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
from PIL import Image
from timm.data import create_transform
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from vitrieval.index.evaluation.datasets import Item
from vitrieval.index.runtime.images import DEFAULT_MAX_PIXELS, ImageDecodeError
from vitrieval.index.runtime.preprocess import draft_size

from .config import FitConfig
from .decode_cache import DecodeCache
from .samplers import ClassBalancedBatchSampler


class ImageDataset(Dataset):
    """items -> (image tensor (3, H, W), class index)."""

    def __init__(self, items: Sequence[Item], class_to_index: dict[str, int], transform: Callable):
        self.items = list(items)
        self.class_to_index = class_to_index
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        item = self.items[index]
        return self.transform(item.open()), self.class_to_index[item.label]


def build_transforms(
    data_config: dict, crop_scale: float, hflip: float, auto_augment: str | None = None
) -> tuple[Callable, Callable]:
    """timm's training transform (random resized crop, flip, colour jitter) and eval transform."""
    common = dict(
        input_size=data_config["input_size"],
        interpolation=data_config["interpolation"],
        mean=data_config["mean"],
        std=data_config["std"],
    )
    train = create_transform(
        is_training=True, scale=(crop_scale, 1.0), hflip=hflip, auto_augment=auto_augment, **common
    )
    evaluation = create_transform(is_training=False, crop_pct=data_config["crop_pct"], **common)
    return train, evaluation


@dataclass(frozen=True)
class EmbedderDecodedItem(Item):
    """An image file decoded as `vitrieval.index.runtime.embedder.Embedder` decodes it for the
    exported
    model (JPEG reduced-scale decoding down to `draft`), whatever draft a caller asks."""

    draft: int | None = None

    def open(
        self, max_pixels: int = DEFAULT_MAX_PIXELS, draft_size: int | None = None
    ) -> Image.Image:
        return super().open(max_pixels, self.draft)


def decoded_as_exported(items: Sequence[Item], data_config: dict) -> list[Item]:
    """`items` as the exported model's Embedder decodes them: held-out images evaluated
    so give `fit` the figures `vitrieval-index bench` gives the exported model (the decode
    cache's reduced copies, resized twice, moved R@1 by a few queries). In-memory items
    need no decoding and stay as they are."""
    draft = draft_size(data_config["input_size"][-1], data_config["crop_pct"])
    names = [f.name for f in fields(Item)]
    return [
        item
        if item.path is None
        else EmbedderDecodedItem(**{name: getattr(item, name) for name in names}, draft=draft)
        for item in items
    ]


def drop_unreadable(
    items: Sequence[Item], desc: str, cache: DecodeCache | None = None
) -> tuple[list[Item], list[tuple[str, str]]]:
    """Decode every item once; return the readable ones and (key, reason) for the rest.

    With `cache`, the same pass fills it: the readable file items come back as items
    that open their working-size copy (training/decode_cache.py), so no epoch decodes
    the files again. Items without a file are checked and kept as they are.
    """
    good: list[Item] = []
    bad: list[tuple[str, str]] = []
    in_memory = all(item.path is None for item in items)
    for item in tqdm(
        items, desc=f"checking {desc}", unit="img", disable=None if not in_memory else True
    ):
        try:
            if cache is not None and item.path is not None:
                item = cache.load(item)
            else:
                item.open()
        except ImageDecodeError as exc:
            bad.append((item.key, str(exc)))
        else:
            good.append(item)
    return good, bad


def epoch_loader(
    dataset: ImageDataset, cfg: FitConfig, epoch: int, pin_memory: bool = False
) -> DataLoader:
    """The training batches of `epoch`, drawn from seeds derived from (cfg.seed, epoch).

    `sampler="random"`: shuffled batches of `batch_size`, the last partial one dropped.
    `sampler="pk"`: `classes_per_batch` classes x `samples_per_class` images per batch
    (what triplet and contrastive losses need to find positives).
    """
    seed = cfg.seed * 100_003 + epoch
    if cfg.sampler == "pk":
        labels = [dataset.class_to_index[item.label] for item in dataset.items]
        sampler = ClassBalancedBatchSampler(
            labels, cfg.classes_per_batch, cfg.samples_per_class, seed=cfg.seed
        )
        sampler.set_epoch(epoch)
        return DataLoader(
            dataset, batch_sampler=sampler, num_workers=cfg.workers, pin_memory=pin_memory
        )
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        shuffle=True,
        drop_last=len(dataset) > cfg.batch_size,
        num_workers=cfg.workers,
        generator=torch.Generator().manual_seed(seed),
        pin_memory=pin_memory,
    )
