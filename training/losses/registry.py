"""Losses by name: the values of `--loss`.

A factory takes `(embedding_dim, num_classes, **options)` and returns a MetricLoss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..registry import Registry, UnknownNameError
from .base import MetricLoss

LossFactory = Callable[..., MetricLoss]


class UnknownLossError(UnknownNameError):
    """Raised for a `--loss` name that is not registered; lists the valid names."""


LOSSES: Registry[LossFactory] = Registry("loss", UnknownLossError)
register_loss = LOSSES.register
loss_names = LOSSES.names


def create_loss(name: str, embedding_dim: int, num_classes: int, **options: Any) -> MetricLoss:
    return LOSSES.get(name)(embedding_dim, num_classes, **options)
