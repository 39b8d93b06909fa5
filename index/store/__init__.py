"""Crash-safe, verified FAISS index store: the index directory of DESIGN.md section 2.

This docstring is the contract of the on-disk format (format_version 1)::

    INDEX/
      manifest.json       the commit point (below)
      model.onnx          copy of the exported model the vectors came from (absent when
                          the store was created without a model file)
      index.<g>.faiss     faiss.write_index output of the CPU index of generation g
      items.<g>.sqlite    SQLite item table of generation g
      .lock               advisory lock taken by save() (empty; never read)

manifest.json::

    {"format_version": 1, "generation": g,
     "model": {"file": "model.onnx", "fingerprint": "<sha256 of the weights>",
               "sha256": "<of the file>", "bytes": n} | null,
     "dim": D, "metric": "inner_product", "factory": "Flat", "count": <live items>,
     "files": {"index.<g>.faiss": {"sha256": ..., "bytes": ...},
               "items.<g>.sqlite": {"sha256": ..., "bytes": ...}},
     "created": "<ISO 8601 UTC>", "updated": "<ISO 8601 UTC>"}

- "model" is null without a fingerprint; with a fingerprint but no model file, "file",
  "sha256" and "bytes" are null. The model copy is normally model.onnx; a store that
  replaces (overwrite=True) a committed index with another model writes model.<g>.onnx
  instead, so the committed model is never overwritten before the commit.
- index.<g>.faiss: an IndexIDMap2 around the factory index, with FAISS ids = item
  ids; except IVF factories ("IVF256,Flat", "IVF256,PQ16"), whose index holds the
  item ids itself (IDMap2 over IVF corrupts its id map on remove_ids). Metric: inner
  product (vectors are L2-normalised, so scores are cosines). The IVF nprobe and HNSW
  efSearch settings are saved inside this file.
- items.<g>.sqlite (rollback journal, not WAL)::

      items(id INTEGER PRIMARY KEY, key TEXT NOT NULL, label TEXT, path TEXT,
            metadata TEXT NOT NULL DEFAULT '{}' (a JSON object),
            vector BLOB NOT NULL (dim little-endian float32), deleted INTEGER NOT NULL
            DEFAULT 0)
      UNIQUE INDEX items_live_key ON items(key) WHERE deleted = 0
      INDEX items_live_label ON items(label) WHERE deleted = 0

  Every row's id is in the FAISS index (so FAISS ntotal == number of rows). deleted = 1
  marks a tombstone: an item removed from an index type that cannot remove vectors
  (HNSW); its key is free again (the uniqueness holds among live rows only).

Save: write the new generation's files under temporary names, fsync, rename, fsync
the folder; then atomically replace manifest.json (the commit point); then delete
older generations and temp files of interrupted saves. Load: read manifest.json,
check the size and sha256 of every file it lists (model copy included) and refuse
any mismatch or missing file with StoreError; files it does not list are ignored.
A crash at any moment therefore leaves the last committed generation loadable.

Removal: Flat, SQ and PQ (in IDMap2) and IVF indexes remove vectors directly; other
types (HNSW) keep tombstones, filtered out at search time, and compact() rebuilds the
FAISS index from the live vectors kept in SQLite. save() compacts automatically when
tombstones exceed 20% of the vectors in the index.

GPU: with GPU FAISS and gpu="auto" (or "cuda"), search and training run on a GPU copy
(faiss.index_cpu_to_all_gpus); the CPU index stays authoritative and is what is saved.
gpu="cpu" never uses a GPU; gpu="cuda" without one is a StoreError.
"""

from .core import AUTO_COMPACT_FRACTION, IndexStore
from .errors import KeyExistsError, StoreError
from .items import Hit, ItemRecord
from .legacy import upgrade
from .vectors import suggest_factory

__all__ = [
    "AUTO_COMPACT_FRACTION",
    "Hit",
    "IndexStore",
    "ItemRecord",
    "KeyExistsError",
    "StoreError",
    "suggest_factory",
    "upgrade",
]
