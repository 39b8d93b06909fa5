"""Max pooling of the patch tokens (GGeM paper, eq. 2)."""

from __future__ import annotations

import torch

from .base import Pooling


class MaxPooling(Pooling):
    """v_d = max over patch tokens of x_d: (B, T, D) -> (B, D)."""

    def pool_patches(self, patches: torch.Tensor) -> torch.Tensor:
        return patches.amax(dim=1)
