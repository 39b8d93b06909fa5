"""Joint codebook and factorisation (JCF), eq. (13) of the codebook-factorisation paper.

C-CBP (eq. 10, `ccbp.py`) learns one projector per codeword and output dimension, 2NdD
parameters. JCF shares R projectors across the codebook (sec. 3.3): the codeword
weights h(x) are mapped to projector weights by A, B in R^{N x R} (eq. 12 with the
linear f_p(a) = A^T a, f_q(a) = B^T a; its index j on u, v reads r, docs/papers.md, reading 5):

    z_i(x) = ( h(x)^T A U~_i^T x ) ( h(x)^T B V~_i^T x ),   U~_i, V~_i in R^{d x R}   (eq. 13)

stored as U_tilde, V_tilde of shape (d, D, R). It is C-CBP with U_i = U~_i A^T and
V_i = V~_i B^T, at 2(RdD + NR) parameters and, per image of T tokens, T*R*d*D
multiply-adds per factor instead of T*N*d*D (ratio R/N), plus T*N*R for h^T A. Local features, soft
assignment (softmax scale s, initially 10), token averaging and L2 normalisation are
those of C-CBP; see `ccbp.py` for the choice of s.

Initialisation: A, B ~ N(0, 1/N), the 1/sqrt(fan-in) scale of a linear map from R^N;
U~, V~ ~ N(0, N/(dR)), so that the implied U_i = U~_i A^T has entries of variance
R * N/(dR) * 1/N = 1/d, the initial scale of C-CBP's U: both heads start from
statistically alike projections. Only the products U~ A^T, V~ B^T matter (and the output
is L2-normalised), so this split of the scale sets how fast Adam moves each factor: A (std
0.18) and U~ (std 0.125) at the defaults get steps of similar relative size.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..options import JCFOptions
from .ccbp import CodebookPooling, bilinear_features


class JCF(CodebookPooling):
    """JCF (eq. 13): patch tokens (B, T, in_dim) -> (B, out_dim), unit L2 norm.

    Args: those of CodebookPooling (in_dim, d, out_dim, codebook, scale), and
        rank: R, the number of shared projectors.

    Defaults: JCFOptions (training/options.py), the paper's sizes.

    Parameters: reduce (in_dim*d + d), codebook (N*d), log_scale (1), A and B (N, R),
    U_tilde and V_tilde (d, D, R): the factorised part has 2(RdD + NR) parameters.
    """

    def __init__(
        self,
        in_dim: int,
        d: int = JCFOptions.d,
        out_dim: int = JCFOptions.out_dim,
        codebook: int = JCFOptions.codebook,
        rank: int = JCFOptions.rank,
        *,
        scale: float = JCFOptions.scale,
    ):
        super().__init__(in_dim, d, out_dim, codebook, scale)
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.rank = rank
        self.A = nn.Parameter(torch.randn(codebook, rank) / math.sqrt(codebook))
        self.B = nn.Parameter(torch.randn(codebook, rank) / math.sqrt(codebook))
        std = math.sqrt(codebook / (d * rank))
        self.U_tilde = nn.Parameter(torch.randn(d, out_dim, rank) * std)
        self.V_tilde = nn.Parameter(torch.randn(d, out_dim, rank) * std)

    def second_order(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Eq. (13) per token: x (B, T, d), h (B, T, N) -> z (B, T, D)."""
        a = h @ self.A.float()  # (B, T, R): f_p(h) = A^T h
        b = h @ self.B.float()
        return bilinear_features(x, a, self.U_tilde.float(), b, self.V_tilde.float())

    def factorised_parameters(self) -> int:
        """2(RdD + NR): the entries of U~, V~, A and B."""
        return sum(p.numel() for p in (self.U_tilde, self.V_tilde, self.A, self.B))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}"
