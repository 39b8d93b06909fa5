"""Global InfoNCE over two views per image: SimCLR's NT-Xent, DenseCL++'s L_g.

DenseCL++ (docs/papers.md; its sec. 3.1) trains the global representation with "the global
InfoNCE loss term L_{i,g}" (Oord et al. 2018) in SimCLR's in-batch form (Chen et al.
2020, eq. 1 there): with z the 2B L2-normalised projected views, views i and i + B
the two augmentations of image i, p(i) = (i + B) mod 2B the other view of anchor i's
image and tau the temperature,

    l_i = -log( exp(z_i . z_{p(i)} / tau) / sum_{a != i} exp(z_i . z_a / tau) )
    L_g = 1/(2B) sum_i l_i

Each anchor has one positive; the denominator holds all 2B - 1 other views (the
positive and the 2B - 2 views of other images). It equals SupConLoss with the image
index as the label. Every exponent is a similarity divided by tau (docs/papers.md,
reading 4).

Not registered as a `fit --loss`: the registry's losses take (embeddings, labels) of
labelled images, while this takes views and no labels (`vitrieval-train pretrain`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..options import InfoNCEOptions
from .base import check_paired_views, check_temperature


class InfoNCELoss(nn.Module):
    """Args: temperature tau (> 0; default: InfoNCEOptions, SimCLR's). Has no parameters.

    forward(z (2B, c) float) -> scalar, the mean over the 2B anchors. z is
    L2-normalised here too (a no-op for unit rows), in fp32 whatever its dtype.
    """

    def __init__(self, temperature: float = InfoNCEOptions.temperature):
        super().__init__()
        self.temperature = check_temperature(temperature)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        b = check_paired_views(z, 2)
        z = F.normalize(z.float(), dim=-1)
        n = 2 * b
        logits = (z @ z.t()) / self.temperature  # (2B, 2B)
        self_mask = torch.eye(n, dtype=torch.bool, device=z.device)
        logits = logits.masked_fill(self_mask, float("-inf"))  # a != i
        positive = torch.arange(n, device=z.device).roll(b)  # p(i) = (i + B) mod 2B
        return F.cross_entropy(logits, positive)
