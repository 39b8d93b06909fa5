"""IndexStore: the index directory of DESIGN.md section 2 as one object (format in __init__)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_path
from ..model_metadata import ModelMetadataError, read_model_metadata
from . import manifest as mf
from .checks import as_matrix, check_keys, check_unit, metadata_column, text_column
from .errors import KeyExistsError, StoreError
from .items import Hit, ItemRecord, ItemTable, Row
from .journal import JOURNAL_FILE, Journal, JournalOwner
from .vectors import VectorIndex, check_gpu_mode

logger = logging.getLogger(__name__)

AUTO_COMPACT_FRACTION = 0.2  # save() compacts when tombstones exceed this share of the index
_OPEN_RETRIES = 3


class IndexStore:
    """A persistent, verified FAISS index with item metadata (see the package docstring).

    Thread-safe: one lock serialises mutations, searches and saves, so a server may
    search while another thread adds or removes.
    """

    def __init__(
        self,
        directory: Path,
        *,
        factory: str,
        dim: int,
        vectors: VectorIndex,
        items: ItemTable,
        model: mf.ModelEntry | None,
        committed: mf.Manifest | None,
        base_generation: int | None,
    ) -> None:
        self.directory = directory
        self.dim = dim
        self.factory = factory
        self._vectors = vectors
        self._items = items
        self._model = model
        self._committed = committed
        self._base_generation = base_generation
        self._model_source: Path | None = None  # a model still to copy in at save
        self._tombstones = items.deleted_ids()
        self._live = items.count(deleted=False)
        self._next_id = items.max_id() + 1
        self._created = committed.created if committed else mf.now_iso()
        self._dirty = committed is None
        self._lock = threading.RLock()
        # the folder's mutation journal (see journal.py): written to by add/remove only
        # with journal=True, truncated by every save that commits what it holds
        self._journal: Journal | None = None
        self._journaling = False
        self._journal_seq = 0  # last journal row reflected in memory
        self._journal_pending = 0  # its rows no save has committed (read without the lock)
        self._journal_owner: JournalOwner | None = None
        # whether this factory ever needs training (IVF, PQ), independent of the state now
        self._trainable = not VectorIndex.create(dim, factory, "cpu").is_trained

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
    ) -> IndexStore:
        """A new, empty store for `dim`-d vectors; nothing is written until save().

        model_path: an exported model whose copy the directory keeps; its fingerprint
        must equal `fingerprint` (when given) and its embedding_dim must equal `dim`.
        overwrite: allow a non-empty directory; its old index is replaced at save().
        """
        directory = Path(directory)
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise StoreError(f"dim must be a positive integer, got {dim!r}")
        if directory.exists() and not directory.is_dir():
            raise StoreError(f"{directory} exists and is not a folder")
        if directory.is_dir() and any(directory.iterdir()) and not overwrite:
            raise StoreError(f"{directory} is not empty; pass overwrite=True to replace it")
        source = None
        if model_path is not None:
            source, fingerprint = cls._check_model(Path(model_path), fingerprint, dim)
        store = cls(
            directory,
            factory=factory,
            dim=dim,
            vectors=VectorIndex.create(dim, factory, gpu),
            items=ItemTable.new(),
            model=mf.ModelEntry(fingerprint) if fingerprint is not None else None,
            committed=None,
            base_generation=mf.committed_generation(directory) if directory.is_dir() else None,
        )
        store._model_source = source
        if directory.is_dir():
            # rows journalled against the index this store replaces die with it at save()
            store._journal = Journal.open_existing(directory, dim)
            store._journal_seq = store._journal.last_seq() if store._journal else 0
        return store

    @staticmethod
    def _check_model(path: Path, fingerprint: str | None, dim: int) -> tuple[Path, str]:
        try:
            meta = read_model_metadata(path)
        except ModelMetadataError as exc:
            raise StoreError(str(exc)) from None
        if fingerprint is not None and fingerprint != meta.fingerprint:
            raise StoreError(
                f"model {path} has fingerprint {meta.fingerprint}, not the given {fingerprint}"
            )
        if meta.embedding_dim != dim:
            raise StoreError(f"model {path} embeds {meta.embedding_dim}-d vectors, not {dim}-d")
        return path.resolve(), meta.fingerprint

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        fingerprint: str | None = None,
        dim: int | None = None,
        gpu: str = "auto",
        journal: bool = False,
    ) -> IndexStore:
        """Load the committed generation of `directory`, verifying every checksum, and
        replay the mutations its journal still holds (journal.py).

        fingerprint / dim: refuse an index built with another model or dimension.
        journal: make every later add() and remove() durable on return, through the
        journal, instead of only at the next save() (what a live server needs).
        A save by another process between reading the manifest and its files is
        retried; a damaged or incomplete index is a StoreError, never served.
        """
        directory = Path(directory)
        check_gpu_mode(gpu)
        for attempt in range(_OPEN_RETRIES):
            manifest = mf.read_manifest(directory)
            cls._check_expected(manifest, directory, fingerprint, dim)
            try:
                store = cls._load(directory, manifest, gpu)
                store._attach_journal(create=journal)
                return store
            except StoreError:
                moved_on = mf.committed_generation(directory) != manifest.generation
                if not moved_on or attempt == _OPEN_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def _check_expected(
        manifest: mf.Manifest, directory: Path, fingerprint: str | None, dim: int | None
    ) -> None:
        if dim is not None and dim != manifest.dim:
            raise StoreError(
                f"{directory} holds {manifest.dim}-d vectors, but {dim}-d were expected"
            )
        if fingerprint is not None and fingerprint != manifest.fingerprint:
            built = manifest.fingerprint or "an unrecorded model"
            raise StoreError(
                f"{directory} was built with model fingerprint {built}, not {fingerprint}: "
                "rebuild the index with this model (into a new folder), or use the model it "
                "was built with"
                + (
                    f" (the index keeps a copy: {directory / manifest.model.file})"
                    if manifest.model and manifest.model.file
                    else ""
                )
            )

    @classmethod
    def _load(cls, directory: Path, manifest: mf.Manifest, gpu: str) -> IndexStore:
        g = manifest.generation
        if manifest.model and manifest.model.file and manifest.model.checksum:
            mf.verify_file(directory, manifest.model.file, manifest.model.checksum)
        index_name, items_name = mf.index_file(g), mf.items_file(g)
        vectors = VectorIndex.from_bytes(
            mf.read_verified(directory, index_name, manifest.files[index_name]),
            directory / index_name,
            manifest.dim,
            gpu,
        )
        items = ItemTable.from_bytes(
            mf.read_verified(directory, items_name, manifest.files[items_name]),
            directory / items_name,
        )
        store = cls(
            directory,
            factory=manifest.factory,
            dim=manifest.dim,
            vectors=vectors,
            items=items,
            model=manifest.model,
            committed=manifest,
            base_generation=g,
        )
        rows = len(store) + len(store._tombstones)
        if rows != vectors.ntotal or len(store) != manifest.count:
            store.close()
            raise StoreError(
                f"{directory} is inconsistent: {vectors.ntotal} vectors, {rows} item rows, "
                f"manifest count {manifest.count}"
            )
        return store

    def _attach_journal(self, *, create: bool) -> None:
        """Replay the folder's journal; with `create`, journal every later mutation."""
        path = self.directory / JOURNAL_FILE
        try:
            if create:
                self._journal_owner = JournalOwner(self.directory)
            journal = (
                Journal(path, self.dim)
                if create
                else Journal.open_existing(self.directory, self.dim)
            )
        except BaseException:
            self.close()
            raise
        if journal is None:
            return
        try:
            replayed = 0
            for entry in journal.entries():
                if entry.op == "add":
                    self.add(
                        [entry.key],
                        entry.vector[None, :],
                        labels=[entry.label],
                        paths=[entry.path],
                        metadata=[entry.metadata],
                        replace=True,
                    )
                else:
                    self.remove([entry.key])
                self._journal_seq = entry.seq
                replayed += 1
                self._journal_pending = replayed
        except BaseException:
            journal.close()
            self.close()
            raise
        self._journal, self._journaling = journal, create
        if replayed:
            logger.info("replayed %d journalled mutation(s) of %s", replayed, self.directory)

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

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        with self._lock:
            return bool(self._items.live_ids([key]))

    def __repr__(self) -> str:
        where = str(self.directory)
        return f"IndexStore({where!r}, factory={self.factory!r}, dim={self.dim}, n={self._live})"

    def keys(self) -> list[str]:
        """Live keys in insertion (id) order."""
        with self._lock:
            return self._items.keys()

    def get(self, key: str) -> ItemRecord | None:
        with self._lock:
            return self._items.get(key)

    def labelled_items(self, limit: int | None = None) -> tuple[list[str], list[str], np.ndarray]:
        """(keys, labels, float32 (n, dim) vectors) of the live labelled items in insertion
        order: the input of a leave-one-out evaluation. More than `limit` items is a
        StoreError (checked before anything is read)."""
        with self._lock:
            if limit is not None and (n := self._items.count_labelled()) > limit:
                raise StoreError(
                    f"the index holds {n} labelled items, more than the {limit} allowed"
                )
            return self._items.labelled(self.dim)

    @property
    def journal_pending(self) -> int:
        """Mutations in the journal that no save has committed yet."""
        # no lock: /metrics and the checkpoint poll read this while a save holds it
        return self._journal_pending

    def needs_training(self) -> bool:
        """Whether train() must run before add() (IVF and PQ factories)."""
        return not self._vectors.is_trained

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
    ) -> None:
        """Add items: keys (n,), vectors float32 (n, dim) with unit L2 norm.

        A key already present is an error unless replace=True, which removes the old
        item first. Item ids are assigned in increasing order, so ties in search follow
        insertion order.
        """
        keys = check_keys(keys)
        x = as_matrix(vectors, self.dim, "vectors")
        if len(x) != len(keys):
            raise StoreError(f"{len(keys)} keys but {len(x)} vectors")
        check_unit(x)
        labels_ = text_column(labels, len(keys), "labels")
        paths_ = text_column(paths, len(keys), "paths")
        metadata_ = metadata_column(metadata, len(keys))
        if not keys:
            return
        if self.needs_training():
            raise StoreError(
                f"the {self.factory!r} index must be trained first: call train(vectors) with a "
                "representative sample"
            )
        with self._lock:
            existing = self._items.live_ids(keys)
            if existing and not replace:
                first = next(iter(existing))
                raise KeyExistsError(
                    f"{len(existing)} key(s) already in the index, e.g. {first!r}; "
                    "pass replace=True to overwrite them"
                )
            ids = np.arange(self._next_id, self._next_id + len(keys), dtype=np.int64)
            rows = [
                Row(int(i), k, lab, p, m, v)
                for i, k, lab, p, m, v in zip(ids, keys, labels_, paths_, metadata_, x, strict=True)
            ]
            old = np.fromiter(existing.values(), dtype=np.int64)
            with (
                self._journalled(
                    "add", keys, vectors=x, labels=labels_, paths=paths_, metadata=metadata_
                ),
                self._items.transaction(),
            ):
                self._retire_rows(old)  # frees the keys for the new rows
                self._items.insert(rows)
                self._vectors.add(x, ids)
                # old vectors go after the add, so a failed add leaves FAISS untouched
                self._retire_vectors(old)
            self._next_id += len(keys)
            self._live += len(keys)
            self._dirty = True

    def remove(self, keys: Sequence[str]) -> int:
        """Remove items by key; returns how many were present (unknown keys are ignored)."""
        if isinstance(keys, str):
            raise StoreError("keys must be a sequence of strings, not one string")
        with self._lock:
            found = self._items.live_ids(list(dict.fromkeys(keys)))
            if found:
                with self._journalled("remove", list(found)), self._items.transaction():
                    self._remove_ids(np.fromiter(found.values(), dtype=np.int64))
                self._dirty = True
            return len(found)

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

    def _remove_ids(self, ids: np.ndarray) -> None:
        """Delete live `ids` from SQLite and FAISS (inside the caller's transaction)."""
        self._retire_rows(ids)
        self._retire_vectors(ids)

    def _retire_rows(self, ids: np.ndarray) -> None:
        """SQLite side of a removal: delete the rows, or tombstone them where FAISS cannot
        remove vectors (HNSW)."""
        if ids.size == 0:
            return
        if self._vectors.removable:
            self._items.delete_rows(ids.tolist())
        else:
            self._items.mark_deleted(ids.tolist())

    def _retire_vectors(self, ids: np.ndarray) -> None:
        """FAISS side of a removal: remove_ids, or remember the tombstones for search."""
        if ids.size == 0:
            return
        if self._vectors.removable:
            self._vectors.remove(ids)
        else:
            self._tombstones.update(ids.tolist())
        self._live -= int(ids.size)

    def train(self, vectors: np.ndarray) -> None:
        """Train an IVF/PQ index on float32 (n, dim) vectors; a no-op for Flat and HNSW.

        Always trains a fresh index and re-adds every live vector from SQLite, so it
        also retrains a store that already holds items (tombstones are dropped on the
        way); search settings (nprobe) carry over.
        """
        x = as_matrix(vectors, self.dim, "training vectors")
        with self._lock:
            if not self._trainable:
                return
            fresh = VectorIndex.create(self.dim, self.factory, self._vectors.gpu_mode)
            fresh.copy_settings(self._vectors)
            fresh.train(x)
            with self._items.transaction():
                fresh.rebuild(self._items.live_vectors(self.dim))
                self._items.purge_deleted()
            self._vectors = fresh
            self._tombstones.clear()
            self._dirty = True

    def compact(self) -> None:
        """Rebuild the FAISS index from the live vectors in SQLite, dropping tombstones."""
        with self._lock, self._items.transaction():
            self._vectors.rebuild(self._items.live_vectors(self.dim))
            self._items.purge_deleted()
            self._tombstones.clear()
            self._dirty = True

    def set_search_params(self, *, nprobe: int | None = None, ef_search: int | None = None) -> None:
        """Speed/recall knobs saved with the index: IVF `nprobe` (lists probed per query,
        default max(8, nlist/16); nprobe = nlist is exact) and HNSW `ef_search` (default
        64). Setting one the index does not have is a StoreError."""
        with self._lock:
            for name, value in (("nprobe", nprobe), ("efSearch", ef_search)):
                if value is not None:
                    if int(value) < 1:
                        raise StoreError(f"{name} must be >= 1, got {value}")
                    self._vectors.set_parameter(name, int(value))
                    self._dirty = True

    # -- search ------------------------------------------------------------------------

    def search(
        self,
        queries: np.ndarray,
        k: int,
        *,
        label: str | None = None,
        exclude_keys: Sequence[str] = (),
    ) -> list[list[Hit]]:
        """Top-k items by inner product for each query of float32 (q, dim) `queries`.

        label: only items with this label (a FAISS IDSelector where the index supports
        it, over-fetching and post-filtering where not). exclude_keys: never returned
        (e.g. the query item itself). Ties are ordered by ascending item id (insertion
        order); a query gets fewer than k hits when fewer items match.
        """
        if not isinstance(k, int | np.integer) or isinstance(k, bool) or k < 1:
            raise StoreError(f"k must be an integer >= 1, got {k!r}")
        q = as_matrix(queries, self.dim, "queries")
        with self._lock:
            allowed = None if label is None else self._items.label_ids(str(label))
            excluded = list(self._items.live_ids(list(exclude_keys)).values())
            blocked = np.asarray(sorted(self._tombstones.union(excluded)), dtype=np.int64)
            pairs = self._vectors.top_k(q, int(k), allowed=allowed, blocked=blocked)
            described = self._items.describe([i for row in pairs for i, _ in row])
        return [[self._hit(described[i], score) for i, score in row] for row in pairs]

    @staticmethod
    def _hit(row: tuple[str, str | None, str | None, str], score: float) -> Hit:
        key, label, path, metadata = row
        return Hit(key, score, label, path, json.loads(metadata))

    # -- persistence -------------------------------------------------------------------

    def save(self) -> None:
        """Commit the current state as a new generation (no-op when nothing changed).

        Steps: auto-compact if tombstones exceed 20% of the index; write index.<g>.faiss,
        items.<g>.sqlite (and the model copy) via temp file + fsync + rename + fsync of
        the folder; then atomically replace manifest.json (the commit point); then delete
        older generations and leftover temp files. A crash at any step leaves the last
        committed generation loadable.
        """
        with self._lock:
            if not self._dirty and self._model_source is None:
                return
            self.directory.mkdir(parents=True, exist_ok=True)
            if self._journal_owner is None:
                JournalOwner.check_free(self.directory)  # a server owns this index
            with mf.writer_lock(self.directory):
                on_disk = mf.committed_generation(self.directory)
                if on_disk != self._base_generation:
                    raise StoreError(
                        f"{self.directory} was saved by another writer since this store was "
                        f"loaded (generation {on_disk}, expected {self._base_generation}); "
                        "reopen it and apply the changes again"
                    )
                if len(self._tombstones) > AUTO_COMPACT_FRACTION * max(self._vectors.ntotal, 1):
                    self.compact()
                self._commit((on_disk or 0) + 1)

    def _commit(self, generation: int) -> None:
        model = self._write_model(generation)
        files = {
            mf.index_file(generation): self._write_file(
                mf.index_file(generation), self._vectors.write
            ),
            mf.items_file(generation): self._write_file(
                mf.items_file(generation), self._items.snapshot_to
            ),
        }
        manifest = mf.Manifest(
            generation=generation,
            dim=self.dim,
            factory=self.factory,
            count=self._live,
            files=files,
            model=model,
            created=self._created,
            updated=mf.now_iso(),
        )
        mf.write_manifest(self.directory, manifest)
        # committed: from here on a failure must not undo the in-memory bookkeeping
        self._committed, self._base_generation, self._model = manifest, generation, model
        self._model_source, self._dirty = None, False
        keep = set(files) | ({model.file} if model and model.file else set())
        if self._journal is not None:
            self._journal.truncate(self._journal_seq)
            self._journal_pending = 0
        removed = mf.remove_stale(self.directory, keep)
        logger.debug("committed generation %d; removed %s", generation, removed)

    def _write_file(self, name: str, writer: Any) -> mf.FileEntry:
        """Write DIR/name through `writer(temp_path)`, durably; return its checksum."""
        with atomic_path(self.directory / name) as tmp:
            writer(tmp)
            entry = mf.sha256_file(tmp)
        return entry

    def _write_model(self, generation: int) -> mf.ModelEntry | None:
        """Copy a pending model in (keeping the committed one intact until the commit)."""
        if self._model_source is None:
            return self._model
        committed = self._committed_model_file()
        name = mf.MODEL_FILE if committed != mf.MODEL_FILE else mf.model_file(generation)
        entry = self._write_file(name, lambda tmp: shutil.copyfile(self._model_source, tmp))
        return mf.ModelEntry(self.fingerprint, name, entry)

    def _committed_model_file(self) -> str | None:
        try:
            model = mf.read_manifest(self.directory).model
        except StoreError:
            return None
        return model.file if model else None

    # -- reporting and lifetime ---------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """A manifest-like summary of the store as it is in memory now, plus disk usage."""
        with self._lock:
            committed = self._committed
            files = dict(committed.files) if committed else {}
            if committed and committed.model and committed.model.checksum:
                files[committed.model.file] = committed.model.checksum
            return {
                "directory": str(self.directory),
                "format_version": mf.FORMAT_VERSION,
                "generation": committed.generation if committed else None,
                "count": self._live,
                "deleted": len(self._tombstones),
                "factory": self.factory,
                "dim": self.dim,
                "metric": mf.METRIC,
                "fingerprint": self.fingerprint,
                "model_file": str(self.model_path) if self.model_path else None,
                "trained": self._vectors.is_trained,
                "search_params": self._vectors.search_settings(),
                "gpu": self._vectors.gpu_in_use,
                "bytes_on_disk": sum(entry.bytes for entry in files.values()),
                "files": {name: entry.to_json() for name, entry in files.items()},
                "unsaved_changes": self._dirty or self._model_source is not None,
                "journal_pending": self.journal_pending,
                "created": self._created,
                "updated": committed.updated if committed else None,
            }

    def close(self) -> None:
        """Release the SQLite connection (unsaved changes are lost)."""
        with self._lock:
            self._items.close()
            if self._journal is not None:
                self._journal.close()
                self._journal = None
            if self._journal_owner is not None:
                self._journal_owner.release()
                self._journal_owner = None

    def __enter__(self) -> IndexStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())
