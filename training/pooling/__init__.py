"""Pooling heads that turn ViT tokens into one vector per image, registered by name."""

from __future__ import annotations

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
def _gem(in_dim: int, num_heads: int, p: float = 3.0) -> tuple[Pooling, int]:
    return GeM(p=p), in_dim


@register_pooling("ggem")
def _ggem(
    in_dim: int, num_heads: int, p: float = 3.0, groups: int | None = None
) -> tuple[Pooling, int]:
    groups = groups or num_heads  # the paper's recommendation: one group per attention head
    if groups < 1 or in_dim % groups:
        raise PoolingOptionError(f"ggem: {in_dim} channels cannot be split into {groups} groups")
    return GGeM(groups=groups, p=p), in_dim


@register_pooling("ccbp")
def _ccbp(
    in_dim: int,
    num_heads: int,
    d: int = 256,
    out_dim: int = 512,
    codebook: int = 32,
    scale: float = 10.0,
) -> tuple[Pooling, int]:
    return CCBP(in_dim, d=d, out_dim=out_dim, codebook=codebook, scale=scale), out_dim


@register_pooling("jcf")
def _jcf(
    in_dim: int,
    num_heads: int,
    d: int = 256,
    out_dim: int = 512,
    codebook: int = 32,
    rank: int = 8,
    scale: float = 10.0,
) -> tuple[Pooling, int]:
    return JCF(in_dim, d=d, out_dim=out_dim, codebook=codebook, rank=rank, scale=scale), out_dim


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
