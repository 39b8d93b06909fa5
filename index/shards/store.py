"""ShardedStore: N index stores behind one IndexStore-like object, and `open_index`.

Every key lives in the shard the rule of layout.py gives it, so a lookup, an add or a
remove goes to one shard; a search asks every shard for its top k and merges them.
Item ids are numbered across the shards (each add takes the next ids of the whole
index), so equal scores are ordered by id, insertion order, exactly as in one store:
a Flat sharded index answers with the same keys, order and scores as one store
holding the same items added in the same order. Each shard keeps its own journal,
locks, segments and merges; the sharded store adds no file of its own after the build.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..store import (
    OTHER_MODEL_ADVICE,
    FieldSelection,
    Hit,
    IndexStore,
    ItemRecord,
    JournalOwner,
    KeyExistsError,
    ScrollPage,
    StoreError,
)
from ..store import manifest as mf
from ..store.errors import DamagedIndexError
from ..store.filters import Filter, FilterInput, parse_filter
from ..store.request import SCROLL_LIMIT, Query, Ranked, Where
from ..store.validation import as_matrix, checked_items
from .layout import (
    PLAN_FILE,
    RULE,
    SHARDS_FILE,
    VERSION,
    ShardsManifest,
    is_sharded,
    read_shards_manifest,
    shard_of,
    split_by_shard,
    store_directories,
)
from .routing import (
    NO_DBA,
    merge_labelled,
    merge_ranked,
    merge_scrolled,
    numbered,
    shard_queries,
)


class ShardedStore:
    """A sharded index directory (layout.py), opened: the IndexStore methods the
    command line and the service use, each routed to the owning shard or fanned out."""

    def __init__(self, directory: Path, manifest: ShardsManifest, shards: list[IndexStore]):
        self.directory = directory
        self.manifest = manifest
        self.shards = shards
        self.dim = manifest.dim
        self.factory = manifest.factory
        # a mutation numbers its items and routes them under this lock, so ids increase
        # in the order the adds happen; reads that map keys to ids take it too
        self._lock = threading.RLock()
        self._next_id = max(s.next_id for s in shards)

    @classmethod
    def open(cls, directory: str | os.PathLike[str], **options: Any) -> ShardedStore:
        """Open every shard of `directory`: `options` as for `IndexStore.open`, given to
        each shard (shard 0 verifies the model copy in full, as any store does); the
        fingerprint and dim asked for are checked against shards.json first."""
        fingerprint, dim = options.pop("fingerprint", None), options.pop("dim", None)
        directory = Path(directory)
        manifest = read_shards_manifest(directory)
        if dim is not None and dim != manifest.dim:
            raise StoreError(
                f"{directory} holds {manifest.dim}-d vectors, but {dim}-d were expected: "
                f"{OTHER_MODEL_ADVICE} (shard 0 keeps a copy)"
            )
        if fingerprint is not None and fingerprint != manifest.fingerprint:
            raise StoreError(
                f"{directory} was built with model fingerprint {manifest.fingerprint}, not "
                f"{fingerprint}: {OTHER_MODEL_ADVICE} (shard 0 keeps a copy)"
            )
        shards: list[IndexStore] = []
        try:
            for name in manifest.shards:
                shard = IndexStore.open(
                    directory / name, fingerprint=manifest.fingerprint, dim=manifest.dim, **options
                )
                shards.append(shard)
                if shard.factory != manifest.factory:
                    raise StoreError(
                        f"{directory / name} has factory {shard.factory!r}, but "
                        f"{directory / SHARDS_FILE} says {manifest.factory!r}"
                    )
        except BaseException:
            for shard in shards:
                shard.close()
            raise
        return cls(directory, manifest, shards)

    # -- attributes and small queries ---------------------------------------------------

    def _owner(self, key: str) -> IndexStore:
        return self.shards[shard_of(key, len(self.shards))]

    @property
    def fingerprint(self) -> str | None:
        return self.manifest.fingerprint

    @property
    def model_path(self) -> Path | None:
        """The index's one model copy, kept by shard 0."""
        return self.shards[0].model_path

    @property
    def format_version(self) -> int:
        """The oldest format among the shards: `upgrade` is due while any shard is behind."""
        return min(s.format_version for s in self.shards)

    @property
    def next_id(self) -> int:
        return self._next_id

    @property
    def journal_pending(self) -> int:
        """Journalled mutations no save has committed, over every shard (lock-free)."""
        return sum(s.journal_pending for s in self.shards)

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._owner(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __repr__(self) -> str:
        return (
            f"ShardedStore({str(self.directory)!r}, shards={len(self.shards)}, "
            f"factory={self.factory!r}, dim={self.dim}, n={len(self)})"
        )

    def _in_id_order(self, per_shard: list[list[str]]) -> list[tuple[str, int]]:
        """(key, item id) of every shard's keys, ordered by id (insertion order)."""
        pairs = []
        for shard, keys in zip(self.shards, per_shard, strict=True):
            ids = shard.item_ids(keys)
            pairs.extend((key, ids[key]) for key in keys)
        pairs.sort(key=lambda pair: pair[1])
        return pairs

    def keys(self) -> list[str]:
        """Live keys in insertion (id) order, as one store lists them."""
        with self._lock:
            return [key for key, _ in self._in_id_order([s.keys() for s in self.shards])]

    def live_vectors(self, batch: int = 65536) -> Iterator[tuple[list[str], np.ndarray]]:
        """`IndexStore.live_vectors` of every shard, one after another."""
        for shard in self.shards:
            yield from shard.live_vectors(batch)

    def get(self, key: str) -> ItemRecord | None:
        return self._owner(key).get(key)

    def item_ids(self, keys: Sequence[str]) -> dict[str, int]:
        """key -> item id of the live `keys`, each asked of its shard."""
        keys = list(keys)
        found: dict[str, int] = {}
        for shard, positions in split_by_shard(keys, len(self.shards)).items():
            found.update(self.shards[shard].item_ids([keys[i] for i in positions]))
        return found

    def labelled_items(
        self, limit: int | None = None, filter: Filter | Mapping[str, Any] | None = None
    ) -> tuple[list[str], list[str], np.ndarray]:
        """(keys, labels, vectors) of the live labelled items in insertion order (those
        `filter` allows), as `IndexStore.labelled_items`; more than `limit` in all is a
        StoreError."""
        flt = None if filter is None else parse_filter(filter)
        with self._lock:
            parts = [s.labelled_items(limit, flt) for s in self.shards]
            ids = [s.item_ids(p[0]) for s, p in zip(self.shards, parts, strict=True)]
        return merge_labelled(parts, ids, self.dim, limit)

    def needs_training(self) -> bool:
        return any(s.needs_training() for s in self.shards)

    def train(self, vectors: np.ndarray) -> None:
        """A sharded index is trained once, when it is built (`build --shards`)."""
        if self.needs_training():
            raise StoreError(
                f"{self.directory} is a sharded index whose shards are untrained: rebuild it "
                "with `vitrieval-index build --embeddings EMB --shards N`"
            )

    # -- mutations ---------------------------------------------------------------------

    def add(
        self, keys: Sequence[str], vectors: np.ndarray, *, replace: bool = False, **columns: Any
    ) -> None:
        """`IndexStore.add` (`columns`: its labels, paths and metadata), each item to the
        shard that owns its key.

        Everything a caller can get wrong (vectors, columns, a key already present
        without `replace`, a damaged shard) is checked before any shard changes."""
        keys, x, labels_, paths_, _ = checked_items(keys, vectors, self.dim, **columns)
        metadata = columns.get("metadata")  # checked above, converted by the shard
        metadata_ = list(metadata) if metadata is not None else [None] * len(keys)
        if not keys:
            return
        owned = split_by_shard(keys, len(self.shards))
        with self._lock:
            for shard, positions in owned.items():
                store = self.shards[shard]
                if store.needs_training():
                    raise StoreError(
                        f"{store.directory} must be trained first",
                        public="the index is not trained yet: it takes items once built",
                    )
                if store.damaged_segments():
                    raise DamagedIndexError(
                        f"{store.directory}: segment(s) failed verification; the index takes "
                        "no changes until it is restored from a backup"
                    )
                present = store.item_ids([keys[i] for i in positions]) if not replace else {}
                if present:
                    raise KeyExistsError(
                        f"{len(present)} key(s) already in the index, e.g. "
                        f"{next(iter(present))!r}; pass replace=True to overwrite them"
                    )
            ids = numbered(self._next_id, len(keys))
            for shard, positions in owned.items():
                self.shards[shard].add(
                    [keys[i] for i in positions],
                    x[positions],
                    labels=[labels_[i] for i in positions],
                    paths=[paths_[i] for i in positions],
                    metadata=[metadata_[i] for i in positions],
                    replace=replace,
                    ids=ids[positions],
                )
            self._next_id += len(keys)

    def remove(self, keys: Sequence[str]) -> int:
        """Remove items by key from their shards; returns how many were present."""
        if isinstance(keys, str):
            raise StoreError("keys must be a sequence of strings, not one string")
        unique = list(dict.fromkeys(keys))
        with self._lock:
            return sum(
                self.shards[shard].remove([unique[i] for i in positions])
                for shard, positions in split_by_shard(unique, len(self.shards)).items()
            )

    def set_search_params(self, **params: int | None) -> None:
        """`IndexStore.set_search_params` (nprobe, ef_search, oversample) on every shard."""
        for shard in self.shards:
            shard.set_search_params(**params)

    def search_params(self) -> dict[str, int]:
        return self.shards[0].search_params()

    def set_tuning(self, tuning: mf.TuningEntry | None) -> None:
        """`IndexStore.set_tuning` on every shard (the settings were tuned for all)."""
        for shard in self.shards:
            shard.set_tuning(tuning)

    def set_calibration(self, calibration: mf.CalibrationEntry | None) -> None:
        """`IndexStore.set_calibration` on every shard (calibrated on all of them)."""
        for shard in self.shards:
            shard.set_calibration(calibration)

    @property
    def calibration(self) -> mf.CalibrationEntry | None:
        return self.shards[0].calibration

    # -- search ------------------------------------------------------------------------

    def ranked_search(
        self, query: Query | np.ndarray, k: int | None = None, **where: Any
    ) -> Ranked:
        """Every shard's top k merged into one top k: descending score, equal scores
        by ascending item id (ids are numbered across the shards); the arguments as
        for `IndexStore.ranked_search`, the filter parsed once for all shards."""
        query = Query.of(query, k, **where)
        query = query.replace(vectors=as_matrix(query.vectors, self.dim, "queries"))
        each = shard_queries(query, len(self.shards), self.directory)
        found = [shard.ranked_search(q) for shard, q in zip(self.shards, each, strict=True)]
        return merge_ranked(found, query)

    def search(
        self, queries: np.ndarray | Query, k: int | None = None, **where: Any
    ) -> list[list[Hit]]:
        """Top-k items for each query, as `IndexStore.search` ranks them."""
        return [[h for _, h in row] for row in self.ranked_search(queries, k, **where)]

    def scroll(
        self, filter: FilterInput = None, limit: int = SCROLL_LIMIT, after: str | None = None
    ) -> ScrollPage:
        """`IndexStore.scroll` over every shard: each lists its first `limit` keys after
        `after`, merged by key (routing.merge_scrolled)."""
        flt = Where(filter=filter).allowed  # parsed once for every shard
        return merge_scrolled([shard.scroll(flt, limit, after) for shard in self.shards], limit)

    # -- persistence and upkeep, shard by shard ------------------------------------------

    def save(self) -> None:
        """Save every shard (each its own commit; a shard with no change writes nothing)."""
        for shard in self.shards:
            shard.save()

    def merge(self, *, everything: bool = False, rewrite: bool = False) -> int:
        """Merge what is due in every shard; returns how many segments were merged."""
        return sum(shard.merge(everything=everything, rewrite=rewrite) for shard in self.shards)

    @property
    def dba(self) -> None:
        return None

    @property
    def filter_fields(self) -> FieldSelection:
        return self.shards[0].filter_fields

    def set_filter_fields(self, paths: Sequence[str] | None) -> None:
        """`IndexStore.set_filter_fields` on every shard."""
        for shard in self.shards:
            shard.set_filter_fields(paths)

    def set_dba(self, neighbours: int | None, alpha: float = 0.0) -> None:
        """DBA takes each item's neighbours from the whole index; a shard sees only its
        part, so a sharded index has none."""
        if neighbours is not None:
            raise StoreError(f"{self.directory}: {NO_DBA}")

    def compact(self) -> None:
        for shard in self.shards:
            shard.compact()

    def due_merge(self) -> bool:
        return any(shard.due_merge() for shard in self.shards)

    def verify(self) -> None:
        """Every byte of every shard (the model copy with shard 0) against its checksum."""
        for shard in self.shards:
            shard.verify()

    def scrub(
        self, bytes_per_s: float | None = None, stop: threading.Event | None = None
    ) -> list[tuple[str, str]]:
        """`IndexStore.scrub` on every shard in turn; the damaged segments of all."""
        for shard in self.shards:
            if stop is not None and stop.is_set():
                break
            shard.scrub(bytes_per_s, stop)
        return self.damaged_segments()

    def damaged_segments(self) -> list[tuple[str, str]]:
        """("shard-001/3", reason) of every segment out of service (lock-free)."""
        return [
            (f"{name}/{number}", reason)
            for name, shard in zip(self.manifest.shards, self.shards, strict=True)
            for number, reason in shard.damaged_segments()
        ]

    # -- reporting and lifetime ---------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """`IndexStore.info` over the shards: totals, each shard's segments and files
        (named inside the index folder), and the top-level files."""
        return combine_info(self.directory, self.manifest, [shard.info() for shard in self.shards])

    def close(self) -> None:
        """Close every shard (unsaved changes are lost)."""
        for shard in self.shards:
            shard.close()

    def __enter__(self) -> ShardedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def combine_info(
    directory: Path, manifest: ShardsManifest, parts: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """`IndexStore.info` of every shard (in order) as the info of the sharded index:
    totals, each shard's segments and files (named inside the index folder), and the
    top-level files."""
    files = {SHARDS_FILE: mf.sha256_file(directory / SHARDS_FILE).to_json()}
    for name, part in zip(manifest.shards, parts, strict=True):
        files.update({f"{name}/{file}": entry for file, entry in part["files"].items()})
    updated = [p["updated"] for p in parts if p["updated"]]
    return {
        "directory": str(directory),
        "format_version": min(p["format_version"] for p in parts),
        "shards": len(parts),
        "shard_format": f"{SHARDS_FILE} version {VERSION}, rule {RULE}",
        "generation": [p["generation"] for p in parts],
        "count": sum(p["count"] for p in parts),
        "deleted": sum(p["deleted"] for p in parts),
        "factory": manifest.factory,
        "dim": manifest.dim,
        "metric": mf.METRIC,
        "fingerprint": manifest.fingerprint,
        "model_file": parts[0]["model_file"],
        "trained": all(p["trained"] for p in parts),
        "search_params": parts[0]["search_params"],
        "filter_fields": parts[0]["filter_fields"],  # one setting, given every shard
        "tuning": parts[0]["tuning"],
        "calibration": parts[0]["calibration"],
        "gpu": parts[0]["gpu"],
        "segments": [
            {"shard": name, **segment}
            for name, part in zip(manifest.shards, parts, strict=True)
            for segment in part["segments"]
        ],
        "growing": sum(p["growing"] for p in parts),
        "bytes_on_disk": sum(entry["bytes"] for entry in files.values()),
        "files": files,
        "unsaved_changes": any(p["unsaved_changes"] for p in parts),
        "journal_pending": sum(p["journal_pending"] for p in parts),
        "created": manifest.created,
        "updated": max(updated) if updated else None,
    }


def is_index(directory: str | os.PathLike[str]) -> bool:
    """Whether `directory` holds an index: one store (manifest.json) or sharded."""
    return (Path(directory) / mf.MANIFEST).is_file() or is_sharded(directory)


def open_index(directory: str | os.PathLike[str], **options: Any) -> IndexStore | ShardedStore:
    """Open the index in `directory`: a ShardedStore for a sharded index, an IndexStore
    for a store directory; `options` as for `IndexStore.open`. Every command and the
    service open indexes through this."""
    directory = Path(directory)
    if is_sharded(directory):
        return ShardedStore.open(directory, **options)
    if (directory / PLAN_FILE).is_file() and not (directory / mf.MANIFEST).exists():
        raise StoreError(
            f"{directory} is a sharded build that has not finished: run the same "
            "`vitrieval-index build --embeddings ... --shards N` again to resume it"
        )
    return IndexStore.open(directory, **options)


def check_writable(out: Path) -> None:
    """StoreError if another process (a running server) holds the writer lock of the
    index in `out`, one store or every shard: checked before long work (a build's
    embedding, a tune's measuring) that a refused save would waste."""
    for directory in store_directories(out):
        JournalOwner.check_free(directory)
