"""Supervised contrastive loss (SupCon): the label-aware loss of LaCViT's stage 1.

LaCViT (its "Contrastive Training Objective" equation, adapted from Khosla et al.,
"Supervised Contrastive Learning", NeurIPS 2020) uses the form that averages the
positives *outside* the log (Khosla et al.'s L_out). With z the L2-normalised
embeddings of every view in the batch (all views flattened into N rows), tau the
temperature, P(i) = {p != i : y_p = y_i} the positives of anchor i and
A(i) = {a != i} everything but the anchor itself:

    L = 1/|I| sum_{i in I}  -1/|P(i)| sum_{p in P(i)}
            log( exp(z_i . z_p / tau) / sum_{a in A(i)} exp(z_i . z_a / tau) )

The paper writes a sum over anchors; here it is the mean, so the scale does not
depend on the batch size. An anchor's own second view is simply one of its
positives (it has the same label), so nothing view-specific is needed.

Anchors without a positive (their label occurs once in the batch) have an empty
P(i) and no defined term: they are left out, and I is the set of anchors with at
least one positive (they still appear in the other anchors' denominators as
negatives). If no anchor has a positive, the loss is a zero that is still attached
to the graph (so `backward()` works and yields zero gradients).

Shapes: embeddings (N, D) float, labels (N,) int -> scalar. The embeddings are
L2-normalised here as well (a no-op, up to rounding, for inputs that already are),
so z_i . z_a is a cosine. fp16 / bf16 inputs are computed in fp32.

Numerics: each row's log-denominator is a logsumexp over the row with the diagonal
set to -inf, so exp never overflows even at small tau.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..options import SupConOptions
from .base import MetricLoss, check_temperature


class SupConLoss(MetricLoss):
    """Args: temperature tau (default: SupConOptions). Has no parameters."""

    def __init__(self, temperature: float = SupConOptions.temperature):
        super().__init__()
        self.temperature = check_temperature(temperature)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"

    def compute_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if embeddings.dtype in (torch.float16, torch.bfloat16):
            embeddings = embeddings.float()
        n = embeddings.shape[0]
        labels = labels.to(embeddings.device)
        self_mask = torch.eye(n, dtype=torch.bool, device=embeddings.device)
        pos_mask = (labels[:, None] == labels[None, :]) & ~self_mask  # (N, N): P(i) per row
        n_pos = pos_mask.sum(dim=1)  # (N,) |P(i)|
        has_pos = n_pos > 0
        if not bool(has_pos.any()):
            # No anchor has a positive (includes N <= 1): a zero that keeps the graph.
            return embeddings.sum() * 0.0

        z = F.normalize(embeddings, dim=1)
        logits = (z @ z.t()) / self.temperature  # (N, N) z_i . z_a / tau
        logits = logits.masked_fill(self_mask, float("-inf"))  # a != i
        log_denom = torch.logsumexp(logits, dim=1, keepdim=True)  # (N, 1)
        log_prob = logits - log_denom  # (N, N); -inf on the diagonal
        # Sum the log-probabilities of the positives only (where, not a product: the
        # diagonal is -inf and -inf * 0 would be NaN).
        pos_log_prob = torch.where(pos_mask, log_prob, torch.zeros_like(log_prob)).sum(dim=1)
        per_anchor = -pos_log_prob[has_pos] / n_pos[has_pos].to(log_prob.dtype)
        return per_anchor.mean()


def create_supcon(embedding_dim: int, num_classes: int, **options: Any) -> SupConLoss:
    """Registry factory (`--loss supcon`); `embedding_dim` and `num_classes` are unused."""
    del embedding_dim, num_classes
    return SupConLoss(**options)
