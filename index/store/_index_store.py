"""IndexStore: the index directory (format in __init__) as one object over segments.

Sealed segments (_sealed_segment.py) are immutable files, memory-mapped; the growing segment
(_memory_segment.py) holds what was added since the last save, behind the journal.
A save seals the growing segment into new files and writes the tombstones that
changed, then commits the manifest: its cost follows the change, not the index.
Searches fan out over every segment and merge the per-segment top k.

What an open store holds (its segments, counters, journal, lease and locks) is a
StoreState (_state.py); this class is the public face over it, and the modules
that open, save, search, report and verify take the state, never this class.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..rerank import DEFAULT_DBA_ALPHA
from . import manifest as mf
from ._dba import check_dba
from ._field_index import FieldSelection, check_field_paths
from ._health import legacy_items, scrub_store, verify_store
from ._items import Hit, ItemRecord, Row, ScrollPage
from ._loading import create_store, open_store
from ._merge_policy import TOMBSTONE_FRACTION
from ._persist import merge as merge_segments
from ._persist import save as save_store
from ._report import store_info
from ._scroll import scroll
from ._sealed_segment import SealedSegment
from ._search import as_filter, labelled_items, ranked_search
from ._state import StoreState
from ._vectors import VectorIndex, new_faiss_index
from .errors import KeyExistsError, StoreError
from .filters import Filter, FilterInput
from .request import SCROLL_LIMIT, Query, Ranked, checked_oversample
from .validation import as_matrix, check_ids, checked_items

logger = logging.getLogger(__name__)

AUTO_COMPACT_FRACTION = TOMBSTONE_FRACTION  # the public name of the merge policy's rule


class IndexStore:
    """A persistent, verified FAISS index with item metadata, in segments.

    Thread-safe: one lock serialises mutations and searches; saves and merges write
    their segment files outside it (they take it for the freeze and the commit: a
    manifest write and an fsync), so searches and adds go on while a checkpoint or a
    merge runs. A journalled mutation holds it for its journal fsync.
    """

    def __init__(self, state: StoreState) -> None:
        """A store over `state`; `create` and `open` make one."""
        self._state = state

    # -- construction ------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        directory: str | os.PathLike[str],
        *,
        dim: int,
        factory: str = "Flat",
        fingerprint: str | None = None,
        model_path: Path | None = None,
        overwrite: bool = False,
        gpu: str = "auto",
        quantizer: bytes | None = None,
        filter_fields: Sequence[str] | None = None,
    ) -> IndexStore:
        """A new, empty store for `dim`-d vectors; nothing is written until save().

        model_path: an exported model whose copy the directory keeps; its fingerprint
        must equal `fingerprint` (when given) and its embedding_dim must equal `dim`.
        overwrite: allow a non-empty directory; its old index is replaced at save().
        quantizer: a trained, empty index of `factory` (faiss.serialize_index bytes) to
        start from instead of training: the shards of one index share one quantizer.
        filter_fields: the metadata paths filters read from an index (_field_index.py);
        None indexes every scalar field, a list only those (a filter on another
        field still works, by reading the metadata of every item it considers).
        """
        state = create_store(
            Path(directory),
            dim=dim,
            factory=factory,
            fingerprint=fingerprint,
            model_path=model_path,
            overwrite=overwrite,
            gpu=gpu,
            quantizer=quantizer,
            filter_fields=filter_fields,
        )
        return cls(state)

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        fingerprint: str | None = None,
        dim: int | None = None,
        gpu: str = "auto",
        journal: bool = False,
        verify: bool = False,
    ) -> IndexStore:
        """Open the committed generation of `directory` and replay the mutations its
        journal still holds (_journal.py).

        Opening checks sizes and headers and memory-maps the segments; `verify=True`
        also checks every byte against the manifest's checksums (see `verify()`).
        fingerprint / dim: refuse an index built with another model or dimension.
        journal: make every later add() and remove() durable on return (a server).
        A format-2 directory opens read-only; a format-1 one does not open (a StoreError
        naming `vitrieval-index upgrade DIR`, which converts both).
        """
        return open_store(
            cls,
            Path(directory),
            fingerprint=fingerprint,
            dim=dim,
            gpu=gpu,
            journal=journal,
            verify=verify,
        )

    # -- attributes and small queries ---------------------------------------------------

    @property
    def directory(self) -> Path:
        return self._state.directory

    @property
    def dim(self) -> int:
        return self._state.dim

    @property
    def factory(self) -> str:
        return self._state.factory

    @property
    def dba(self) -> tuple[int, float] | None:
        """(neighbours, alpha) commits compute DBA vectors with (_dba.py), or None."""
        return self._state.dba

    @property
    def filter_fields(self) -> FieldSelection:
        """The metadata paths new segments index for filters (_field_index.py)."""
        return self._state.filter_fields

    @property
    def fingerprint(self) -> str | None:
        return self._state.fingerprint

    @property
    def model_path(self) -> Path | None:
        """The model copy inside the directory, once saved (None before, or without one)."""
        return self._state.model_path

    @property
    def format_version(self) -> int:
        return self._state.format_version

    def __len__(self) -> int:
        return self._state.live_count()

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        with self._state.lock:
            return bool(self._state.locate([key]))

    def __repr__(self) -> str:
        where = str(self.directory)
        return f"IndexStore({where!r}, factory={self.factory!r}, dim={self.dim}, n={len(self)})"

    def keys(self) -> list[str]:
        """Live keys in insertion (id) order."""
        with self._state.lock:
            pairs = [pair for s in self._state.serving() for pair in s.keys_by_id()]
        return [key for _, key in sorted(pairs)]

    def live_vectors(self, batch: int = 65536) -> Iterator[tuple[list[str], np.ndarray]]:
        """(keys, float32 (b, dim) stored vectors) of every live item, segment by
        segment in batches of at most `batch`: what a pass over the whole index reads
        (the exact neighbours `vitrieval-index tune` measures recall against). Holds
        the store's lock until the iteration ends: consume it to the end."""
        with self._state.lock:
            for segment in self._state.serving():
                for rows, vectors in segment.live_rows(batch):
                    yield [row[1] for row in rows], vectors

    def get(self, key: str) -> ItemRecord | None:
        with self._state.lock:
            for segment in reversed(self._state.serving()):
                record = segment.get(key)
                if record is not None:
                    return record
        return None

    def labelled_items(
        self,
        limit: int | None = None,
        filter: Filter | Mapping[str, Any] | None = None,
    ) -> tuple[list[str], list[str], np.ndarray]:
        """(keys, labels, float32 (n, dim) vectors) of the live labelled items in insertion
        order (those `filter` allows): the input of a leave-one-out evaluation. More than
        `limit` items is a StoreError (checked before any vector is read)."""
        return labelled_items(self._state, limit, filter)

    def scroll(
        self, filter: FilterInput = None, limit: int = SCROLL_LIMIT, after: str | None = None
    ) -> ScrollPage:
        """Up to `limit` (1 to MAX_SCROLL_LIMIT) live items that `filter` allows (a
        label too: the filter language's "label" key), whose keys sort after `after`, in
        ascending key order, with their columns (no vectors); `next` is the `after` of
        the following page (None: no more). Pages laid end to end list the selection
        once (_scroll.py)."""
        return scroll(self._state, as_filter(filter, None), limit, after)

    def labelled_items_and_ids(
        self,
        limit: int | None = None,
        filter: Filter | Mapping[str, Any] | None = None,
    ) -> tuple[tuple[list[str], list[str], np.ndarray], dict[str, int]]:
        """`labelled_items` and the item ids of its keys, read under one hold of the
        lock: no delete comes between the two reads."""
        with self._state.lock:
            part = self.labelled_items(limit, filter)
            return part, self.item_ids(part[0])

    @property
    def next_id(self) -> int:
        """The id the next added item gets (ids increase with every add)."""
        return self._state.next_id

    def item_ids(self, keys: Sequence[str]) -> dict[str, int]:
        """key -> item id of the live `keys` (ids order equal scores in search)."""
        with self._state.lock:
            found = self._state.locate(list(keys))
            return {key: i for _, ids in found for key, i in ids.items()}

    @property
    def journal_pending(self) -> int:
        """Mutations in the journal that no save has committed yet."""
        # no lock: /metrics and the checkpoint poll read this while a save holds it
        return self._state.journal_pending

    def needs_training(self) -> bool:
        """Whether train() must run before add() (IVF and PQ factories)."""
        return not self._state.template.is_trained

    # -- mutations ---------------------------------------------------------------------

    def add(
        self,
        keys: Sequence[str],
        vectors: np.ndarray,
        *,
        labels: Sequence[str | None] | None = None,
        paths: Sequence[str | os.PathLike[str] | None] | None = None,
        metadata: Sequence[dict | None] | None = None,
        replace: bool = False,
        ids: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Add items: keys (n,), vectors float32 (n, dim) with unit L2 norm.

        A key already present is an error unless replace=True, which removes the old
        item first. Item ids are assigned in increasing order, so ties in search follow
        insertion order; `ids` gives them instead (increasing, from `next_id` on: a
        sharded index numbers its items across shards, so ties order as in one store).
        """
        keys, x, labels_, paths_, metadata_ = checked_items(
            keys, vectors, self.dim, labels, paths, metadata
        )
        if not keys:
            return
        if self.needs_training():
            raise StoreError(
                f"the {self.factory!r} index must be trained first: call train(vectors) with a "
                "representative sample",
                public=f"the {self.factory!r} index is not trained yet: build it from a "
                "sample of the catalogue (vitrieval-index build) before adding items",
            )
        state = self._state
        with state.lock:
            state.refuse_if_damaged()
            existing = state.locate(keys)
            if existing and not replace:
                first = next(iter(existing[0][1]))
                count = sum(len(ids) for _, ids in existing)
                raise KeyExistsError(
                    f"{count} key(s) already in the index, e.g. {first!r}; "
                    "pass replace=True to overwrite them"
                )
            ids = check_ids(ids, len(keys), state.next_id)
            rows = [
                Row(int(i), k, lab, p, m, v)
                for i, k, lab, p, m, v in zip(ids, keys, labels_, paths_, metadata_, x, strict=True)
            ]
            growing = state.growing
            with (
                state.journalled(
                    "add", keys, vectors=x, labels=labels_, paths=paths_, metadata=metadata_
                ),
                growing.items.transaction(),
            ):
                old_here = [i for s, found in existing if s is growing for i in found.values()]
                growing.retire_rows(np.asarray(old_here, dtype=np.int64))  # frees the keys
                growing.insert(rows, x, ids)
                # old vectors go after the add, so a failed add leaves FAISS untouched
                growing.retire_vectors(np.asarray(old_here, dtype=np.int64))
                for segment, found in existing:
                    if segment is not growing:
                        segment.retire(np.fromiter(found.values(), dtype=np.int64))
            state.added(int(ids[-1]))

    def remove(self, keys: Sequence[str]) -> int:
        """Remove items by key; returns how many were present (unknown keys are ignored)."""
        if isinstance(keys, str):
            raise StoreError("keys must be a sequence of strings, not one string")
        state = self._state
        with state.lock:
            state.refuse_if_damaged()
            found = state.locate(list(dict.fromkeys(keys)))
            if not found:
                return 0
            removed = [key for _, ids in found for key in ids]
            with state.journalled("remove", removed):
                for segment, ids in found:
                    segment.retire(np.fromiter(ids.values(), dtype=np.int64))
            state.changed()
            return len(removed)

    def train(self, vectors: np.ndarray) -> None:
        """Train an IVF/PQ index on float32 (n, dim) vectors; a no-op for Flat and HNSW.

        Trains a fresh quantizer that every later segment starts from. Items already
        in the store are re-added under it (into the growing segment; the sealed
        segments they came from are dropped at the next save); search settings
        (nprobe) carry over.
        """
        x = as_matrix(vectors, self.dim, "training vectors")
        state = self._state
        # under the commit lock too: a save must not be sealing segments train replaces
        with state.commit_lock, state.lock:
            if not state.trainable:
                return
            fresh = VectorIndex(new_faiss_index(self.dim, self.factory), state.gpu)
            fresh.copy_settings(VectorIndex(state.template, "cpu"))
            fresh.train(x)
            state.retrain(fresh.cpu)

    def compact(self) -> None:
        """Fold every segment into one, dropping tombstones (saves first)."""
        self.save()
        self.merge(everything=True)

    def set_search_params(
        self,
        *,
        nprobe: int | None = None,
        ef_search: int | None = None,
        oversample: int | None = None,
    ) -> None:
        """Speed/recall knobs saved with the index: IVF `nprobe` (lists probed per query,
        default max(8, nlist/16); nprobe = nlist is exact), HNSW `ef_search` (default
        64) and `oversample` (candidates per k a compressed segment re-scores, 1 to
        MAX_OVERSAMPLE; default DEFAULT_OVERSAMPLE, request.py). Setting one the index
        does not have is a StoreError."""
        state = self._state
        with state.lock:
            if oversample is not None:
                checked = checked_oversample(oversample)
                if VectorIndex(state.template, "cpu").scores_exact:
                    raise StoreError(
                        f"oversample does not apply to a {self.factory} index: its scores "
                        "are exact already (it re-scores nothing)"
                    )
                state.oversample = checked
                state.changed(params=True)
            for name, value in (("nprobe", nprobe), ("efSearch", ef_search)):
                if value is None:
                    continue
                if int(value) < 1:
                    raise StoreError(f"{name} must be >= 1, got {value}")
                VectorIndex(state.template, "cpu").set_parameter(name, int(value))
                for segment in state.segments():
                    segment.vectors.set_parameter(name, int(value))
                state.changed(params=True)

    def set_tuning(self, tuning: mf.TuningEntry | None) -> None:
        """Record what `vitrieval-index tune` measured (index/tuning.py), saved with the
        index at the next save and shown by `info`; None forgets it."""
        with self._state.lock:
            self._state.tuning = tuning
            self._state.changed(params=True)

    def set_calibration(self, calibration: mf.CalibrationEntry | None) -> None:
        """Record what `vitrieval-index calibrate` measured (index/calibration.py),
        saved with the index at the next save and shown by `info`; None forgets it."""
        with self._state.lock:
            self._state.calibration = calibration
            self._state.changed(params=True)

    @property
    def calibration(self) -> mf.CalibrationEntry | None:
        """The duplicate-threshold calibration, if the index has one."""
        return self._state.calibration

    def search_params(self) -> dict[str, int]:
        """The index's search settings (IVF: nprobe and nlist; HNSW: efSearch; a
        compressed index: the oversampling it re-scores with)."""
        return self._state.search_params()

    # -- search ------------------------------------------------------------------------

    def search(
        self, queries: np.ndarray | Query, k: int | None = None, **where: Any
    ) -> list[list[Hit]]:
        """Top-k items by inner product for each query of float32 (q, dim) `queries`.

        Every segment answers its own top k (_search.py); the lists are merged by
        descending score, ties by ascending item id (insertion order), exactly as one
        index holding every item would rank them. `where` (request.py `Where`):
        `filter` (the language of filters.py, as decoded JSON or parsed) and `label`
        keep only the items they allow; `exclude_keys` leaves those items out;
        `augmented` ranks against the DBA vectors of the committed items (_dba.py;
        a StoreError while adds or removes are unsaved). Or one `Query` alone. A
        query gets fewer than k hits when fewer items match.
        """
        return [[h for _, h in row] for row in self.ranked_search(queries, k, **where)]

    def ranked_search(
        self, query: Query | np.ndarray, k: int | None = None, **where: Any
    ) -> Ranked:
        """`search`, each hit with its item id (what orders equal scores)."""
        return ranked_search(self._state, Query.of(query, k, **where))

    # -- persistence (saving, merging: _persist.py) --------------------------------------

    def save(self) -> None:
        """Commit the current state: seal the growing segment into new files, write the
        tombstones that changed, then replace the manifest (the commit point). Costs
        what changed since the last save; searches and adds go on meanwhile. A no-op
        when nothing changed. A crash at any step leaves the last commit loadable."""
        state = self._state
        if save_store(state) and state.due_merge() and not state.journaling:
            # a batch writer (CLI, build) merges at once; a server merges in the background
            self.merge()

    def merge(self, *, everything: bool = False, rewrite: bool = False) -> int:
        """Merge small segments (and rewrite those with many tombstones) into one new
        segment, off the search path; returns how many segments were merged (0: none
        was due). `everything=True` folds all sealed segments into one; `rewrite=True`
        writes a lone clean segment anew too (to index the filter fields set since)."""
        return merge_segments(self._state, everything=everything, rewrite=rewrite)

    def upgrade_format(self) -> None:
        """Make the next save() write this index of an older format in the current one
        (upgrade.py)."""
        with self._state.lock:
            self._state.upgrade_format()

    def set_filter_fields(self, paths: Sequence[str] | None) -> None:
        """Choose the metadata paths segments written from now on index for filters
        (None: every scalar field; _field_index.py). Saved with the index; a filter on a path
        a segment did not index reads that segment's metadata instead, until a merge
        (`merge(everything=True, rewrite=True)`) rewrites it."""
        with self._state.lock:
            self._state.set_filter_fields(FieldSelection(check_field_paths(paths)))

    def set_dba(self, neighbours: int | None, alpha: float = DEFAULT_DBA_ALPHA) -> None:
        """Turn DBA on (every commit whose items changed computes the derived DBA index
        of all of them, with `neighbours` and `alpha`: _dba.py) or off (None). Saved
        with the index: the next save() computes the DBA vectors of every item."""
        with self._state.lock:
            self._state.set_dba(None if neighbours is None else check_dba(neighbours, alpha))

    def verify(self) -> None:
        """Check every byte of every committed file against its checksum (StoreError)."""
        verify_store(self._state)

    def legacy_items(self) -> list[tuple[str, str]]:
        """(key, problem) of items this version would refuse at add (_health.py)."""
        return legacy_items(self._state)

    def scrub(
        self, bytes_per_s: float | None = None, stop: threading.Event | None = None
    ) -> list[tuple[int, str]]:
        """Verify every sealed segment in turn (paced by `bytes_per_s`); a segment that
        fails is taken out of service: searches, lookups and merges skip it, and saves
        keep its committed entry as it is, for the operator to restore. Returns the
        damaged segments as (number, reason), this scrub's and earlier ones. `stop`
        ends the scrub between two reads (a server shutting down)."""
        return scrub_store(self._state, bytes_per_s, stop)

    def mark_damaged(self, segment: SealedSegment, reason: str) -> None:
        """Take `segment` out of service, unless a merge replaced it meanwhile (its files
        are gone because they were merged, not damaged)."""
        self._state.mark_damaged(segment, reason)

    def damaged_segments(self) -> list[tuple[int, str]]:
        """(number, reason) of the segments out of service. Lock-free (a copy of a
        dict the scrub replaces), so probes never wait behind a search or a save."""
        return self._state.damaged_segments()

    def due_merge(self) -> bool:
        """Whether the merge policy (_merge_policy.py) would merge segments now."""
        return self._state.due_merge()

    # -- reporting and lifetime ---------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """A manifest-like summary of the store as it is in memory now, plus disk usage."""
        return store_info(self._state)

    def close(self) -> None:
        """Release files and connections (unsaved changes are lost)."""
        self._state.close()

    def __enter__(self) -> IndexStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())
