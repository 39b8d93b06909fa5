"""Several query images as one query: fusing their embeddings, or their hit lists.

mean: the query is the mean of the images' (unit) embeddings, normalised again, and
is searched once. It finds what the images have in common.

max: an item scores its highest similarity to any of the query images, so it is found
when it resembles one of them. Searching each image for its top k and keeping, per
key, the highest score found (`merge_max`) is exact, not an approximation: let x be in
the top k by max score, its maximum reached at image i. Every item ranked above x by
image i scores above x (or the same, with a smaller id) at image i, so also by max:
fewer than k of them, so x is in image i's top k, with its maximum as the score. An
item whose maximum was missed (not in the list of the image that gives it) is merged
with a lower score than its own, and by its own it already ranks below the k-th: it
cannot push out one of the top k. Equal scores are ordered by ascending item id, as
one search orders them. (Exact given each image's search: with an approximate index,
as good as those searches.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, TypeVar, get_args

import numpy as np

from .unit_vectors import CANCELLED_NORM, unit_rows

Fusion = Literal["mean", "max"]
FUSIONS: tuple[str, ...] = get_args(Fusion)
DEFAULT_FUSION: Fusion = "mean"


class _Scored(Protocol):
    key: str
    score: float


H = TypeVar("H", bound=_Scored)


class FusionError(ValueError):
    """Query images that cannot be fused as asked; the message says why."""


def fuse_mean(vectors: np.ndarray) -> np.ndarray:
    """The mean of float32 (m, d) unit vectors, L2-normalised: a float32 (d,) query.

    FusionError when the mean is (numerically) zero: images that cancel each other out
    have no direction in common to search for.
    """
    x = np.asarray(vectors, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(f"fuse_mean needs (m, d) vectors with m >= 1, got {x.shape}")
    mean = x.astype(np.float64).mean(axis=0)
    unit, ok = unit_rows(mean[None, :])
    if not ok[0] or float(np.linalg.norm(mean)) < CANCELLED_NORM:
        raise FusionError(
            "the query images' embeddings cancel each other out (their mean is zero): "
            "fuse them with max instead"
        )
    return unit[0]


def merge_max(rows: Sequence[Sequence[tuple[int, H]]], k: int) -> list[tuple[int, H]]:
    """Ranked hit lists of several query images (each `(item id, hit)` by descending
    score, as `IndexStore.ranked_search` answers) -> one top k by each key's highest
    score, equal scores by ascending item id. Exact: see the module docstring."""
    best: dict[str, tuple[int, H]] = {}
    for row in rows:
        for item_id, hit in row:
            kept = best.get(hit.key)
            if kept is None or hit.score > kept[1].score:
                best[hit.key] = (item_id, hit)
    merged = sorted(best.values(), key=lambda pair: (-pair[1].score, pair[0]))
    return merged[:k]
