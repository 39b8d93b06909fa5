"""Average pooling of the patch tokens (GGeM paper, eq. 1)."""

from __future__ import annotations

import torch

from .base import Pooling


class AvgPooling(Pooling):
    """v_d = mean over patch tokens of x_d: (B, T, D) -> (B, D)."""

    def pool_patches(self, patches: torch.Tensor) -> torch.Tensor:
        return patches.mean(dim=1)
