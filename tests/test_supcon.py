"""SupConLoss (LaCViT's label-aware contrastive loss) against hand values and a naive loop."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vitrieval.training.losses.supcon import SupConLoss, create_supcon


def unit_vectors(degrees: list[float], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    rad = [math.radians(d) for d in degrees]
    return torch.tensor([[math.cos(r), math.sin(r)] for r in rad], dtype=dtype)


def naive_supcon(z: torch.Tensor, labels: torch.Tensor, tau: float) -> float:
    """L_out by a double loop over anchors and positives, straight from the equation."""
    z = z.double()
    n = z.shape[0]
    terms = []
    for i in range(n):
        positives = [p for p in range(n) if p != i and int(labels[p]) == int(labels[i])]
        if not positives:
            continue
        denom = sum(math.exp(float(z[i] @ z[a]) / tau) for a in range(n) if a != i)
        inner = 0.0
        for p in positives:
            inner += math.log(math.exp(float(z[i] @ z[p]) / tau) / denom)
        terms.append(-inner / len(positives))
    return sum(terms) / len(terms)


# Hand computation for unit vectors at 0, 30, 90, 120 degrees, labels [0, 0, 1, 1].
# Cosines are cos(angle difference):
#   anchor   0: +30 -> sqrt3/2 (positive),  90 -> 0,     120 -> -1/2
#   anchor  30:   0 -> sqrt3/2 (positive),  90 -> 1/2,   120 -> 0
#   anchor  90: 120 -> sqrt3/2 (positive),  30 -> 1/2,     0 -> 0      (mirror of 30)
#   anchor 120:  90 -> sqrt3/2 (positive),  30 -> 0,       0 -> -1/2   (mirror of 0)
# Each anchor has one positive, so its term is -log(exp(s_p/tau) / sum_a exp(s_a/tau)):
#   l_0  = log(1 + exp(-sqrt3/(2 tau)) + exp(-(1 + sqrt3)/(2 tau)))
#   l_30 = log(1 + exp((1 - sqrt3)/(2 tau)) + exp(-sqrt3/(2 tau)))
#   L    = (2 l_0 + 2 l_30) / 4 = (l_0 + l_30) / 2
# tau = 0.1: l_0 = 0.00017449, l_30 = 0.02556961 -> L = 0.0128721
# tau = 1:   l_0 = 0.51625424, l_30 = 0.74863165 -> L = 0.632443
def closed_form(tau: float) -> float:
    s3 = math.sqrt(3.0)
    l0 = math.log(1 + math.exp(-s3 / (2 * tau)) + math.exp(-(1 + s3) / (2 * tau)))
    l30 = math.log(1 + math.exp((1 - s3) / (2 * tau)) + math.exp(-s3 / (2 * tau)))
    return (l0 + l30) / 2


@pytest.mark.parametrize(("tau", "expected"), [(0.1, 0.0128721), (1.0, 0.632443)])
def test_hand_computation(tau, expected):
    z = unit_vectors([0, 30, 90, 120])
    labels = torch.tensor([0, 0, 1, 1])
    value = SupConLoss(temperature=tau)(z, labels).item()
    assert value == pytest.approx(expected, abs=1e-6)
    assert value == pytest.approx(closed_form(tau), abs=1e-12)


@pytest.mark.parametrize("tau", [0.05, 0.1, 0.3, 1.0, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_naive_loop(tau, seed):
    g = torch.Generator().manual_seed(seed)
    z = F.normalize(torch.randn(10, 6, generator=g, dtype=torch.float64), dim=1)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 2])[torch.randperm(10, generator=g)]
    value = SupConLoss(temperature=tau)(z, labels).item()
    assert value == pytest.approx(naive_supcon(z, labels, tau), abs=1e-6)


def test_anchor_without_positive_is_excluded_but_is_a_negative():
    g = torch.Generator().manual_seed(3)
    z = F.normalize(torch.randn(7, 5, generator=g, dtype=torch.float64), dim=1)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 3])  # labels 2 and 3 have no positive
    value = SupConLoss(temperature=0.2)(z, labels).item()
    assert value == pytest.approx(naive_supcon(z, labels, 0.2), abs=1e-9)
    # Dropping the singletons changes the loss: they were in the denominators.
    without = SupConLoss(temperature=0.2)(z[:5], labels[:5]).item()
    assert abs(value - without) > 1e-6


@pytest.mark.parametrize("labels", [torch.tensor([0, 1, 2, 3]), torch.tensor([5])])
def test_no_positive_at_all_gives_zero_with_graph(labels):
    x = torch.randn(labels.shape[0], 4, requires_grad=True)
    loss = SupConLoss()(x, labels)
    assert loss.dim() == 0 and loss.item() == 0.0
    assert loss.grad_fn is not None
    loss.backward()
    assert x.grad is not None and torch.equal(x.grad, torch.zeros_like(x))


def test_returns_scalar_and_gradients_flow():
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    loss = SupConLoss(temperature=0.1)(x, labels)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.item() > 0
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_gradients_match_naive_autograd():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 0, 1, 1, 1, 2])
    SupConLoss(temperature=0.5)(x, labels).backward()
    fast = x.grad.clone()
    x.grad = None
    z = F.normalize(x, dim=1)
    terms = []
    for i in range(6):
        pos = [p for p in range(6) if p != i and labels[p] == labels[i]]
        if not pos:
            continue
        others = torch.stack([z[i] @ z[a] / 0.5 for a in range(6) if a != i])
        lse = torch.logsumexp(others, 0)
        terms.append(-torch.stack([z[i] @ z[p] / 0.5 - lse for p in pos]).mean())
    torch.stack(terms).mean().backward()
    torch.testing.assert_close(fast, x.grad, rtol=1e-9, atol=1e-12)


def test_stable_at_small_temperature():
    torch.manual_seed(1)
    x = torch.randn(16, 8, requires_grad=True)
    labels = torch.arange(16) % 4
    loss = SupConLoss(temperature=1e-3)(x, labels)  # logits up to 1000: exp would overflow
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


def test_inputs_are_normalised_and_half_precision_is_upcast():
    torch.manual_seed(2)
    z = F.normalize(torch.randn(6, 4), dim=1)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    ref = SupConLoss()(z, labels)
    assert SupConLoss()(z * 3.7, labels).item() == pytest.approx(ref.item(), rel=1e-5)
    half = SupConLoss()(z.to(torch.bfloat16), labels)
    assert half.dtype == torch.float32
    assert half.item() == pytest.approx(ref.item(), rel=5e-2)


def test_invariant_to_batch_order():
    torch.manual_seed(5)
    z = F.normalize(torch.randn(9, 4, dtype=torch.float64), dim=1)
    labels = torch.tensor([0, 1, 2] * 3)
    perm = torch.randperm(9)
    a = SupConLoss(0.3)(z, labels).item()
    assert SupConLoss(0.3)(z[perm], labels[perm]).item() == pytest.approx(a, abs=1e-12)


@pytest.mark.parametrize(
    ("embeddings", "labels", "message"),
    [
        (torch.randn(4), torch.tensor([0, 1, 0, 1]), r"\(N, D\)"),
        (torch.randn(2, 4, 3), torch.tensor([0, 1]), r"\(N, D\)"),
        (torch.randn(4, 3), torch.tensor([0, 1, 0]), "labels must be"),
        (torch.randn(4, 3), torch.tensor([[0, 1, 0, 1]]), "labels must be"),
        (torch.randn(4, 3), torch.tensor([0.0, 1.0, 0.0, 1.0]), "integers"),
        (torch.arange(12).reshape(4, 3), torch.tensor([0, 1, 0, 1]), "floating point"),
    ],
)
def test_shape_and_dtype_checks(embeddings, labels, message):
    with pytest.raises(ValueError, match=message):
        SupConLoss()(embeddings, labels)


@pytest.mark.parametrize("tau", [0.0, -0.1, float("nan")])
def test_bad_temperature(tau):
    with pytest.raises(ValueError, match="temperature"):
        SupConLoss(temperature=tau)


def test_has_no_parameters_and_factory():
    assert list(SupConLoss().parameters()) == []
    loss = create_supcon(128, 10, temperature=0.2)
    assert isinstance(loss, SupConLoss) and loss.temperature == 0.2
    assert create_supcon(128, 10).temperature == 0.1
