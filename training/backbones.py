"""ViT backbones from timm, named presets for CPU work, and local pretrained weights.

Every backbone is created with `num_classes=0, global_pool=''`, so its
`forward_features` returns all tokens (B, P + T, D) and vitrieval's pooling decides
how to aggregate them.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

HUB_PROBE_SECONDS = 3.0
"""How long `--pretrained timm` waits to reach the hub (or the proxy) before it looks in
the local cache only: unreachable, timm's hub client retries for about a minute."""


class BackboneError(ValueError):
    """Unknown backbone name or unusable pretrained weights; the message says which."""


@dataclass(frozen=True)
class Preset:
    """A timm architecture with overrides, sized for a purpose."""

    model: str
    overrides: dict[str, Any] = field(default_factory=dict)
    # Preprocessing that differs from the architecture's pretrained config (timm's
    # `pretrained_cfg_overlay`): it travels into the exported model's metadata.
    data_overlay: dict[str, Any] = field(default_factory=dict)
    description: str = ""


PRESETS: dict[str, Preset] = {
    # 32 px digits-sized inputs, 8x8 = 64 patches of 4 px, 4 heads of 32 channels.
    "tiny": Preset(
        "vit_tiny_patch16_224",
        dict(img_size=32, patch_size=4, embed_dim=128, depth=4, num_heads=4, mlp_ratio=2.0),
        {"input_size": (3, 32, 32), "crop_pct": 1.0},
        "32 px, patch 4, dim 128, depth 4, 4 heads (~0.55 M parameters): tests and the demo",
    ),
    # 64 px photos, 8x8 patches of 8 px, ViT-Tiny width (3 heads of 64), 6 blocks.
    "small": Preset(
        "vit_tiny_patch16_224",
        dict(img_size=64, patch_size=8, embed_dim=192, depth=6, num_heads=3),
        {"input_size": (3, 64, 64), "crop_pct": 1.0},
        "64 px, patch 8, dim 192, depth 6, 3 heads (~2.7 M parameters): CPU fine-tuning",
    ),
}


def vit_names() -> list[str]:
    """Every timm ViT architecture name (the `vit_*` family)."""
    return timm.list_models("vit_*")


def backbone_listing() -> str:
    """`fit --list-backbones`: the presets with what they are, then timm's ViT names."""
    names = vit_names()
    width = max(len(name) for name in PRESETS)
    lines = ["presets (--preset NAME; random initialisation, sized for CPUs):"]
    lines += [f"  {name:<{width}}  {preset.description}" for name, preset in PRESETS.items()]
    lines.append(
        f"timm ViTs ({len(names)}; --backbone NAME, pretrained weights by --pretrained PATH):"
    )
    lines += [f"  {name}" for name in names]
    return "\n".join(lines)


def resolve_backbone(name: str) -> Preset:
    """A preset name or a timm ViT name -> Preset; unknown names raise BackboneError."""
    if name in PRESETS:
        return PRESETS[name]
    names = vit_names()
    if name in names:
        return Preset(name)
    close = difflib.get_close_matches(name, [*PRESETS, *names], n=5, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise BackboneError(
        f"unknown backbone {name!r}. Valid: a preset ({', '.join(PRESETS)}) or one of the "
        f"{len(names)} timm ViTs (`vitrieval-train fit --list-backbones` prints them).{hint}"
    )


def create_backbone(name: str, pretrained: str | None = None, **overrides: Any) -> nn.Module:
    """Create a ViT that returns tokens, optionally loading weights.

    `pretrained` is a path to a safetensors file or a torch state dict, or the word
    `timm` for timm's hub weights (needs a network).
    """
    preset = resolve_backbone(name)
    kwargs = {**preset.overrides, **overrides, "num_classes": 0, "global_pool": ""}
    if preset.data_overlay:
        kwargs["pretrained_cfg_overlay"] = preset.data_overlay
    hub = _offline_unless_reachable() if pretrained == "timm" else contextlib.nullcontext()
    try:
        with hub as offline:
            model = timm.create_model(preset.model, pretrained=pretrained == "timm", **kwargs)
    except (RuntimeError, OSError, ValueError) as exc:
        if pretrained == "timm":
            why = f"{offline}, and they are not in the local cache" if offline else str(exc)
            why = " ".join(why.split())  # one line: hub errors span several
            raise BackboneError(
                f"cannot fetch timm hub weights for {preset.model} ({why}); "
                "pass --pretrained PATH with a local weights file instead"
            ) from None
        raise
    if not hasattr(model, "num_prefix_tokens") or not hasattr(model, "forward_features"):
        raise BackboneError(f"{name!r} is not a token-producing vision transformer")
    if pretrained and pretrained != "timm":
        load_backbone_weights(model, pretrained)
    return model


def _hub_address() -> tuple[str, int]:
    """(host, port) a hub download connects to first: the HTTPS proxy when one is set."""
    from urllib.parse import urlsplit

    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    endpoint = urlsplit(proxy or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    default = 443 if endpoint.scheme == "https" else 80
    return endpoint.hostname or "huggingface.co", endpoint.port or default


@contextlib.contextmanager
def _offline_unless_reachable() -> Iterator[str]:
    """Within the block, timm's hub client stays in offline mode (the local cache only,
    failing at once) unless the hub answers within `HUB_PROBE_SECONDS`. Yields why it
    is offline ("" when online)."""
    import huggingface_hub.constants as hub_constants

    if hub_constants.HF_HUB_OFFLINE:
        yield "HF_HUB_OFFLINE is set"
        return
    host, port = _hub_address()
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS).close()
    except OSError:
        pass
    else:
        yield ""
        return
    # the client reads this module attribute on every request (is_offline_mode())
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield f"no network: {host}:{port} did not answer within {HUB_PROBE_SECONDS:g} s"
    finally:
        hub_constants.HF_HUB_OFFLINE = False


_STRIP_PREFIXES = ("module.", "backbone.", "encoder.", "model.")


def load_backbone_weights(model: nn.Module, path: str | Path) -> None:
    """Load backbone weights from safetensors or a state dict saved with torch.save.

    Accepts a bare timm state dict, a vitrieval checkpoint (keys under `backbone.`),
    and the common wrappers (`module.`, `model.`, a {"state_dict"/"model": ...} dict).
    Classifier-head keys are ignored; any other mismatch is an error that lists keys.
    """
    path = Path(path)
    if not path.is_file():
        raise BackboneError(f"pretrained weights not found: {path}")
    state = _read_state_dict(path)
    if any(k.startswith("backbone.") for k in state):
        state = {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.")}
    cleaned: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        for prefix in _STRIP_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
        if key.startswith(("head.", "fc_norm.")) and key not in model.state_dict():
            continue
        cleaned[key] = value
    own = model.state_dict()
    missing = sorted(set(own) - set(cleaned))
    unexpected = sorted(set(cleaned) - set(own))
    mismatched = sorted(k for k in set(own) & set(cleaned) if own[k].shape != cleaned[k].shape)
    if missing or unexpected or mismatched:
        parts = []
        for label, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("wrong shape", mismatched),
        ):
            if keys:
                parts.append(f"{label}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}")
        raise BackboneError(f"weights in {path} do not fit the backbone ({'; '.join(parts)})")
    model.load_state_dict(cleaned)


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types for bad files
            raise BackboneError(f"cannot read weights from {path}: {exc}") from None
    try:
        # weights_only: a checkpoint file must not be able to run code.
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise BackboneError(f"cannot read weights from {path}: {exc}") from None
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise BackboneError(f"{path} does not hold a state dict of tensors")
    return obj
