"""What every loss shares: the (embeddings, labels) contract and its shape checks."""

from __future__ import annotations

import torch
from torch import nn


class MetricLoss(nn.Module):
    """Base class. `forward(embeddings (N, D) float, labels (N,) int) -> scalar`.

    Subclasses implement `compute_loss` and may own parameters (class proxies); the
    optimiser puts every parameter of a loss in a group with its own learning rate.
    """

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_embeddings_and_labels(embeddings, labels)
        return self.compute_loss(embeddings, labels)

    def compute_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def check_temperature(temperature: float) -> float:
    """A softmax temperature: a positive number (the losses divide by it)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return float(temperature)


def check_embeddings_and_labels(embeddings: torch.Tensor, labels: torch.Tensor) -> None:
    if embeddings.dim() != 2:
        raise ValueError(f"embeddings must be (N, D), got shape {tuple(embeddings.shape)}")
    if not embeddings.is_floating_point():
        raise ValueError(f"embeddings must be floating point, got {embeddings.dtype}")
    if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
        raise ValueError(
            f"labels must be (N,) with N = {embeddings.shape[0]}, got shape {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"labels must be integers, got {labels.dtype}")


def check_paired_views(z: torch.Tensor, ndim: int, name: str = "z") -> int:
    """Check a batch of two views per image, rows i and i + B of one image; return B.

    For the self-supervised losses (InfoNCELoss, DenseContrastiveLoss), which take views
    instead of (embeddings, labels): `z` must be floating point with `ndim` dimensions
    and an even, non-zero first axis 2B.
    """
    if z.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(z.shape)}")
    if not z.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {z.dtype}")
    if z.shape[0] == 0 or z.shape[0] % 2:
        raise ValueError(
            f"{name} must hold two views per image (2B rows, views i and i + B of image i), "
            f"got {z.shape[0]} rows"
        )
    return z.shape[0] // 2
