"""Generalized Mean pooling (GeM) of the patch tokens (GGeM paper, eq. 3).

GeM is GGeM with a single group: one trainable exponent p shared by all channels.
p = 1 is average pooling and p -> infinity approaches max pooling.
"""

from __future__ import annotations

from ..options import GeMOptions
from .ggem import GGeM


class GeM(GGeM):
    """GeM pooling: patch tokens (B, T, D) -> (B, D) with one trainable exponent."""

    def __init__(
        self,
        p: float = GeMOptions.p,
        eps: float = GeMOptions.eps,
        learn_p: bool = GeMOptions.learn_p,
    ):
        super().__init__(groups=1, p=p, eps=eps, learn_p=learn_p)
