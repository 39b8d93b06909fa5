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
