"""Poolings by name: the values of `--pool`.

Each entry is a factory `(in_dim, num_heads, **options) -> (module, out_dim)`, so a
pooling whose output width differs from the token width (the second-order heads)
fits the same registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..registry import Registry, UnknownNameError

PoolingFactory = Callable[..., tuple[nn.Module, int]]


class UnknownPoolingError(UnknownNameError):
    """Raised for a `--pool` name that is not registered; lists the valid names."""


class PoolingOptionError(ValueError):
    """Options a pooling cannot be built with for this backbone; the message says why."""


POOLINGS: Registry[PoolingFactory] = Registry("pooling", UnknownPoolingError)
register_pooling = POOLINGS.register
pooling_names = POOLINGS.names


def create_pooling(name: str, in_dim: int, num_heads: int, **options: Any) -> tuple[nn.Module, int]:
    """Build the pooling `name` for tokens of width `in_dim`; returns (module, out_dim)."""
    return POOLINGS.get(name)(in_dim, num_heads, **options)
