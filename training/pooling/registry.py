"""Poolings by name: the values of `--pool`.

Each entry is a factory `(in_dim, num_heads, **options) -> (module, out_dim)`, so a
pooling whose output width differs from the token width (the second-order heads)
fits the same registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

PoolingFactory = Callable[..., tuple[nn.Module, int]]

_REGISTRY: dict[str, PoolingFactory] = {}


class UnknownPoolingError(ValueError):
    """Raised for a `--pool` name that is not registered; lists the valid names."""


def register_pooling(name: str) -> Callable[[PoolingFactory], PoolingFactory]:
    """Decorator registering a factory under `name`."""

    def wrap(factory: PoolingFactory) -> PoolingFactory:
        if name in _REGISTRY:
            raise ValueError(f"pooling {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return wrap


def pooling_names() -> list[str]:
    return sorted(_REGISTRY)


def create_pooling(name: str, in_dim: int, num_heads: int, **options: Any) -> tuple[nn.Module, int]:
    """Build the pooling `name` for tokens of width `in_dim`; returns (module, out_dim)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UnknownPoolingError(
            f"unknown pooling {name!r}; valid names: {', '.join(pooling_names())}"
        ) from None
    return factory(in_dim, num_heads, **options)
