"""Poolings against hand computations and naive references."""

from __future__ import annotations

import pytest
import torch

from vitrieval.training.pooling import (
    AvgPooling,
    ClsPooling,
    GeM,
    GGeM,
    MaxPooling,
    UnknownPoolingError,
    create_pooling,
    pooling_names,
)


def naive_ggem(x: torch.Tensor, p: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Eq. 4 channel by channel in float64: group of channel d is d // (D / G)."""
    batch, tokens, dim = x.shape
    per_group = dim // len(p)
    out = torch.empty(batch, dim, dtype=torch.float64)
    for b in range(batch):
        for d in range(dim):
            pd = float(p[d // per_group])
            values = x[b, :, d].double().clamp(min=eps)
            out[b, d] = (values.pow(pd).sum() / tokens) ** (1.0 / pd)
    return out


def test_ggem_hand_computation():
    # Group 1 = channels 0, 1 with p = 1: means (1+3)/2 = 2 and (2+4)/2 = 3.
    # Group 2 = channels 2, 3 with p = 2: sqrt((9+1)/2) = sqrt(5), sqrt((16+eps^2)/2) = sqrt(8).
    pool = GGeM(groups=2, p=3.0)
    with torch.no_grad():
        pool.p.copy_(torch.tensor([1.0, 2.0]))
    tokens = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 1.0, 0.0]]])
    out = pool(tokens)
    assert out.shape == (1, 4)
    torch.testing.assert_close(
        out, torch.tensor([[2.0, 3.0, 2.2360680, 2.8284271]]), atol=1e-6, rtol=0
    )


def test_ggem_parameter_named_p_with_one_entry_per_group():
    pool = GGeM(groups=2, p=3.0)
    params = dict(pool.named_parameters())
    assert list(params) == ["p"]
    assert params["p"].shape == (2,)
    assert torch.equal(params["p"].detach(), torch.tensor([3.0, 3.0]))


def test_ggem_groups_are_contiguous_not_strided():
    # Channels 0-1 get p=1 (mean) and 2-3 get p=8 (near max); a strided grouping would
    # pair channel 0 with 2 instead.
    pool = GGeM(groups=2)
    with torch.no_grad():
        pool.p.copy_(torch.tensor([1.0, 8.0]))
    x = torch.tensor([[[1.0, 1.0, 1.0, 1.0], [5.0, 5.0, 5.0, 5.0]]])
    out = pool(x)[0].detach().tolist()
    assert out[0] == pytest.approx(3.0) and out[1] == pytest.approx(3.0)
    expected_p8 = ((1 + 5**8) / 2) ** (1 / 8)
    assert out[2] == pytest.approx(expected_p8, rel=1e-5) and out[3] == pytest.approx(
        expected_p8, rel=1e-5
    )


def test_ggem_matches_naive_reference_on_random_tokens():
    torch.manual_seed(0)
    x = torch.randn(3, 10, 12) * 2  # negative values exercise the clamp
    pool = GGeM(groups=4)
    with torch.no_grad():
        pool.p.copy_(torch.tensor([1.0, 2.5, 3.0, 6.0]))
    torch.testing.assert_close(
        pool(x).double(), naive_ggem(x, pool.p.detach()), atol=1e-5, rtol=1e-5
    )


def test_ggem_p_receives_gradients():
    pool = GGeM(groups=2)
    x = torch.rand(2, 5, 6) + 0.1
    pool(x).sum().backward()
    assert pool.p.grad is not None
    assert pool.p.grad.shape == (2,)
    assert torch.all(pool.p.grad.abs() > 0)


def test_ggem_one_group_p_one_is_the_mean():
    x = torch.rand(4, 9, 8) + 0.01  # positive, so the eps clamp does not interfere
    pool = GGeM(groups=1, p=1.0, learn_p=False)
    torch.testing.assert_close(pool(x), x.mean(dim=1), atol=1e-6, rtol=1e-6)
    assert not pool.p.requires_grad


def test_ggem_one_group_is_gem():
    x = torch.rand(2, 7, 6) * 3
    gem, ggem = GeM(p=3.0), GGeM(groups=1, p=3.0)
    torch.testing.assert_close(gem(x), ggem(x))
    torch.testing.assert_close(
        gem(x).double(), naive_ggem(x, torch.tensor([3.0])), atol=1e-5, rtol=1e-5
    )


def test_ggem_large_power_does_not_overflow_in_half_precision():
    # 300^5 = 2.4e12 overflows fp16 (max 65504) if the power is taken naively.
    x = torch.full((1, 4, 4), 300.0, dtype=torch.float16)
    pool = GGeM(groups=2, p=5.0)
    out = pool(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.full((1, 4), 300.0), atol=0.5, rtol=1e-3)


def test_ggem_rejects_indivisible_width():
    with pytest.raises(ValueError, match="cannot be split"):
        GGeM(groups=3)(torch.rand(1, 2, 8))


def test_prefix_tokens_are_removed_before_pooling():
    x = torch.rand(2, 5, 4)
    x[:, 0] = 100.0  # a class token that must not leak into the patch poolings
    torch.testing.assert_close(AvgPooling()(x, 1), x[:, 1:].mean(1))
    torch.testing.assert_close(MaxPooling()(x, 1), x[:, 1:].amax(1))
    torch.testing.assert_close(ClsPooling()(x, 1), x[:, 0])
    assert (GGeM(groups=2)(x, 1) < 100).all()


def test_cls_pooling_needs_a_class_token():
    with pytest.raises(ValueError, match="class token"):
        ClsPooling()(torch.rand(1, 4, 4), 0)


def test_registry_names_and_unknown_name_lists_valid_ones():
    assert {"cls", "avg", "max", "gem", "ggem"} <= set(pooling_names())
    with pytest.raises(UnknownPoolingError) as info:
        create_pooling("gemm", 8, 2)
    for name in ("avg", "cls", "gem", "ggem", "max"):
        assert name in str(info.value)


def test_registry_ggem_defaults_to_one_group_per_head():
    pool, out_dim = create_pooling("ggem", in_dim=12, num_heads=3)
    assert isinstance(pool, GGeM) and pool.groups == 3 and out_dim == 12
    pool, _ = create_pooling("ggem", in_dim=12, num_heads=3, groups=6, p=2.0)
    assert pool.groups == 6 and torch.equal(pool.p.detach(), torch.full((6,), 2.0))
