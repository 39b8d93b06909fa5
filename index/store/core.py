"""IndexStore: the index directory (format in __init__) as one object over segments.

Sealed segments (segment.py) are immutable files, memory-mapped; the growing segment
(memory_segment.py) holds what was added since the last save, behind the journal.
A save seals the growing segment into new files and writes the tombstones that
changed, then commits the manifest: its cost follows the change, not the index.
Searches fan out over every segment and merge the per-segment top k.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from ..rerank import DEFAULT_DBA_ALPHA
from . import manifest as mf
from .augment import check_dba
from .checks import as_matrix, check_ids, checked_items
from .damage import changed_on_disk, with_damaged
from .errors import DamagedIndexError, KeyExistsError, StoreError
from .fields import FieldSelection, check_field_paths
from .filters import Filter
from .health import legacy_items, scrub_store, verify_store
from .items import Hit, ItemRecord, ItemTable, Row
from .journal import Journal, JournalOwner
from .leases import Lease
from .loading import create_store, open_store
from .memory_segment import MemorySegment
from .merge import TOMBSTONE_FRACTION, pick_merge
from .persist import merge as merge_segments
from .persist import save as save_store
from .report import store_info
from .request import Query, Ranked
from .search import labelled_items, ranked_search
from .segment import SealedSegment
from .segment_contract import Segment
from .vectors import VectorIndex, new_faiss_index

logger = logging.getLogger(__name__)

AUTO_COMPACT_FRACTION = TOMBSTONE_FRACTION  # the public name of the merge policy's rule


class IndexStore:
    """A persistent, verified FAISS index with item metadata, in segments.

    Thread-safe: one lock serialises mutations and searches; saves and merges write
    their segment files outside it (they take it for the freeze and the commit: a
    manifest write and an fsync), so searches and adds go on while a checkpoint or a
    merge runs. A journalled mutation holds it for its journal fsync.
    """

    def __init__(
        self,
        directory: Path,
        *,
        factory: str,
        dim: int,
        template: faiss.Index,
        gpu: str,
        model: mf.ModelEntry | None,
        committed: mf.Manifest | None,
        sealed: list[SealedSegment] | None = None,
        growing: MemorySegment | None = None,
        legacy: bool = False,
        filter_fields: FieldSelection | None = None,
        dba: tuple[int, float] | None = None,
    ) -> None:
        self.directory = directory
        self.dba = dba  # (neighbours, alpha) merges compute DBA vectors with (augment.py)
        # the metadata paths new segments index for filters (fields.py)
        self.filter_fields = filter_fields or FieldSelection(None)
        self.dim = dim
        self.factory = factory
        self._template = template  # empty (trained) index new segments start from
        self._gpu = gpu
        self._model = model
        self._committed = committed
        self._base_generation = committed.generation if committed else None
        self._legacy = legacy  # a format-1 index: readable, not writable (upgrade first)
        self._model_source: Path | None = None  # a model still to copy in at save
        self._sealed: list[SealedSegment] = sealed or []
        self._sealing: list[MemorySegment] = []  # frozen growing segments being written
        self._growing = growing or self._new_growing()
        self._retired: list[SealedSegment] = []  # replaced in memory, still committed
        self._damaged: dict[int, str] = {}  # segments out of service: number -> why
        ids = [s.max_id() for s in self._memory_segments()] + [-1]
        self._next_id = max(committed.next_id if committed else 0, max(ids) + 1)
        numbers = [s.number for s in self._sealed] + [0]
        self._next_segment = max(numbers) + 1
        self._quantizer_dirty = False
        self._params_dirty = False
        self._created = committed.created if committed else mf.now_iso()
        self._dirty = committed is None
        self._lock = threading.RLock()
        self._commit_lock = threading.Lock()  # one save or merge at a time
        self._journal: Journal | None = None
        self._journaling = False
        self._journal_seq = 0  # last journal row reflected in memory
        self._journal_pending = 0  # rows no save has committed (read without the lock)
        self._journal_owner: JournalOwner | None = None
        self._lease: Lease | None = None  # on the committed files this store reads
        self._trainable = not new_faiss_index(dim, factory).is_trained

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
        filter_fields: the metadata paths filters read from an index (fields.py);
        None indexes every scalar field, a list only those (a filter on another
        field still works, by reading the metadata of every item it considers).
        """
        return create_store(
            cls,
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
        journal still holds (journal.py).

        Opening checks sizes and headers and memory-maps the segments; `verify=True`
        also checks every byte against the manifest's checksums (see `verify()`).
        fingerprint / dim: refuse an index built with another model or dimension.
        journal: make every later add() and remove() durable on return (a server).
        A format-1 directory opens read-only (`vitrieval-index upgrade` converts it).
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

    def _new_growing(self) -> MemorySegment:
        return MemorySegment(
            VectorIndex(faiss.clone_index(self._template), self._gpu),
            ItemTable.new(self.filter_fields),
        )

    # -- segments ----------------------------------------------------------------------

    def _memory_segments(self) -> list[MemorySegment]:
        return [*self._sealing, self._growing]

    def _segments(self) -> list[Segment]:
        """Every segment searched, oldest first (damaged ones are out of service)."""
        return [*(s for s in self._sealed if not s.damaged), *self._sealing, self._growing]

    def _serving(self) -> list[Segment]:
        """`_segments()` once any sealed segment whose files changed on disk is out of
        service (damage.changed_on_disk); reads call it, locked."""
        for segment, reason in changed_on_disk(self._sealed):
            self.mark_damaged(segment, reason)
        return self._segments()

    def _locate(self, keys: Sequence[str]) -> list[tuple[Segment, dict[str, int]]]:
        """(segment, key -> id) for the live `keys`, per segment holding any."""
        found = []
        for segment in self._serving():
            ids = segment.live_ids(keys)
            if ids:
                found.append((segment, ids))
        return found

    # -- attributes and small queries ---------------------------------------------------

    @property
    def fingerprint(self) -> str | None:
        return self._model.fingerprint if self._model else None

    @property
    def model_path(self) -> Path | None:
        """The model copy inside the directory, once saved (None before, or without one)."""
        if self._model and self._model.file and self._committed is not None:
            return self.directory / self._model.file
        return None

    @property
    def format_version(self) -> int:
        return mf.LEGACY_FORMAT_VERSION if self._legacy else mf.FORMAT_VERSION

    def __len__(self) -> int:
        return sum(s.live_count for s in self._segments())

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        with self._lock:
            return bool(self._locate([key]))

    def __repr__(self) -> str:
        where = str(self.directory)
        return f"IndexStore({where!r}, factory={self.factory!r}, dim={self.dim}, n={len(self)})"

    def keys(self) -> list[str]:
        """Live keys in insertion (id) order."""
        with self._lock:
            pairs = [pair for s in self._serving() for pair in s.keys_by_id()]
        return [key for _, key in sorted(pairs)]

    def get(self, key: str) -> ItemRecord | None:
        with self._lock:
            for segment in reversed(self._serving()):
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
        return labelled_items(self, limit, filter)

    @property
    def next_id(self) -> int:
        """The id the next added item gets (ids increase with every add)."""
        return self._next_id

    def item_ids(self, keys: Sequence[str]) -> dict[str, int]:
        """key -> item id of the live `keys` (ids order equal scores in search)."""
        with self._lock:
            return {key: i for _, found in self._locate(list(keys)) for key, i in found.items()}

    @property
    def journal_pending(self) -> int:
        """Mutations in the journal that no save has committed yet."""
        # no lock: /metrics and the checkpoint poll read this while a save holds it
        return self._journal_pending

    def needs_training(self) -> bool:
        """Whether train() must run before add() (IVF and PQ factories)."""
        return not self._template.is_trained

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
        with self._lock:
            self._refuse_if_damaged()
            existing = self._locate(keys)
            if existing and not replace:
                first = next(iter(existing[0][1]))
                count = sum(len(ids) for _, ids in existing)
                raise KeyExistsError(
                    f"{count} key(s) already in the index, e.g. {first!r}; "
                    "pass replace=True to overwrite them"
                )
            ids = check_ids(ids, len(keys), self._next_id)
            rows = [
                Row(int(i), k, lab, p, m, v)
                for i, k, lab, p, m, v in zip(ids, keys, labels_, paths_, metadata_, x, strict=True)
            ]
            growing = self._growing
            with (
                self._journalled(
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
            self._next_id = int(ids[-1]) + 1
            self._dirty = True

    def remove(self, keys: Sequence[str]) -> int:
        """Remove items by key; returns how many were present (unknown keys are ignored)."""
        if isinstance(keys, str):
            raise StoreError("keys must be a sequence of strings, not one string")
        with self._lock:
            self._refuse_if_damaged()
            found = self._locate(list(dict.fromkeys(keys)))
            if not found:
                return 0
            removed = [key for _, ids in found for key in ids]
            with self._journalled("remove", removed):
                for segment, ids in found:
                    segment.retire(np.fromiter(ids.values(), dtype=np.int64))
            self._dirty = True
            return len(removed)

    @contextlib.contextmanager
    def _journalled(self, op: str, keys: Sequence[str], **columns: Any) -> Iterator[None]:
        """Journal a mutation durably before the block applies it in memory; take the
        row back out if applying fails, so replay never meets a mutation that failed."""
        if not self._journaling:
            yield
            return
        before = self._journal_seq
        self._journal_seq = self._journal.append(op, keys, **columns)
        try:
            yield
        except BaseException:
            self._journal.discard(before)
            self._journal_seq = before
            raise
        self._journal_pending += len(keys)

    def train(self, vectors: np.ndarray) -> None:
        """Train an IVF/PQ index on float32 (n, dim) vectors; a no-op for Flat and HNSW.

        Trains a fresh quantizer that every later segment starts from. Items already
        in the store are re-added under it (into the growing segment; the sealed
        segments they came from are dropped at the next save); search settings
        (nprobe) carry over.
        """
        x = as_matrix(vectors, self.dim, "training vectors")
        # under the commit lock too: a save must not be sealing segments train replaces
        with self._commit_lock, self._lock:
            if not self._trainable:
                return
            fresh = VectorIndex(new_faiss_index(self.dim, self.factory), self._gpu)
            fresh.copy_settings(VectorIndex(self._template, "cpu"))
            fresh.train(x)
            self._template = fresh.cpu
            moved = self._new_growing()
            for segment in self._segments():
                for rows, batch in segment.live_rows():
                    ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
                    moved.insert([Row(*r, v) for r, v in zip(rows, batch, strict=True)], batch, ids)
            self._retired.extend(self._sealed)
            for segment in self._memory_segments():
                segment.close()
            self._sealed, self._sealing, self._growing = [], [], moved
            self._quantizer_dirty = self._dirty = True

    def compact(self) -> None:
        """Fold every segment into one, dropping tombstones (saves first)."""
        self.save()
        self.merge(everything=True)

    def set_search_params(self, *, nprobe: int | None = None, ef_search: int | None = None) -> None:
        """Speed/recall knobs saved with the index: IVF `nprobe` (lists probed per query,
        default max(8, nlist/16); nprobe = nlist is exact) and HNSW `ef_search` (default
        64). Setting one the index does not have is a StoreError."""
        with self._lock:
            for name, value in (("nprobe", nprobe), ("efSearch", ef_search)):
                if value is None:
                    continue
                if int(value) < 1:
                    raise StoreError(f"{name} must be >= 1, got {value}")
                VectorIndex(self._template, "cpu").set_parameter(name, int(value))
                for segment in self._segments():
                    segment.vectors.set_parameter(name, int(value))
                self._params_dirty = self._dirty = True

    def search_params(self) -> dict[str, int]:
        """The index's search settings (IVF: nprobe and nlist; HNSW: efSearch)."""
        return VectorIndex(self._template, "cpu").search_settings()

    # -- search ------------------------------------------------------------------------

    def search(
        self, queries: np.ndarray | Query, k: int | None = None, **where: Any
    ) -> list[list[Hit]]:
        """Top-k items by inner product for each query of float32 (q, dim) `queries`.

        Every segment answers its own top k (search.py); the lists are merged by
        descending score, ties by ascending item id (insertion order), exactly as one
        index holding every item would rank them. `where` (request.py `Where`):
        `filter` (the language of filters.py, as decoded JSON or parsed) and `label`
        keep only the items they allow; `exclude_keys` leaves those items out;
        `augmented` ranks against the DBA vectors where segments have them
        (augment.py). Or one `Query` alone. A query gets fewer than k hits when fewer
        items match.
        """
        return [[h for _, h in row] for row in self.ranked_search(queries, k, **where)]

    def ranked_search(
        self, query: Query | np.ndarray, k: int | None = None, **where: Any
    ) -> Ranked:
        """`search`, each hit with its item id (what orders equal scores)."""
        return ranked_search(self, Query.of(query, k, **where))

    # -- persistence (saving, merging: persist.py) --------------------------------------

    def save(self) -> None:
        """Commit the current state: seal the growing segment into new files, write the
        tombstones that changed, then replace the manifest (the commit point). Costs
        what changed since the last save; searches and adds go on meanwhile. A no-op
        when nothing changed. A crash at any step leaves the last commit loadable."""
        save_store(self)

    def merge(self, *, everything: bool = False, rewrite: bool = False) -> int:
        """Merge small segments (and rewrite those with many tombstones) into one new
        segment, off the search path; returns how many segments were merged (0: none
        was due). `everything=True` folds all sealed segments into one; `rewrite=True`
        writes a lone clean segment anew too (to give it DBA vectors)."""
        return merge_segments(self, everything=everything, rewrite=rewrite)

    def set_filter_fields(self, paths: Sequence[str] | None) -> None:
        """Choose the metadata paths segments written from now on index for filters
        (None: every scalar field; fields.py). Saved with the index; a filter on a path
        a segment did not index reads that segment's metadata instead, until a merge
        (`merge(everything=True, rewrite=True)`) rewrites it."""
        with self._lock:
            self.filter_fields = FieldSelection(check_field_paths(paths))
            self._params_dirty = self._dirty = True

    def set_dba(self, neighbours: int | None, alpha: float = DEFAULT_DBA_ALPHA) -> None:
        """Turn DBA on (every later merge computes the DBA vectors of what it writes,
        with `neighbours` and `alpha`: augment.py) or off (None). Saved with the index;
        `merge(everything=True, rewrite=True)` gives every item its DBA vector now."""
        with self._lock:
            self.dba = None if neighbours is None else check_dba(neighbours, alpha)
            self._params_dirty = self._dirty = True

    def verify(self) -> None:
        """Check every byte of every committed file against its checksum (StoreError)."""
        verify_store(self)

    def legacy_items(self) -> list[tuple[str, str]]:
        """(key, problem) of items this version would refuse at add (health.py)."""
        return legacy_items(self)

    def scrub(
        self, bytes_per_s: float | None = None, stop: threading.Event | None = None
    ) -> list[tuple[int, str]]:
        """Verify every sealed segment in turn (paced by `bytes_per_s`); a segment that
        fails is taken out of service: searches, lookups and merges skip it, and saves
        keep its committed entry as it is, for the operator to restore. Returns the
        damaged segments as (number, reason), this scrub's and earlier ones. `stop`
        ends the scrub between two reads (a server shutting down)."""
        return scrub_store(self, bytes_per_s, stop)

    def mark_damaged(self, segment: SealedSegment, reason: str) -> None:
        """Take `segment` out of service, unless a merge replaced it meanwhile (its files
        are gone because they were merged, not damaged)."""
        with self._lock:
            self._damaged = with_damaged(
                self._sealed, self._damaged, segment, reason, self.directory
            )

    def damaged_segments(self) -> list[tuple[int, str]]:
        """(number, reason) of the segments out of service. Lock-free (a copy of a
        dict the scrub replaces), so probes never wait behind a search or a save."""
        return list(self._damaged.items())

    def _refuse_if_damaged(self) -> None:
        """Keys of a damaged segment cannot be looked up, so a mutation could break
        their uniqueness: refuse them all until the index is restored."""
        if self._damaged:
            numbers = ", ".join(str(n) for n in self._damaged)
            raise DamagedIndexError(
                f"{self.directory}: segment(s) {numbers} failed verification; the index takes "
                "no changes until it is restored from a backup"
            )

    def due_merge(self) -> bool:
        with self._lock:
            healthy = [s for s in self._sealed if not s.damaged]
            return bool(pick_merge(healthy))

    # -- reporting and lifetime ---------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """A manifest-like summary of the store as it is in memory now, plus disk usage."""
        return store_info(self)

    def close(self) -> None:
        """Release files and connections (unsaved changes are lost)."""
        with self._lock:
            for segment in [*self._segments(), *self._retired]:
                segment.close()
            if self._journal is not None:
                self._journal.close()
                self._journal = None
            if self._journal_owner is not None:
                self._journal_owner.release()
                self._journal_owner = None
            if self._lease is not None:
                self._lease.release()
                self._lease = None

    def __enter__(self) -> IndexStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())
