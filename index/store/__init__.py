"""Crash-safe, verified FAISS index store in segments: the index directory.

This docstring is the contract of the on-disk format (format_version 4)::

    INDEX/
      manifest.json            the commit point (below)
      model.onnx               copy of the exported model the vectors came from
      quantizer.<g>.faiss      the trained, empty index new segments start from (IVF,
                               PQ: factories that train; absent for Flat and HNSW)
      seg.<n>.faiss            sealed segment n: its FAISS index (store layout below)
      seg.<n>.items.sqlite     sealed segment n: items(id, key, label, path, metadata,
                               row); row = the item's position in seg.<n>.vectors.npy;
                               fields(path, value, id), the field index filters read,
                               and field_set(paths), what it covers (_field_index.py)
      seg.<n>.vectors.npy      sealed segment n: float32 (rows, dim), the exact vectors
                               (absent for "Flat": its FAISS file holds them)
      seg.<n>.columns          sealed segment n: its indexed paths' values as columns,
                               written with it, memory-mapped (_columns.py): a number
                               column (sorted int64 ids, float64 values) per path with
                               at most one number an item, all integers within
                               ±2**53; a text column (ids, int32 codes, dictionary)
                               per path with at most one string or boolean an item
      dba.<g>.ids.npy          the derived DBA index (_dba.py), computed at
      dba.<g>.npy              generation g: sorted int64 ids of every live item, and
                               float32 (n, dim) their DBA vectors in that order; only
                               with `dba` set
      seg.<n>.del.<g>.npy      segment n's tombstones as of generation g (sorted int64)
      journal.sqlite           the write-ahead journal of the growing segment (_journal.py)
      journal.rejected.jsonl   journal rows `verify --repair` set aside (_journal_repair.py)
      .readers/                one locked lease per open store: the files of the
                               generation it reads (_leases.py)
      .lock, .journal.lock     advisory locks (empty; never read)

manifest.json::

    {"format_version": 4, "generation": g, "model": {...} | null, "dim": D,
     "metric": "inner_product", "factory": "Flat", "count": <live items>,
     "next_id": <first unused item id>,
     "search_params": {"nprobe": 8, "oversample": 4 (compressed codes, when set)},
     "tuning": null | {"target_recall": 0.95, "recall": r, "held_out_recall": r',
                       "k": 10, "queries": 1000, "params": {"nprobe": 32, ...},
                       "latency_ms": t, "items": n, "reached": true, "tuned": "<ISO>"},
     "calibration": null | {"precision": 0.99, "threshold": t, "levels": [{"precision":
                    0.9, "threshold": t, "reached": true, "measured_precision": p,
                    "precision_interval": [lo, hi], "recall": r, "recall_interval":
                    [lo, hi], "pairs": n}, ...], "images": 200, "copies": 1000,
                    "seed": 0, "items": n, "calibrated": "<ISO>"},
     "filter_fields": null | ["colour", "shop.city"],
     "dba": null | {"neighbours": 2, "alpha": 3.0, "generation": g', "count": n,
                    "ids": {"file": "dba.<g'>.ids.npy", "sha256": ..., "bytes": ...},
                    "vectors": {"file": "dba.<g'>.npy", "sha256": ..., "bytes": ...}},
     "quantizer": {"file": "quantizer.<g>.faiss", "sha256": ..., "bytes": ...} | null,
     "segments": [{"number": n, "rows": r,
                   "files": {"seg.<n>.faiss": {"sha256": ..., "bytes": ...}, ...},
                   "tombstones": {"file": "seg.<n>.del.<g>.npy", "sha256": ...,
                                  "bytes": ..., "count": t} | null,
                   "rows_in_id_order": true (absent: a segment of an older version,
                                         whose rows are checked once when read)}, ...],
     "created": "<ISO 8601 UTC>", "updated": "<ISO 8601 UTC>"}

- Sealed segments are immutable: written once (temp file, fsync, rename), checksummed
  when sealed, never rewritten. Item ids are global and increase with every add, so
  ties (equal scores) are ordered by id across segments as within one. A segment
  written now holds its items in ascending id order (_id_order.py: a merge merges its
  segments' rows by id) and is marked `rows_in_id_order`; an older merge could write
  them out of order, so an unmarked segment is checked when first read
  (_sealed_segment.py) and, if so, each id's row read from its rows in id order.
- FAISS layout: an IndexIDMap2 around the factory index, ids = item ids; except IVF
  factories, whose index holds the item ids itself (IDMap2 over IVF corrupts its id
  map on remove_ids). Inner product on L2-normalised vectors (scores are cosines).
- The growing segment lives in memory (_memory_segment.py): every add goes there,
  behind the journal. Removing an item of a sealed segment adds a tombstone.
- Save: seal the growing segment into new segment files, write the tombstone lists
  that changed (under the new generation's number), write the model copy or the
  quantizer if new, then atomically replace manifest.json (the commit point), then
  delete the files no longer listed that no live reader's lease names. Its cost
  follows the change. Searches run meanwhile: files are written outside the store's
  lock.
- Merge (_merge_policy.py, _persist.py): small segments, and segments more than 20% tombstones,
  are folded into a new segment (tombstoned items dropped), committed the same way;
  the merged segments' files are verified before they are read.
- DBA (_dba.py): with `dba` set, every commit (save, merge) names the derived DBA
  index of exactly the items it commits: computed again before the manifest when
  those items differ from the current one's (ids are never reused, vectors never
  change: equal ids, equal DBA), kept otherwise. Segments, seals and merges know
  nothing of it. An augmented search ranks exactly against it, and is refused (a
  StoreError saying to save) while it is missing, of other settings, or the store
  holds unsaved adds or removes: stale DBA vectors never answer.
- Search (_search.py): every segment answers its top k, merged by score then id; a
  filter (filters.py) is evaluated per segment, each condition from its columns, its
  field index or its metadata (`filtering.leaf_ids` chooses), and searched exactly
  over a small allowed subset or by a widened ID-selector search (_filter_plans.py).
- Open: read the manifest, check every listed file's size, parse the headers, and
  memory-map the segments (FAISS's IO_FLAG_MMAP_IFC, for IVF lists and flat
  codes; numpy's mmap for the vectors; SQLite opened read-only in place): nothing is
  read whole. The model copy, the quantizer and the tombstone lists (small) are
  verified in full. Every byte is verified by `verify()`, `open(verify=True)`, before
  a merge reads a segment, and by the service's paced scrub (segments only: the
  derived DBA index is checked by `verify()`); a segment that fails is taken out of
  service.
- A crash at any moment leaves the last committed generation loadable: nothing a
  manifest lists is ever overwritten, and files it does not list are never read.

`upgrade()` (`vitrieval-index upgrade DIR`) converts older formats in place. Format 2
is format 3 without the columns files: it opens read-only (save, merge and a
journalling open ask for the upgrade), its field index answering every filter; the
upgrade writes the columns of its segments (every byte of a segment verified first).
Format 3 is this one with DBA vectors inside segments (seg.<n>.dba.faiss/.npy) and
`dba` holding the settings alone: it opens read-only the same way, those files left
unread (an augmented search asks for the upgrade); the upgrade computes the derived
DBA index and commits format 4 without them, removed after the commit. Format 1 (one
generation: index.<g>.faiss and items.<g>.sqlite holding every vector) does not
open: `open` raises a StoreError naming the upgrade. Only the upgrade reads it
(_upgrade_format1.py, which nothing the store imports for open, search or save
imports), sealing it into segments with its journalled mutations; the manifest is
the commit point, as for every save.

GPU: with GPU FAISS and gpu="auto" (or "cuda"), searches run on GPU copies of the
segments; the CPU files stay authoritative. gpu="cpu" never uses a GPU; gpu="cuda"
without one is a StoreError.
"""

# The public surface: what the rest of vitrieval imports from the store. The modules
# named with a leading underscore are its internals (docs/design.md maps them);
# errors, filters, request, manifest, segment_contract, validation and upgrade are
# public modules of their own.
from ._damage import damage_code
from ._field_index import FieldSelection, flatten
from ._index_store import AUTO_COMPACT_FRACTION, IndexStore
from ._items import Hit, ItemRecord, ListedItem, ScrollPage
from ._journal import JournalOwner, JournalWriteError
from ._journal_repair import REJECTED_FILE, repair_journal
from ._loading import OTHER_MODEL_ADVICE
from ._vectors import (
    VectorIndex,
    check_gpu_mode,
    faiss_cpu_reason,
    new_faiss_index,
    suggest_factory,
)
from .errors import DamagedIndexError, FolderNotEmptyError, KeyExistsError, StoreError
from .upgrade import upgrade

__all__ = [
    "AUTO_COMPACT_FRACTION",
    "OTHER_MODEL_ADVICE",
    "REJECTED_FILE",
    "DamagedIndexError",
    "FieldSelection",
    "FolderNotEmptyError",
    "Hit",
    "IndexStore",
    "ItemRecord",
    "JournalOwner",
    "JournalWriteError",
    "KeyExistsError",
    "ListedItem",
    "ScrollPage",
    "StoreError",
    "VectorIndex",
    "check_gpu_mode",
    "damage_code",
    "faiss_cpu_reason",
    "flatten",
    "new_faiss_index",
    "repair_journal",
    "suggest_factory",
    "upgrade",
]
