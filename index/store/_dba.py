"""Database-side augmentation (DBA): a derived index beside the segments.

Radenović, Tolias and Chum (the GeM paper, docs/papers.md) replace every database vector
by the weighted mean of itself and its top-n neighbours in the database,

    x' = normalise(x + sum_{j=1..n} max(s_j, 0)^alpha * x_j),

the same weighting as alpha query expansion (index/rerank.py), applied to the items.
The segments keep the plain vectors only; the augmented ones are a derived index of
the committed generation: `dba.<g>.ids.npy` (sorted int64 ids of every live item) and
`dba.<g>.npy` (float32 (n, dim), their DBA vectors in that order), listed with their
checksums under the manifest's `dba` entry with the generation `g` they were computed
at. A search chooses per query which set it ranks against (`augmented=True`);
turning DBA off drops the files at the next commit.

When: with the index's `dba` setting (neighbours, alpha; `vitrieval-index configure
--dba`), every commit (save, merge) whose live items differ from the derived index's
computes it again before the manifest is written, over exactly the items that
manifest commits, with exact neighbours (`rerank.dba_vectors`: every live vector
against every other, so a commit that changed the items costs O(n^2 dim)); a commit
that leaves the items as they were (most merges) keeps the files. Item ids are never
reused and an item's vector never changes, so equal id lists mean equal DBA vectors.

Stale is never silent: an augmented search on a store whose items changed since its
last commit (unsaved adds or removes), or whose derived index is missing or of other
settings, is refused with a StoreError saying to save the index.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..atomic import atomic_path
from ..rerank import dba_vectors
from . import manifest as mf
from ._vectors import TopK, exact_top_k, merge_top_k
from .errors import StoreError

MAX_DBA_NEIGHBOURS = 64
_SCAN_ROWS = 65_536  # rows scored per block: bounded memory on a large derived index


def check_dba(neighbours: int, alpha: float) -> tuple[int, float]:
    """The `dba` setting checked: 1..MAX_DBA_NEIGHBOURS neighbours, alpha >= 0."""
    if not isinstance(neighbours, int) or isinstance(neighbours, bool):
        raise StoreError(f"DBA neighbours must be an integer, got {neighbours!r}")
    if not 1 <= neighbours <= MAX_DBA_NEIGHBOURS:
        raise StoreError(f"DBA neighbours must be between 1 and {MAX_DBA_NEIGHBOURS}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not alpha >= 0:
        raise StoreError(f"DBA alpha must be a number >= 0, got {alpha!r}")
    return neighbours, float(alpha)


class DbaIndex:
    """The derived index of one generation, memory-mapped: ids and DBA vectors."""

    def __init__(self, directory: Path, entry: mf.DbaEntry, dim: int) -> None:
        self.entry = entry
        self.ids = _open_array(directory, entry.ids, np.int64, (entry.count,))
        self.vectors = _open_array(directory, entry.vectors, np.float32, (entry.count, dim))

    @property
    def settings(self) -> tuple[int, float]:
        return self.entry.neighbours, self.entry.alpha

    def verify(self, directory: Path) -> None:
        """Check every byte of its files against the manifest (StoreError)."""
        for named in (self.entry.ids, self.entry.vectors):
            mf.verify_file(directory, named.name, named.checksum)

    def top_k(self, q: np.ndarray, k: int, allowed: np.ndarray | None, blocked: np.ndarray) -> TopK:
        """Exact top k per query against the DBA vectors, among `allowed` (sorted ids;
        None: every item) less `blocked`, ranked as segments rank."""
        found: list[TopK] = [[] for _ in range(len(q))]
        for start in range(0, len(self.ids), _SCAN_ROWS):
            ids = self.ids[start : start + _SCAN_ROWS]
            keep = np.ones(len(ids), dtype=bool)
            if allowed is not None:
                keep &= np.isin(ids, allowed, assume_unique=True)
            if blocked.size:
                keep &= ~np.isin(ids, blocked, assume_unique=True)
            rows = np.flatnonzero(keep)
            if rows.size == 0:
                continue
            block = np.asarray(self.vectors[start : start + _SCAN_ROWS][rows])
            for row, hits in zip(found, exact_top_k(q, ids[rows], block, k), strict=True):
                row.append(hits)
        return [merge_top_k(row, k) for row in found]

    def close(self) -> None:
        self.ids = self.vectors = np.empty(0)  # drop the memory maps


def _open_array(directory: Path, named: mf.NamedFile, dtype: type, shape: tuple) -> np.ndarray:
    path = directory / named.name
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise StoreError(f"{path} is listed in the manifest but unreadable: {exc}") from None
    if size != named.checksum.bytes:
        raise StoreError(f"{path} has {size} bytes, the manifest says {named.checksum.bytes}")
    array = np.load(path, mmap_mode="r")
    if array.dtype != dtype or array.shape != shape:
        raise StoreError(f"{path} holds {array.dtype} {array.shape}, not {shape}")
    return array


def compute_and_write(
    directory: Path,
    generation: int,
    settings: tuple[int, float],
    batches: Iterable[tuple[np.ndarray, np.ndarray]],
    dim: int,
) -> mf.DbaEntry:
    """The derived index of `generation` from the live items' (ids, vectors) batches:
    written (temp file, fsync, rename) and checksummed, not yet committed."""
    parts = list(batches)
    ids = np.concatenate([p[0] for p in parts] + [np.empty(0, np.int64)]).astype(np.int64)
    vectors = np.concatenate([p[1] for p in parts] + [np.empty((0, dim), np.float32)])
    order = np.argsort(ids, kind="stable")
    ids, vectors = ids[order], np.ascontiguousarray(vectors[order], dtype=np.float32)
    neighbours, alpha = settings
    augmented = dba_vectors(vectors, neighbours, alpha) if len(ids) > 1 else vectors
    written = []
    for name, array in (
        (mf.dba_ids_file(generation), ids),
        (mf.dba_vectors_file(generation), np.ascontiguousarray(augmented, dtype=np.float32)),
    ):
        with atomic_path(directory / name) as tmp:
            with open(tmp, "wb") as fh:
                np.save(fh, array)
            written.append(mf.NamedFile(name, mf.sha256_file(tmp)))
    return mf.DbaEntry(neighbours, alpha, generation, len(ids), written[0], written[1])
