"""The contract every pooling head follows.

A pooling maps the token sequence of a ViT, shape (B, P + T, D) with P prefix tokens
(class and register tokens) followed by T patch tokens, to one vector per image,
shape (B, out_dim). Most poolings aggregate the patch tokens only; the class-token
pooling reads the prefix. `split_tokens` is the one place that tells them apart.
"""

from __future__ import annotations

import torch
from torch import nn


class Pooling(nn.Module):
    """Base class: subclasses implement `pool_patches` or override `forward`."""

    def forward(self, tokens: torch.Tensor, num_prefix_tokens: int = 0) -> torch.Tensor:
        """tokens: (B, P + T, D) -> (B, out_dim)."""
        _, patches = split_tokens(tokens, num_prefix_tokens)
        return self.pool_patches(patches)

    def pool_patches(self, patches: torch.Tensor) -> torch.Tensor:
        """patches: (B, T, D) -> (B, out_dim)."""
        raise NotImplementedError


def split_tokens(tokens: torch.Tensor, num_prefix_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P + T, D) -> prefix (B, P, D) and patches (B, T, D), checking the shape."""
    if tokens.dim() != 3:
        raise ValueError(f"expected tokens of shape (B, T, D), got {tuple(tokens.shape)}")
    if not 0 <= num_prefix_tokens < tokens.shape[1]:
        raise ValueError(
            f"num_prefix_tokens={num_prefix_tokens} leaves no patch tokens in a sequence "
            f"of {tokens.shape[1]}"
        )
    return tokens[:, :num_prefix_tokens], tokens[:, num_prefix_tokens:]
