"""Triplet margin loss with in-batch mining (batch-hard, semi-hard, all).

Embeddings are L2-normalised first; the distance between two of them is either

    cosine:     d(a, b) = 1 - cos(a, b)                 (default, in [0, 2])
    euclidean:  d(a, b) = ||a - b|| = sqrt(2 - 2 cos(a, b))   (in [0, 2])

and each triplet (anchor a, positive p of a's class, p != a, negative n of another class)
costs

    l(a, p, n) = max(0, d(a, p) - d(a, n) + margin)

Triplets are mined inside the batch, on the N x N distance matrix, without Python loops
("all" and "semi_hard" build (N, N, N) tensors: 64 MiB of float32 at N = 256):

- "all": every valid triplet; the loss is the mean over the *active* triplets (l > 0),
  as is usual (averaging in the many zero triplets would shrink the gradient as the
  model improves). If no triplet is active the loss is 0.
- "batch_hard" (Hermans et al. 2017, "In defense of the triplet loss"): per anchor the
  hardest positive (max d(a, p)) and the hardest negative (min d(a, n)); mean over the
  anchors that have at least one positive and one negative.
- "semi_hard" (Schroff et al. 2015, FaceNet): per (a, p) pair the closest negative
  that is still farther than the positive but inside the margin,
  d(a, p) < d(a, n) < d(a, p) + margin. Where no negative lies in that band the pair
  falls back to the hardest negative (min d(a, n)), so a pair whose negatives are all
  too close still gets a gradient, and one whose negatives are all beyond the margin
  costs 0. Mean over the (a, p) pairs whose anchor has a negative.

A batch without a valid triplet (one class only, or no class with two items) returns
`embeddings.sum() * 0`: a zero that keeps the graph, so `backward()` works and a training
step with an unlucky batch does not crash. The P x K sampler in `vitrieval.training.samplers`
makes every batch valid.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..options import DISTANCES, MINING, TripletOptions
from .base import MetricLoss

__all__ = ["DISTANCES", "MINING", "TripletMarginLoss", "create_triplet"]


class TripletMarginLoss(MetricLoss):
    """Args: margin (>= 0), mining (one of MINING), distance (one of DISTANCES); the
    defaults are TripletOptions (training/options.py).

    Has no parameters; labels may be any integers (they are only compared).
    """

    def __init__(
        self,
        margin: float = TripletOptions.margin,
        mining: str = TripletOptions.mining,
        distance: str = TripletOptions.distance,
    ):
        super().__init__()
        if mining not in MINING:
            raise ValueError(f"unknown triplet mining {mining!r}; valid: {', '.join(MINING)}")
        if distance not in DISTANCES:
            raise ValueError(
                f"unknown triplet distance {distance!r}; valid: {', '.join(DISTANCES)}"
            )
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.margin = float(margin)
        self.mining = mining
        self.distance = distance

    def extra_repr(self) -> str:
        return f"margin={self.margin}, mining={self.mining!r}, distance={self.distance!r}"

    def distances(self, embeddings: torch.Tensor) -> torch.Tensor:
        """(N, D) -> (N, N) distances between the L2-normalised embeddings."""
        x = F.normalize(embeddings.float(), dim=-1)
        cos = x @ x.t()
        if self.distance == "cosine":
            return 1.0 - cos
        # The clamp keeps sqrt's gradient finite at d = 0 (the diagonal, duplicates).
        return (2.0 - 2.0 * cos).clamp(min=1e-12).sqrt()

    def compute_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        dist = self.distances(embeddings)
        same = labels[:, None] == labels[None, :]
        eye = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
        positive = same & ~eye  # (a, p)
        negative = ~same  # (a, n)
        anchor_ok = positive.any(1) & negative.any(1)
        if not bool(anchor_ok.any()):
            return embeddings.sum() * 0.0
        if self.mining == "all":
            return self._all(dist, positive, negative)
        if self.mining == "batch_hard":
            return self._batch_hard(dist, positive, negative, anchor_ok)
        return self._semi_hard(dist, positive, negative)

    def _all(self, dist: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor):
        # loss[a, p, n] = d(a, p) - d(a, n) + margin
        loss = (dist[:, :, None] - dist[:, None, :] + self.margin).clamp(min=0)
        valid = positive[:, :, None] & negative[:, None, :]
        loss = loss[valid]
        active = (loss > 0).sum().clamp(min=1)
        return loss.sum() / active

    def _hardest_negative(self, dist: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
        """(N,) min d(a, n) over a's negatives (+inf where it has none)."""
        return dist.masked_fill(~negative, float("inf")).min(dim=1).values

    def _batch_hard(
        self,
        dist: torch.Tensor,
        positive: torch.Tensor,
        negative: torch.Tensor,
        anchor_ok: torch.Tensor,
    ) -> torch.Tensor:
        hardest_pos = dist.masked_fill(~positive, float("-inf")).max(dim=1).values
        hardest_neg = self._hardest_negative(dist, negative)
        loss = hardest_pos[anchor_ok] - hardest_neg[anchor_ok] + self.margin
        return loss.clamp(min=0).mean()

    def _semi_hard(
        self, dist: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor
    ) -> torch.Tensor:
        d_ap = dist[:, :, None]  # (a, p, 1)
        d_an = dist[:, None, :]  # (a, 1, n)
        band = negative[:, None, :] & (d_an > d_ap) & (d_an < d_ap + self.margin)  # (a, p, n)
        semi = d_an.expand_as(band).masked_fill(~band, float("inf")).min(dim=2).values
        hardest = self._hardest_negative(dist, negative)[:, None].expand_as(semi)
        chosen = torch.where(band.any(dim=2), semi, hardest)  # (a, p)
        pairs = positive & negative.any(dim=1, keepdim=True)
        loss = dist[pairs] - chosen[pairs] + self.margin
        return loss.clamp(min=0).mean()


def create_triplet(embedding_dim: int, num_classes: int, **options: Any) -> TripletMarginLoss:
    """Registry factory; embedding_dim and num_classes are unused (no class proxies)."""
    del embedding_dim, num_classes
    return TripletMarginLoss(**options)
