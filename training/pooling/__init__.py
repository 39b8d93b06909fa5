"""Pooling heads that turn ViT tokens into one vector per image, registered by name.

Their options and defaults are declared in training/options.py (POOLINGS); the
factories here pass options on to the constructors, which take the defaults from there.
"""

from __future__ import annotations

from typing import Any

from ..options import GGeMOptions
from .avg import AvgPooling
from .base import Pooling, split_tokens
from .ccbp import CCBP
from .cls import ClsPooling
from .gem import GeM
from .ggem import GGeM
from .jcf import JCF
from .max import MaxPooling
from .registry import (
    PoolingOptionError,
    UnknownPoolingError,
    create_pooling,
    pooling_names,
    register_pooling,
)


@register_pooling("cls")
def _cls(in_dim: int, num_heads: int) -> tuple[Pooling, int]:
    return ClsPooling(), in_dim


@register_pooling("avg")
def _avg(in_dim: int, num_heads: int) -> tuple[Pooling, int]:
    return AvgPooling(), in_dim


@register_pooling("max")
def _max(in_dim: int, num_heads: int) -> tuple[Pooling, int]:
    return MaxPooling(), in_dim


@register_pooling("gem")
def _gem(in_dim: int, num_heads: int, **options: Any) -> tuple[Pooling, int]:
    return GeM(**options), in_dim


@register_pooling("ggem")
def _ggem(
    in_dim: int, num_heads: int, groups: int | None = GGeMOptions.groups, **options: Any
) -> tuple[Pooling, int]:
    groups = groups or num_heads  # the paper's recommendation: one group per attention head
    if groups < 1 or in_dim % groups:
        raise PoolingOptionError(f"ggem: {in_dim} channels cannot be split into {groups} groups")
    return GGeM(groups=groups, **options), in_dim


@register_pooling("ccbp")
def _ccbp(in_dim: int, num_heads: int, **options: Any) -> tuple[Pooling, int]:
    pool = CCBP(in_dim, **options)
    return pool, pool.out_dim


@register_pooling("jcf")
def _jcf(in_dim: int, num_heads: int, **options: Any) -> tuple[Pooling, int]:
    pool = JCF(in_dim, **options)
    return pool, pool.out_dim


__all__ = [
    "CCBP",
    "JCF",
    "AvgPooling",
    "ClsPooling",
    "GGeM",
    "GeM",
    "MaxPooling",
    "Pooling",
    "PoolingOptionError",
    "UnknownPoolingError",
    "create_pooling",
    "pooling_names",
    "register_pooling",
    "split_tokens",
]
