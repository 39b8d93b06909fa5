"""Group Generalized Mean pooling (GGeM), the pooling head of the GGeM paper.

GGeM splits the D channels of the patch tokens into G contiguous groups of D/G
channels and applies GeM to each group with its own trainable exponent p_g
(paper, eq. 4):

    v_d = ( 1/|X_d| * sum_{x in X_d} x^{p_{y(d)}} )^{1 / p_{y(d)}},   y(i) = ceil(i / (D/G))

With G equal to the number of attention heads, group g holds channels
g*D/G .. (g+1)*D/G - 1, exactly the channels that head g wrote, so each head gets its
own degree of gradient concentration (paper, sec. 3.4). The paper's pseudo-code
reshape would group channels by stride instead; eq. 4 is what is implemented here.

Activations are clamped at eps before the power (ViT activations can be negative;
the clamp is the paper's method). The power mean is computed in fp32 and in log
space, exp((logsumexp_t(p * log x_t) - log T) / p), so that p = 5 on large activations
cannot overflow even under mixed precision.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..options import GGeMOptions
from .base import Pooling


class GGeM(Pooling):
    """Group GeM pooling: patch tokens (B, T, D) -> (B, D), D divisible by `groups`.

    Args:
        groups: G, the number of contiguous channel groups (the backbone's head count
            is the paper's recommendation and the registry's default).
        p: initial exponent of every group (the paper uses 3 for retrieval).
        eps: activations are clamped to at least eps before the power.
        learn_p: train the exponents (True) or keep them fixed.

    Defaults: GGeMOptions (training/options.py).
    """

    def __init__(
        self,
        groups: int,
        p: float = GGeMOptions.p,
        eps: float = GGeMOptions.eps,
        learn_p: bool = GGeMOptions.learn_p,
    ):
        super().__init__()
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        if eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.groups = groups
        self.eps = eps
        self.p = nn.Parameter(torch.full((groups,), float(p)), requires_grad=learn_p)

    def pool_patches(self, patches: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = patches.shape
        if dim % self.groups:
            raise ValueError(
                f"GGeM: {dim} channels cannot be split into {self.groups} equal groups"
            )
        # (B, T, G, D/G): channel c lands in group c // (D/G), the contiguous grouping of eq. 4.
        x = (
            patches.float()
            .clamp(min=self.eps)
            .reshape(batch, tokens, self.groups, dim // self.groups)
        )
        p = self.p.float().view(1, 1, self.groups, 1)
        log_mean = torch.logsumexp(p * x.log(), dim=1) - math.log(tokens)  # (B, G, D/G)
        return torch.exp(log_mean / p.squeeze(1)).reshape(batch, dim)

    def extra_repr(self) -> str:
        return f"groups={self.groups}, eps={self.eps}"
