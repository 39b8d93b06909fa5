"""Norm-softmax: softmax cross-entropy over cosine similarities to class proxies.

The GGeM paper fine-tunes for retrieval with it (its sec. 4.2, after Zhai & Wu,
"Classification is a strong baseline for deep metric learning"): each class c has a
proxy w_c; with x and w L2-normalised and temperature tau,

    L = -1/N sum_i log( exp(x_i . w_{y_i} / tau) / sum_c exp(x_i . w_c / tau) )

The paper trains the proxies with a 100x larger learning rate than the network
("proxy LR scale"); `vitrieval.training.optim.param_groups` applies that scale to the loss's
parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..options import NormSoftmaxOptions
from .base import MetricLoss, check_temperature


class NormSoftmaxLoss(MetricLoss):
    """Args: embedding_dim D, num_classes C, temperature tau (default: NormSoftmaxOptions)."""

    def __init__(
        self,
        embedding_dim: int,
        num_classes: int,
        temperature: float = NormSoftmaxOptions.temperature,
    ):
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"norm_softmax needs at least 2 classes, got {num_classes}")
        self.temperature = check_temperature(temperature)
        self.proxies = nn.Parameter(torch.randn(num_classes, embedding_dim) / embedding_dim**0.5)

    def logits(self, embeddings: torch.Tensor) -> torch.Tensor:
        """(N, D) -> (N, C) cosine similarities divided by the temperature."""
        x = F.normalize(embeddings.float(), dim=-1)
        w = F.normalize(self.proxies.float(), dim=-1)
        return x @ w.t() / self.temperature

    def compute_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if int(labels.max()) >= self.proxies.shape[0] or int(labels.min()) < 0:
            raise ValueError(f"labels must lie in [0, {self.proxies.shape[0]})")
        return F.cross_entropy(self.logits(embeddings), labels)
