"""Losses by name: the values of `--loss`.

A factory takes `(embedding_dim, num_classes, **options)` and returns a MetricLoss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import MetricLoss

LossFactory = Callable[..., MetricLoss]
_REGISTRY: dict[str, LossFactory] = {}


class UnknownLossError(ValueError):
    """Raised for a `--loss` name that is not registered; lists the valid names."""


def register_loss(name: str) -> Callable[[LossFactory], LossFactory]:
    def wrap(factory: LossFactory) -> LossFactory:
        if name in _REGISTRY:
            raise ValueError(f"loss {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return wrap


def loss_names() -> list[str]:
    return sorted(_REGISTRY)


def create_loss(name: str, embedding_dim: int, num_classes: int, **options: Any) -> MetricLoss:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UnknownLossError(
            f"unknown loss {name!r}; valid names: {', '.join(loss_names())}"
        ) from None
    return factory(embedding_dim, num_classes, **options)
