"""Database-side augmentation (DBA): a second vector set, computed when segments merge.

Radenović, Tolias and Chum (the GeM paper, docs/papers.md) replace every database vector
by the weighted mean of itself and its top-n neighbours in the database,

    x' = normalise(x + sum_{j=1..n} max(s_j, 0)^alpha * x_j),

the same weighting as alpha query expansion (index/rerank.py), applied to the items.
The store keeps the plain vectors and writes the augmented ones beside them as each
segment's DBA set (`seg.<n>.dba.faiss`, and `seg.<n>.dba.npy` but for "Flat"), so a
search chooses per query which set it ranks against (`augmented=True`), and turning
DBA off costs nothing.

When: the index's `dba` setting (neighbours, alpha; `vitrieval-index dba`) makes
every merge compute the DBA set of the segment it writes, with the neighbours
searched in the whole index as it is then; `vitrieval-index dba` merges everything
once so every item has one. Segments sealed since the last merge (new items) have
no DBA set yet and are ranked by their plain vectors, also in an augmented search.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..rerank import expand_queries
from .errors import StoreError
from .items import Hit
from .segment import Augment
from .store_state import StoreState

Rank = Callable[[np.ndarray, int], list[list[tuple[int, Hit]]]]
"""Top-k (id, hit) lists for float32 (q, dim) queries: the store's ranked search."""

MAX_DBA_NEIGHBOURS = 64


def check_dba(neighbours: int, alpha: float) -> tuple[int, float]:
    """The `dba` setting checked: 1..MAX_DBA_NEIGHBOURS neighbours, alpha >= 0."""
    if not isinstance(neighbours, int) or isinstance(neighbours, bool):
        raise StoreError(f"DBA neighbours must be an integer, got {neighbours!r}")
    if not 1 <= neighbours <= MAX_DBA_NEIGHBOURS:
        raise StoreError(f"DBA neighbours must be between 1 and {MAX_DBA_NEIGHBOURS}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not alpha >= 0:
        raise StoreError(f"DBA alpha must be a number >= 0, got {alpha!r}")
    return neighbours, float(alpha)


def dba_augment(rank: Rank, state: StoreState, neighbours: int, alpha: float) -> Augment:
    """The function a merge calls on each batch: (ids, vectors) -> DBA vectors, with
    the neighbours `rank` finds in the store `state` holds."""

    def augment(ids: np.ndarray, vectors: np.ndarray) -> np.ndarray:
        found = rank(vectors, neighbours + 1)
        near = np.full((len(ids), neighbours), -1, dtype=np.int64)
        scores = np.zeros((len(ids), neighbours), dtype=np.float32)
        for row, (own, hits) in enumerate(zip(ids.tolist(), found, strict=True)):
            others = [(i, h.score) for i, h in hits if i != own][:neighbours]
            for j, (i, score) in enumerate(others):
                near[row, j], scores[row, j] = i, score
        stored = vectors_by_id(state, np.unique(near[near >= 0]))
        neighbour_vectors = np.zeros((*near.shape, vectors.shape[1]), dtype=np.float32)
        for (row, j), i in np.ndenumerate(near):
            if i >= 0:
                neighbour_vectors[row, j] = stored[int(i)]
        return expand_queries(vectors, neighbour_vectors, scores, alpha)

    return augment


def vectors_by_id(state: StoreState, ids: np.ndarray) -> dict[int, np.ndarray]:
    """item id -> stored (plain) float32 vector, for the `ids` any segment holds."""
    found: dict[int, np.ndarray] = {}
    with state.lock:
        for segment in state.segments():
            got, vectors = segment.exact_vectors(ids)
            found.update(zip(got.tolist(), vectors, strict=True))
    return found
