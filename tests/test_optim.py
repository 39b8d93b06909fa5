"""Layer-wise decay groups and the warm-up + cosine schedule."""

from __future__ import annotations

import math

import pytest

from vitrieval.training.losses import NormSoftmaxLoss
from vitrieval.training.model import build_model
from vitrieval.training.optim import layer_id, lr_at, param_groups


def test_layer_ids():
    assert layer_id("backbone.pos_embed", 4) == 0
    assert layer_id("backbone.cls_token", 4) == 0
    assert layer_id("backbone.patch_embed.proj.weight", 4) == 0
    assert layer_id("backbone.blocks.0.attn.qkv.weight", 4) == 1
    assert layer_id("backbone.blocks.3.mlp.fc2.bias", 4) == 4
    assert layer_id("backbone.norm.weight", 4) == 5
    assert layer_id("pool.p", 4) == 5


def test_param_groups_scales_and_weight_decay():
    model = build_model("tiny", "ggem")
    loss = NormSoftmaxLoss(model.embedding_dim, 3)
    groups = param_groups(model, loss, weight_decay=0.05, layer_decay=0.5, proxy_lr_scale=100.0)
    by_name = {g["name"]: g for g in groups}
    assert by_name["layer0"]["lr_scale"] == pytest.approx(0.5**5)  # patch embedding: 4 blocks + 1
    assert by_name["layer5_no_decay"]["lr_scale"] == 1.0  # final norm and pooling exponent
    assert by_name["proxies"]["lr_scale"] == 100.0 and by_name["proxies"]["weight_decay"] == 0.0
    no_decay = {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert id(model.pool.p) in no_decay
    assert id(model.backbone.pos_embed) in no_decay
    assert id(model.backbone.blocks[0].attn.qkv.weight) not in no_decay
    # every trainable parameter lands in exactly one group
    counted = [id(p) for g in groups for p in g["params"]]
    assert len(counted) == len(set(counted)) == sum(1 for _ in model.parameters()) + 1


def test_schedule_warmup_then_cosine():
    peak, total, warm = 1.0, 100, 10
    assert lr_at(0, total, warm, peak, 0.0) == pytest.approx(0.1)
    assert lr_at(9, total, warm, peak, 0.0) == pytest.approx(1.0)
    assert lr_at(10, total, warm, peak, 0.0) == pytest.approx(1.0)
    mid = 10 + 45
    assert lr_at(mid, total, warm, peak, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, total, warm, peak, 0.01) == pytest.approx(0.01)
