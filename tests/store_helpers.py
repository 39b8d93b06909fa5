"""Shared by the index.store tests: random and exactly representable unit vectors, a
brute-force reference for top-k with the store's tie rule, and a store builder."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vitrieval.index.store import Hit, IndexStore

DIM = 128
STEP = 2.0**-11


def unit_vectors(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    """(n, dim) float32 random unit vectors."""
    x = rng.standard_normal((n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def exact_vectors(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    """Unit vectors (norm error ~1e-4) whose coordinates are multiples of 2**-11.

    Every dot product is then exact in float32 and float64 whatever the summation
    order, so FAISS scores equal the numpy reference bit for bit and exact ties stay
    ties (see tests/test_metrics.py).
    """
    return (np.round(unit_vectors(rng, n, dim) / STEP) * STEP).astype(np.float32)


def with_duplicates(x: np.ndarray, copies: int = 4, originals: int = 10) -> np.ndarray:
    """`x` with `copies` extra copies of its first `originals` rows, interleaved at the end:
    exactly tied scores for the tie rule."""
    return np.concatenate([x, np.repeat(x[:originals], copies, axis=0)])


def brute_force(
    queries: np.ndarray, vectors: np.ndarray, k: int, allowed: np.ndarray | None = None
) -> list[list[tuple[int, float]]]:
    """Reference top-k as (row, score): descending float64 score, ties by ascending row."""
    scores = queries.astype(np.float64) @ vectors.astype(np.float64).T
    rows = np.arange(len(vectors)) if allowed is None else np.flatnonzero(allowed)
    result = []
    for row_scores in scores:
        s = row_scores[rows]
        order = np.lexsort((rows, -s))[:k]
        result.append([(int(rows[i]), float(s[i])) for i in order])
    return result


def as_pairs(hits: list[list[Hit]]) -> list[list[tuple[int, float]]]:
    """Hits of stores whose keys are str(row) as (row, score) lists."""
    return [[(int(h.key), h.score) for h in row] for row in hits]


def build(
    directory: Path,
    x: np.ndarray,
    factory: str = "Flat",
    labels: list[str] | None = None,
    **kwargs,
) -> IndexStore:
    """A store over `x` with keys str(row), trained on `x` when the factory needs it."""
    store = IndexStore.create(directory, dim=x.shape[1], factory=factory, **kwargs)
    if store.needs_training():
        store.train(x)
    store.add([str(i) for i in range(len(x))], x, labels=labels)
    return store


def faiss_rows(store: IndexStore) -> int:
    """Vectors held by the FAISS indexes of all the store's segments (tombstoned ones
    included): what a compaction shrinks."""
    return sum(segment.vectors.ntotal for segment in store._state.segments())


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte of a file in place (damage a checksum would catch)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
