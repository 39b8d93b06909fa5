"""Norm-softmax against a hand computation, and the shared shape checks."""

from __future__ import annotations

import math

import pytest
import torch

from vitrieval.training.losses import NormSoftmaxLoss, UnknownLossError, create_loss, loss_names


def test_norm_softmax_hand_computation():
    # Two proxies on the axes; one embedding at 60 degrees with label 0.
    # cosines: cos 60 = 0.5 (own class), cos 30 = sqrt(3)/2; tau = 0.5 -> logits 1, sqrt(3).
    loss = NormSoftmaxLoss(embedding_dim=2, num_classes=2, temperature=0.5)
    with torch.no_grad():
        loss.proxies.copy_(torch.tensor([[3.0, 0.0], [0.0, 0.2]]))  # norms must not matter
    x = torch.tensor([[0.5, math.sqrt(3) / 2]]) * 7.0
    a, b = 1.0, math.sqrt(3)
    expected = -math.log(math.exp(a) / (math.exp(a) + math.exp(b)))
    assert loss(x, torch.tensor([0])).item() == pytest.approx(expected, rel=1e-6)


def test_norm_softmax_mean_over_batch_matches_loop():
    torch.manual_seed(0)
    loss = NormSoftmaxLoss(8, 5, temperature=0.1)
    x, y = torch.randn(6, 8), torch.tensor([0, 1, 2, 3, 4, 0])
    w = torch.nn.functional.normalize(loss.proxies.detach(), dim=1)
    per_item = []
    for i in range(6):
        logits = (torch.nn.functional.normalize(x[i], dim=0) @ w.t()) / 0.1
        per_item.append(-torch.log_softmax(logits, 0)[y[i]])
    assert loss(x, y).item() == pytest.approx(torch.stack(per_item).mean().item(), rel=1e-5)


def test_proxies_get_gradients():
    loss = NormSoftmaxLoss(4, 3)
    loss(torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])).backward()
    assert loss.proxies.grad is not None and loss.proxies.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("embeddings", "labels", "message"),
    [
        (torch.randn(4), torch.tensor([0, 1, 0, 1]), r"\(N, D\)"),
        (torch.randn(4, 3), torch.tensor([0, 1, 0]), "labels must be"),
        (torch.randn(4, 3), torch.tensor([0.0, 1.0, 0.0, 1.0]), "integers"),
        (torch.randn(2, 3), torch.tensor([0, 7]), "lie in"),
    ],
)
def test_shape_and_label_checks(embeddings, labels, message):
    with pytest.raises(ValueError, match=message):
        NormSoftmaxLoss(3, 2)(embeddings, labels)


def test_registry():
    assert "norm_softmax" in loss_names()
    assert isinstance(create_loss("norm_softmax", 4, 3, temperature=0.2), NormSoftmaxLoss)
    with pytest.raises(UnknownLossError, match="norm_softmax"):
        create_loss("arcface2", 4, 3)
