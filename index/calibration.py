"""A duplicate threshold calibrated on the index's own images: `vitrieval-index calibrate`.

What a threshold means depends on the model and the catalogue, so it is measured, not
guessed. A sample of the index's items that have image files (`images` of them, drawn
at random with `seed`; at least MIN_IMAGES) is copied `copies` times each with the
copy-detection benchmark's edits (index/evaluation/copy_detection.py: crops, rotations,
rescales, colour changes, JPEG re-saves; 2 to 4 edits a copy). Each copy is embedded
with the index's model and searched in the index, as `duplicates` searches an item:

- its *positive* is the pair (copy, its original), scored as the search scores it
  (a copy whose original the search does not return is missed at every threshold);
- its *negatives* are the pairs (copy, any other item) that the search returns,
  except items that score at least as high against the original as the copy does:
  those are as much a copy of the original as the generated one (a catalogue's own
  duplicates), and whether they are true or false pairs is not known.

At a threshold T the pairs scoring at least T are what `duplicates` would report:

    precision(T) = TP(T) / (TP(T) + FP(T)),   recall(T) = TP(T) / copies

with TP(T) the positives and FP(T) the negatives scoring >= T. For each precision level
the least T (the highest recall) whose precision reaches the level is chosen among the
positives' scores (lowering T below a positive's score to a negative's adds false pairs
and no true one); a level no T reaches keeps the T of the best precision (ties: the
lower T) and says so (`reached`). Negatives come from a top-k search (k = NEIGHBOURS);
a copy whose k-th hit still scores at least the lowest chosen threshold is searched
again deeper (k x 4, up to MAX_DEPTH), so no negative above a chosen threshold is
unseen (beyond MAX_DEPTH hits, 10,000, a copy is not read). Precision and recall
carry 95% Wilson score intervals:

    (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n),   z = 1.96

Without that exception a catalogue full of duplicates would calibrate far too high a
threshold: a copy of an image with ten copies already indexed finds them all above its
own original's score. With it, an item that merely resembles the original closely
(scoring above the copy) is not counted against the threshold either; the precision is
of the pairs whose truth the generated copies decide.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .contract import stored_vectors
from .evaluation.copy_detection import CopySession, copy_queries
from .evaluation.datasets import Item
from .store import StoreError
from .store import manifest as mf
from .store.request import MAX_DEPTH, Query, Where

DEFAULT_PRECISION = 0.99
LEVELS = (0.9, 0.95, 0.99, 0.999)
"""Precision levels calibrated besides the one asked for (`duplicates --precision`)."""
DEFAULT_IMAGES = 200
MIN_IMAGES = 20
"""Fewer images with files than this and `calibrate` refuses: too few to measure."""
DEFAULT_COPIES = 5
NEIGHBOURS = 16
Z_95 = 1.959963984540054


@dataclass
class CopyScores:
    """`positives[c]`: copy c's score against its original (-inf: not returned);
    `negatives[c]`: its scores against the other items returned; `deeper[c]`: whether
    a deeper search could return more (k hits came back and k < MAX_DEPTH), and
    `last[c]` the score of its last hit."""

    positives: np.ndarray
    negatives: list[np.ndarray]
    deeper: list[bool]
    last: list[float]

    def counts(self, threshold: float) -> tuple[int, int]:
        """(TP, FP): positives and negatives scoring at least `threshold`."""
        tp = int(np.count_nonzero(self.positives >= threshold))
        fp = sum(int(np.count_nonzero(n >= threshold)) for n in self.negatives)
        return tp, fp


def check_precision(value: Any) -> float:
    """A precision level: a number strictly between 0 and 1."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < 1:
        raise StoreError(f"precision must be a number between 0 and 1 (exclusive), got {value!r}")
    return float(value)


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (module docstring); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    scale = 1 + z * z / n
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


def choose_level(scores: CopyScores, precision: float) -> mf.CalibrationLevel:
    """The least threshold among the measured scores whose precision reaches
    `precision` (module docstring), with what it measures."""
    pos = np.sort(scores.positives[np.isfinite(scores.positives)])[::-1]
    neg = np.sort(np.concatenate([*scores.negatives, np.empty(0, np.float32)]))[::-1]
    # only a positive's score can be the threshold: lowering it to a negative's adds
    # false pairs and no true one
    candidates = np.unique(pos)[::-1]  # high to low
    if candidates.size == 0:
        raise StoreError(
            "calibration found no copy's original among its hits: the model cannot tell "
            "these copies apart at all (or the index's images changed since it was built)"
        )
    # counts at or above each candidate, by binary search in the descending arrays
    tp = np.searchsorted(-pos, -candidates, side="right")
    fp = np.searchsorted(-neg, -candidates, side="right")
    measured = tp / np.maximum(tp + fp, 1)
    good = np.flatnonzero((measured >= precision) & (tp > 0))
    reached = good.size > 0
    # reached: the lowest such threshold; else the best precision, lowest threshold on ties
    at = int(good[-1]) if reached else int(np.flatnonzero(measured == measured.max())[-1])
    copies = len(scores.positives)
    return mf.CalibrationLevel(
        precision=precision,
        threshold=float(candidates[at]),
        reached=reached,
        measured_precision=float(measured[at]),
        precision_interval=wilson_interval(int(tp[at]), int(tp[at] + fp[at])),
        recall=float(tp[at] / copies),
        recall_interval=wilson_interval(int(tp[at]), copies),
        pairs=int(tp[at] + fp[at]),
    )


def draw_images(store: Any, images: int, seed: int) -> list[Item]:
    """Up to `images` live items with an image file on disk, drawn at random."""
    keys = store.keys()
    order = np.random.default_rng(seed).permutation(len(keys))
    photos: list[Item] = []
    for i in order.tolist():
        record = store.get(keys[i])
        if record is not None and record.path and Path(record.path).is_file():
            photos.append(Item(key=keys[i], label=None, path=Path(record.path)))
            if len(photos) == images:
                break
    if len(photos) < MIN_IMAGES:
        raise StoreError(
            f"calibrate needs at least {MIN_IMAGES} items whose image file is on disk; "
            f"this index has {len(photos)} of {len(keys):,} items"
        )
    return photos


def embed_copies(
    embedder: Any, photos: Sequence[Item], copies: int, seed: int
) -> tuple[np.ndarray, list[str]]:
    """The embeddings (C, D) of `copies` generated copies of each photo and the key of
    each copy's original; copies that fail to decode are left out."""
    session = CopySession(copies)
    queries = copy_queries(photos, copies, seed, session=session)
    result = embedder.embed_items(queries, progress=False)
    return result.embeddings, [queries[i].source for i in result.indices]


def search_copies(
    store: Any,
    vectors: np.ndarray,
    originals: Sequence[str],
    lowest: Callable[[CopyScores], float],
) -> CopyScores:
    """Search every copy and split its hits into positive and negatives; copies whose
    deepest hit still scores at least `lowest(scores)` are searched deeper."""
    n = len(originals)
    scores = CopyScores(np.full(n, -np.inf), [np.empty(0)] * n, [False] * n, [-np.inf] * n)
    read = _VectorCache(store)  # an original's copies, and deeper rounds, ask again
    pending, k = np.arange(n), NEIGHBOURS
    while pending.size:
        k = min(k, MAX_DEPTH)
        rows = store.ranked_search(Query(vectors[pending], k, Where()))
        for c, hits in zip(pending.tolist(), rows, strict=True):
            found = {hit.key: float(hit.score) for _, hit in hits}
            scores.last[c] = float(hits[-1][1].score) if hits else -np.inf
            scores.deeper[c] = len(hits) == k < MAX_DEPTH
            scores.positives[c] = found.pop(originals[c], -np.inf)
            others = _not_as_close(read, originals[c], found, scores.positives[c])
            scores.negatives[c] = np.fromiter(others, np.float64, len(others))
        bound = lowest(scores)
        pending = np.flatnonzero(
            [d and s >= bound for d, s in zip(scores.deeper, scores.last, strict=True)]
        )
        k *= 4
    return scores


class _VectorCache:
    """Stored vectors read once per calibration (None: no such item)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.known: dict[str, np.ndarray | None] = {}

    def __call__(self, keys: list[str]) -> list[np.ndarray | None]:
        missing = [key for key in dict.fromkeys(keys) if key not in self.known]
        if missing:
            self.known.update(zip(missing, stored_vectors(self.store, missing), strict=True))
        return [self.known[key] for key in keys]


def _not_as_close(
    read: _VectorCache, original: str, found: dict[str, float], positive: float
) -> list:
    """The scores of the `found` items (key -> score against the copy) that score
    less against `original` than the copy does (`positive`); all of them when the
    search missed the original (nothing to compare with)."""
    if not found or not np.isfinite(positive):
        return list(found.values())
    keys = list(found)
    anchor, *vectors = read([original, *keys])
    if anchor is None:
        return list(found.values())
    return [
        found[key]
        for key, vector in zip(keys, vectors, strict=True)
        if vector is None or float(np.dot(anchor, vector)) < positive
    ]


def calibrate(
    store: Any,
    embedder: Any,
    precision: float = DEFAULT_PRECISION,
    *,
    images: int = DEFAULT_IMAGES,
    copies: int = DEFAULT_COPIES,
    seed: int = 0,
) -> mf.CalibrationEntry:
    """Measure the duplicate threshold of an opened `store` whose vectors `embedder`
    made (module docstring) and record it (`set_calibration`); the caller saves."""
    precision = check_precision(precision)
    if images < MIN_IMAGES:
        raise StoreError(f"--images must be at least {MIN_IMAGES}, got {images}")
    if copies < 1:
        raise StoreError(f"--copies must be at least 1, got {copies}")
    photos = draw_images(store, images, seed)
    vectors, originals = embed_copies(embedder, photos, copies, seed)
    if len(originals) == 0:
        raise StoreError("no copy of the sampled images could be decoded")
    wanted = sorted({*LEVELS, precision})

    def lowest(scores: CopyScores) -> float:
        return min(choose_level(scores, p).threshold for p in wanted)

    scores = search_copies(store, vectors, originals, lowest)
    entry = mf.CalibrationEntry(
        precision=precision,
        levels=tuple(choose_level(scores, p) for p in wanted),
        images=len(photos),
        copies=len(originals),
        seed=seed,
        items=len(store),
        calibrated=mf.now_iso(),
    )
    store.set_calibration(entry)
    return entry


def threshold_for(entry: mf.CalibrationEntry | None, precision: float | None = None) -> float:
    """The calibrated threshold of `precision` (one of the levels measured; None: the
    level asked for at calibration); a clear StoreError when the index was not
    calibrated, or not for that level."""
    if entry is None:
        raise StoreError(
            "the index has no calibrated duplicate threshold: run `vitrieval-index calibrate "
            "INDEX` first, or give a threshold"
        )
    if precision is None:
        return entry.threshold
    level = entry.level(check_precision(precision))
    if level is None:
        known = ", ".join(f"{lv.precision:g}" for lv in entry.levels)
        raise StoreError(
            f"the index was calibrated for precision {known}, not {precision:g}: run "
            f"`vitrieval-index calibrate INDEX --precision {precision:g}` (which also makes "
            f"{precision:g} the index's default duplicate threshold)"
        )
    return level.threshold
