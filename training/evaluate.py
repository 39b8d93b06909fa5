"""Embed a held-out split with the PyTorch model and score retrieval on it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from vitrieval.index.evaluation.datasets import Item
from vitrieval.index.evaluation.metrics import retrieval_metrics

from .data import ImageDataset

EVAL_KS = (1, 2, 4, 8)


@torch.no_grad()
def embed_items(
    model: torch.nn.Module,
    items: Sequence[Item],
    transform: Callable,
    batch_size: int,
    device: torch.device,
    workers: int = 0,
) -> np.ndarray:
    """items -> float32 (N, D) embeddings, in item order."""
    # Only the images matter here; every label maps to a dummy class index.
    any_class = {item.label: 0 for item in items}
    loader = DataLoader(
        ImageDataset(items, any_class, transform),
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
    )
    was_training = model.training
    model.eval()
    chunks = [model(images.to(device)).float().cpu().numpy() for images, _ in loader]
    model.train(was_training)
    return np.concatenate(chunks) if chunks else np.zeros((0, 0), np.float32)


def evaluate_retrieval(
    model: torch.nn.Module, items: Sequence[Item], *embedding: Any
) -> dict[str, float]:
    """Leave-one-out retrieval metrics within `items` (recall@K, map, map_at_r,
    r_precision); `embedding`: the rest of `embed_items`' arguments (transform,
    batch_size, device, workers)."""
    embeddings = embed_items(model, items, *embedding)
    return retrieval_metrics(embeddings, [item.label for item in items], ks=EVAL_KS)
