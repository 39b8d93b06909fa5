"""The embedding model: ViT backbone -> pooling -> optional projection -> L2 norm."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import resolve_data_config
from torch import nn

from .backbones import BackboneError, create_backbone
from .pooling import create_pooling


class EmbeddingModel(nn.Module):
    """images (B, 3, H, W), normalised -> embeddings (B, D), unit L2 norm.

    `backbone.forward_features` gives the tokens (B, P + T, C); the pooling maps them
    to (B, C'); an optional linear layer projects to `dim`.
    """

    def __init__(self, backbone: nn.Module, pooling: nn.Module, pooled_dim: int, dim: int | None):
        super().__init__()
        self.backbone = backbone
        self.pool = pooling
        self.proj = nn.Linear(pooled_dim, dim) if dim else nn.Identity()
        self.embedding_dim = dim or pooled_dim

    @property
    def num_prefix_tokens(self) -> int:
        return int(getattr(self.backbone, "num_prefix_tokens", 0))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.backbone.forward_features(images)
        pooled = self.pool(tokens, self.num_prefix_tokens)
        return F.normalize(self.proj(pooled).float(), dim=-1)

    def data_config(self) -> dict[str, Any]:
        """timm's preprocessing config: input_size, interpolation, mean, std, crop_pct."""
        config = resolve_data_config({}, model=self.backbone)
        # The patch embedding fixes the input size, whatever the pretrained config says.
        img_size = getattr(getattr(self.backbone, "patch_embed", None), "img_size", None)
        if img_size is not None:
            config["input_size"] = (3, *img_size)
        return config


def build_model(
    backbone: str,
    pool: str,
    dim: int | None = None,
    pretrained: str | None = None,
    pool_options: dict[str, Any] | None = None,
    drop_path_rate: float = 0.0,
) -> EmbeddingModel:
    """Create backbone and pooling by name and put them together."""
    net = create_backbone(backbone, pretrained=pretrained, drop_path_rate=drop_path_rate)
    width = int(net.num_features)
    heads = int(net.blocks[0].attn.num_heads) if hasattr(net, "blocks") else 1
    if pool == "cls" and not getattr(net, "has_class_token", net.num_prefix_tokens > 0):
        raise BackboneError(f"{backbone} has no class token; choose another --pool")
    pooling, pooled_dim = create_pooling(pool, width, heads, **(pool_options or {}))
    return EmbeddingModel(net, pooling, pooled_dim, dim)


def weights_fingerprint(model: nn.Module) -> str:
    """sha256 over the state dict: names, dtypes, shapes and bytes, in sorted name order.

    Two models with the same fingerprint compute the same function, so an index built
    with one can be searched with the other.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous().reshape(-1)  # 0-d tensors cannot be viewed as bytes
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
