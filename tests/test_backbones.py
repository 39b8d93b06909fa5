"""Backbone presets, name errors, and local pretrained weights round-tripping."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from vitrieval.training.backbones import PRESETS, BackboneError, create_backbone, resolve_backbone
from vitrieval.training.model import build_model, weights_fingerprint


def test_tiny_preset_shape_and_size():
    net = create_backbone("tiny")
    tokens = net.forward_features(torch.zeros(2, 3, 32, 32))
    assert tokens.shape == (2, 1 + 64, 128)  # class token + 8x8 patches
    assert net.num_prefix_tokens == 1
    assert sum(p.numel() for p in net.parameters()) < 1_000_000


def test_any_timm_vit_by_name():
    net = create_backbone("vit_small_patch16_224", img_size=32, patch_size=16, depth=1)
    assert net.forward_features(torch.zeros(1, 3, 32, 32)).shape == (1, 1 + 4, 384)


def test_unknown_backbone_lists_presets_and_suggests():
    with pytest.raises(BackboneError) as info:
        resolve_backbone("vit_smal_patch16_224")
    message = str(info.value)
    for preset in PRESETS:
        assert preset in message
    assert "vit_small_patch16_224" in message
    assert "--list-backbones" in message


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "torch_wrapped"])
def test_pretrained_weights_round_trip(tmp_path, fmt):
    torch.manual_seed(1)
    source = create_backbone("tiny")
    state = source.state_dict()
    path = tmp_path / ("w.safetensors" if fmt == "safetensors" else "w.pt")
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    elif fmt == "torch":
        torch.save(state, path)
    else:  # a training framework's wrapper: {"model": {"module.<key>": ...}}
        torch.save({"model": {f"module.{k}": v for k, v in state.items()}}, path)
    torch.manual_seed(2)
    loaded = create_backbone("tiny", pretrained=str(path))
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(loaded.forward_features(x), source.forward_features(x))


def test_vitrieval_checkpoint_loads_as_pretrained(tmp_path):
    model = build_model("tiny", "ggem")
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "m.safetensors")
    )
    again = build_model("tiny", "avg", pretrained=str(tmp_path / "m.safetensors"))
    assert weights_fingerprint(again.backbone) == weights_fingerprint(model.backbone)


def test_pretrained_errors(tmp_path):
    with pytest.raises(BackboneError, match="not found"):
        create_backbone("tiny", pretrained=str(tmp_path / "missing.safetensors"))
    other = create_backbone("small").state_dict()
    save_file({k: v.contiguous() for k, v in other.items()}, str(tmp_path / "small.safetensors"))
    with pytest.raises(BackboneError, match="wrong shape"):
        create_backbone("tiny", pretrained=str(tmp_path / "small.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    with pytest.raises(BackboneError, match="cannot read"):
        create_backbone("tiny", pretrained=str(tmp_path / "junk.safetensors"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(BackboneError, match="cannot read"):
        create_backbone("tiny", pretrained=str(tmp_path / "junk.pt"))


def test_fingerprint_changes_with_weights():
    model = build_model("tiny", "ggem")
    before = weights_fingerprint(model)
    assert before == weights_fingerprint(model)
    with torch.no_grad():
        model.pool.p[0] += 1e-3
    assert weights_fingerprint(model) != before
