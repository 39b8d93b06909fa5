"""Optimiser parameter groups and the learning-rate schedule.

- Layer-wise learning-rate decay (as in BEiT/MAE fine-tuning, used by the GGeM paper):
  with L transformer blocks, the patch embedding and position/class tokens are layer
  0, block i is layer i + 1, and everything after the blocks (final norm, pooling,
  projection) is layer L + 1; a parameter of layer l gets lr * decay^(L + 1 - l).
- No weight decay on biases, norm weights, tokens, position embeddings or pooling
  exponents (every parameter with fewer than 2 dimensions, and the tokens).
- The loss's proxies get lr * proxy_lr_scale and no weight decay (GGeM paper, Tab. B).
- Schedule: linear warm-up to the peak, then cosine decay to min_lr_ratio * peak.
"""

from __future__ import annotations

import math
import re

from torch import nn

_TOKEN_NAMES = ("cls_token", "reg_token", "pos_embed", "dist_token", "mask_token")


def layer_id(name: str, num_blocks: int) -> int:
    """Layer index of an EmbeddingModel parameter name for layer-wise decay."""
    if name.startswith("backbone."):
        rest = name[len("backbone.") :]
        if rest.startswith(("patch_embed", *_TOKEN_NAMES)):
            return 0
        match = re.match(r"blocks\.(\d+)\.", rest)
        if match:
            return int(match.group(1)) + 1
    return num_blocks + 1


def param_groups(
    model: nn.Module,
    loss: nn.Module,
    weight_decay: float,
    layer_decay: float,
    proxy_lr_scale: float,
) -> list[dict]:
    """AdamW groups, each with an `lr_scale` the schedule multiplies into its lr."""
    num_blocks = len(getattr(getattr(model, "backbone", None), "blocks", []))
    groups: dict[tuple[int, bool], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        lid = layer_id(name, num_blocks)
        decay = param.ndim >= 2 and not any(t in name for t in _TOKEN_NAMES)
        group = groups.setdefault(
            (lid, decay),
            {
                "params": [],
                "weight_decay": weight_decay if decay else 0.0,
                "lr_scale": layer_decay ** (num_blocks + 1 - lid),
                "name": f"layer{lid}{'' if decay else '_no_decay'}",
            },
        )
        group["params"].append(param)
    ordered = [groups[k] for k in sorted(groups)]
    proxies = [p for p in loss.parameters() if p.requires_grad]
    if proxies:
        ordered.append(
            {"params": proxies, "weight_decay": 0.0, "lr_scale": proxy_lr_scale, "name": "proxies"}
        )
    return ordered


def lr_at(step: int, total_steps: int, warmup_steps: int, peak: float, min_ratio: float) -> float:
    """Learning rate at optimiser step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    floor = peak * min_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
