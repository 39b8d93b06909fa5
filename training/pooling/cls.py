"""Class-token pooling: the ViT's own [class] token, as in BERT and the original ViT."""

from __future__ import annotations

import torch

from .base import Pooling, split_tokens


class ClsPooling(Pooling):
    """Returns the first prefix token: (B, P + T, D) -> (B, D). Needs P >= 1."""

    def forward(self, tokens: torch.Tensor, num_prefix_tokens: int = 0) -> torch.Tensor:
        if num_prefix_tokens < 1:
            raise ValueError(
                "cls pooling needs a backbone with a class token (num_prefix_tokens >= 1)"
            )
        prefix, _ = split_tokens(tokens, num_prefix_tokens)
        return prefix[:, 0]
