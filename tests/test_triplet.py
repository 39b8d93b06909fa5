"""Triplet margin loss: hand computations, a naive triple-loop reference, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from vitrieval.training.losses.triplet import MINING, TripletMarginLoss, create_triplet

S3 = math.sqrt(3)


def unit(*degrees: float) -> torch.Tensor:
    return torch.tensor([[math.cos(math.radians(a)), math.sin(math.radians(a))] for a in degrees])


# Hand example: x0 at 0 deg and x1 at 60 deg (class 0), x2 at 90 deg and x3 at 240 deg
# (class 1); margin 0.3. Cosine distances d = 1 - cos(angle between):
#   d01 = 1 - cos 60 = 0.5          d02 = 1 - cos 90 = 1          d03 = 1 - cos 240 = 1.5
#   d12 = 1 - cos 30 = 1 - s3/2     d13 = 1 - cos 180 = 2         d23 = 1 - cos 150 = 1 + s3/2
# (s3 = sqrt 3; 1 - s3/2 = 0.1340, 1 + s3/2 = 1.8660). The 8 triplets, l = d_ap - d_an + 0.3:
#   a0 p1: n2 0.5 - 1 + 0.3 < 0 -> 0;            n3 0.5 - 1.5 + 0.3 < 0 -> 0
#   a1 p0: n2 0.5 - (1 - s3/2) + 0.3 = s3/2 - 0.2 = 0.6660;    n3 0.5 - 2 + 0.3 < 0 -> 0
#   a2 p3: n0 (1 + s3/2) - 1 + 0.3 = s3/2 + 0.3 = 1.1660;      n1 s3 + 0.3 = 2.0321
#   a3 p2: n0 (1 + s3/2) - 1.5 + 0.3 = s3/2 - 0.2 = 0.6660;    n1 (1 + s3/2) - 2 + 0.3 = 0.1660
X = unit(0, 60, 90, 240)
Y = torch.tensor([0, 0, 1, 1])
M = 0.3


def test_batch_hard_by_hand():
    # a0: hardest p d01 = 0.5, hardest n d02 = 1        -> 0
    # a1: hardest p 0.5, hardest n d12 = 1 - s3/2        -> s3/2 - 0.2
    # a2: hardest p d23 = 1 + s3/2, hardest n d12        -> s3 + 0.3
    # a3: hardest p d23, hardest n d03 = 1.5             -> s3/2 - 0.2
    # mean over 4 anchors: (2 s3 - 0.1) / 4 = 0.841025
    expected = (2 * S3 - 0.1) / 4
    loss = TripletMarginLoss(margin=M, mining="batch_hard")(X, Y)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.841025, abs=1e-6)


def test_semi_hard_by_hand():
    # band d_ap < d_an < d_ap + 0.3 per (a, p) pair:
    # (0,1): band (0.5, 0.8), negatives 1, 1.5: none -> hardest 1 -> 0
    # (1,0): band (0.5, 0.8), negatives 0.134, 2: none -> hardest 0.134 -> s3/2 - 0.2
    # (2,3): band (1.866, 2.166), negatives 1, 0.134: none -> hardest 0.134 -> s3 + 0.3
    # (3,2): band (1.866, 2.166), negatives 1.5, 2: d13 = 2 in band -> s3/2 - 0.7 = 0.1660
    #        (batch-hard would take 1.5 here)
    # mean over 4 pairs: (2 s3 - 0.6) / 4 = 0.716025
    expected = (2 * S3 - 0.6) / 4
    loss = TripletMarginLoss(margin=M, mining="semi_hard")(X, Y)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.716025, abs=1e-6)


def test_all_by_hand():
    # 5 active triplets: (s3/2 - 0.2) + (s3/2 + 0.3) + (s3 + 0.3) + (s3/2 - 0.2) + (s3/2 - 0.7)
    # = 3 s3 - 0.5; mean over the active ones: (3 s3 - 0.5) / 5 = 0.939230
    # (not over all 8 valid triplets, which would give 0.587019)
    expected = (3 * S3 - 0.5) / 5
    loss = TripletMarginLoss(margin=M, mining="all")(X, Y)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.939230, abs=1e-6)


def test_norm_and_label_values_do_not_matter():
    scaled = X * torch.tensor([[3.0], [0.2], [5.0], [1.7]])
    for mining in MINING:
        loss = TripletMarginLoss(margin=M, mining=mining)
        assert loss(scaled, Y * 7 + 3).item() == pytest.approx(loss(X, Y).item(), abs=1e-6)


def reference(x: torch.Tensor, y: torch.Tensor, margin: float, mining: str, distance: str):
    """Naive triple loop, straight from the definitions in the module docstring."""
    x = torch.nn.functional.normalize(x.double(), dim=1)
    n = len(y)

    def d(i: int, j: int) -> float:
        if distance == "cosine":
            return 1.0 - float(x[i] @ x[j])
        return float((x[i] - x[j]).norm())

    losses = []
    for a in range(n):
        pos = [p for p in range(n) if p != a and y[p] == y[a]]
        neg = [k for k in range(n) if y[k] != y[a]]
        if not pos or not neg:
            continue
        if mining == "batch_hard":
            hp, hn = max(d(a, p) for p in pos), min(d(a, k) for k in neg)
            losses.append(max(0.0, hp - hn + margin))
            continue
        for p in pos:
            dap = d(a, p)
            if mining == "semi_hard":
                band = [d(a, k) for k in neg if dap < d(a, k) < dap + margin]
                dan = min(band) if band else min(d(a, k) for k in neg)
                losses.append(max(0.0, dap - dan + margin))
            else:
                for k in neg:
                    losses.append(max(0.0, dap - d(a, k) + margin))
    if mining == "all":
        active = [v for v in losses if v > 0]
        return sum(active) / max(1, len(active))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("mining", MINING)
@pytest.mark.parametrize("distance", ["cosine", "euclidean"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_naive_reference(mining, distance, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=g)
    loss = TripletMarginLoss(margin=0.2, mining=mining, distance=distance)
    # The module works in float32, the reference in float64 on the same float32 inputs.
    got = loss(x.float(), y).item()
    want = reference(x.float(), y, 0.2, mining, distance)
    assert want > 0
    assert got == pytest.approx(want, abs=1e-6)


def test_margin_effect():
    # batch_hard at margin 0.1: a0 0; a1 s3/2 - 0.4; a2 s3 + 0.1; a3 s3/2 - 0.4
    # mean (2 s3 - 0.7) / 4 = 0.691025
    loss_01 = TripletMarginLoss(margin=0.1)(X, Y).item()
    assert loss_01 == pytest.approx((2 * S3 - 0.7) / 4, abs=1e-6)
    values = [TripletMarginLoss(margin=m)(X, Y).item() for m in (0.0, 0.1, 0.3, 1.0)]
    assert values == sorted(values) and values[0] < values[-1]
    # Two tight, far apart clusters: no triplet violates a small margin, a large one does.
    separated = unit(0, 10, 180, 190)
    for mining in MINING:
        assert TripletMarginLoss(0.1, mining)(separated, Y).item() == 0.0
        assert TripletMarginLoss(2.5, mining)(separated, Y).item() > 0.0


@pytest.mark.parametrize("mining", MINING)
@pytest.mark.parametrize("distance", ["cosine", "euclidean"])
def test_gradients_flow(mining, distance):
    x = X.clone().requires_grad_(True)
    TripletMarginLoss(margin=M, mining=mining, distance=distance)(x, Y).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_duplicate_embeddings_give_finite_euclidean_gradients():
    x = unit(0, 0, 30, 30).requires_grad_(True)
    TripletMarginLoss(margin=0.5, distance="euclidean")(x, Y).backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("mining", MINING)
@pytest.mark.parametrize("labels", [[0, 0, 0, 0], [0, 1, 2, 3]])
def test_no_valid_triplet_returns_zero_with_grad(mining, labels):
    x = torch.randn(4, 3, requires_grad=True)
    loss = TripletMarginLoss(mining=mining)(x, torch.tensor(labels))
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert x.grad is not None and (x.grad == 0).all()


def test_has_no_parameters_and_factory():
    loss = create_triplet(128, 10, margin=0.2, mining="semi_hard")
    assert isinstance(loss, TripletMarginLoss)
    assert (loss.margin, loss.mining, loss.distance) == (0.2, "semi_hard", "cosine")
    assert list(loss.parameters()) == []
    assert create_triplet(8, 2).mining == "batch_hard" and create_triplet(8, 2).margin == 0.1


def test_errors():
    with pytest.raises(ValueError, match="all, batch_hard, semi_hard"):
        TripletMarginLoss(mining="hardest")
    with pytest.raises(ValueError, match="cosine, euclidean"):
        TripletMarginLoss(distance="manhattan")
    with pytest.raises(ValueError, match="margin"):
        TripletMarginLoss(margin=-0.1)
    with pytest.raises(ValueError, match="labels must be"):
        TripletMarginLoss()(X, torch.tensor([0, 1, 0]))
