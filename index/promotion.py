"""A model switch gated by evaluation: repoint an alias to a candidate collection only
when the candidate retrieves at least as well (`vitrieval-index promote`).

Both collections are evaluated with the same request, leave-one-out over each one's
own labelled items (index/evaluation/metrics.py `retrieval_metrics`, exact ranking of
the stored vectors): every labelled item queries all the others. That compares two
models when both collections hold the same items, as after a re-embedding. The
candidate wins when

    candidate[metric] >= current[metric] + min_gain

(`metric` any key of the evaluation: "map", "recall@1", ...; a NaN on either side never
wins). The switch is a compare-and-set on the alias (DataFolder.set_alias with
`expected`): an alias switched by someone else during the evaluation is left alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .collections import DataFolder, UnknownCollection
from .evaluation.metrics import retrieval_metrics
from .store import IndexStore, StoreError

logger = logging.getLogger(__name__)

DEFAULT_METRIC = "map"
DEFAULT_KS = (1,)
MAX_ITEMS = 20_000
"""Labelled items a leave-one-out evaluation ranks exactly (O(n^2)); more is refused."""


@dataclass(frozen=True)
class Evaluated:
    """One collection and its evaluation (the metrics `retrieval_metrics` answers)."""

    collection: str
    metrics: dict[str, Any]


@dataclass(frozen=True)
class Promotion:
    """What `promote` measured and decided: the rule is (metric, min_gain)."""

    alias: str
    current: Evaluated
    candidate: Evaluated
    rule: tuple[str, float]
    switched: bool

    def summary(self) -> str:
        metric, min_gain = self.rule
        a, b = self.current.metrics[metric], self.candidate.metrics[metric]
        verdict = (
            f"switched {self.alias} to {self.candidate.collection}"
            if self.switched
            else f"kept {self.alias} on {self.current.collection}"
        )
        return (
            f"{metric}: {self.current.collection} {a:.4f}, {self.candidate.collection} "
            f"{b:.4f} (needed {a + min_gain:.4f}): {verdict}"
        )


def wins(
    current: Mapping[str, Any], candidate: Mapping[str, Any], metric: str, min_gain: float
) -> bool:
    """Whether `candidate`'s `metric` is at least `current`'s plus `min_gain`."""
    if metric not in current or metric not in candidate:
        known = ", ".join(sorted(k for k, v in current.items() if isinstance(v, float)))
        raise StoreError(f"no metric {metric!r} in the evaluation; choose one of {known}")
    a, b = current[metric], candidate[metric]
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return False
    return b >= a + min_gain


def evaluate_collection(folder: DataFolder, name: str, ks: Sequence[int]) -> dict[str, Any]:
    """Leave-one-out metrics of collection `name`'s labelled items."""
    with IndexStore.open(folder.path(name)) as store:
        _, labels, vectors = store.labelled_items(MAX_ITEMS)
    if len(labels) < 2:
        raise StoreError(f"collection {name!r} holds fewer than 2 labelled items")
    return {"n_items": len(labels), **retrieval_metrics(vectors, labels, ks)}


def promote(
    folder: DataFolder,
    alias: str,
    candidate: str,
    *,
    metric: str = DEFAULT_METRIC,
    min_gain: float = 0.0,
    ks: Sequence[int] = DEFAULT_KS,
) -> Promotion:
    """Evaluate the collection `alias` names and `candidate`; switch the alias to the
    candidate when it wins (module docstring)."""
    current = folder.aliases().get(alias)
    if current is None:
        raise UnknownCollection(f"no alias named {alias!r}")
    candidate = folder.resolve(candidate)
    if not math.isfinite(min_gain):
        raise StoreError(f"min_gain must be a finite number, got {min_gain!r}")
    before = evaluate_collection(folder, current, ks)
    after = evaluate_collection(folder, candidate, ks)
    switched = candidate != current and wins(before, after, metric, min_gain)
    if switched:
        folder.set_alias(alias, candidate, expected=current)
    result = Promotion(
        alias, Evaluated(current, before), Evaluated(candidate, after), (metric, min_gain), switched
    )
    logger.info("promote %s: %s", alias, result.summary())
    return result
