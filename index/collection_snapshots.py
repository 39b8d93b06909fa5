"""The snapshots of a data folder's collections: taken, listed, deleted.

A snapshot of collection NAME is one tar file, DIR/snapshots/NAME/ID.tar
(index/store/snapshot.py says what it holds). It is written under a temporary name
and renamed when complete, so a snapshot killed part way is absent, never half there.
A new collection is made from one with `DataFolder.restore`. Deleting a collection
moves its snapshots aside (snapshots/.deleted-NAME-XXXXXXXX), out of reach of a later
collection of that name, which must not restore another's backups by id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .atomic import atomic_path
from .collections import DataFolder, UnknownCollection, new_snapshot_id
from .shards import is_sharded
from .store import StoreError
from .store.snapshot import SnapshotInfo, read_snapshot_info, write_snapshot


@dataclass(frozen=True)
class StoredSnapshot:
    """One kept snapshot: its id, collection, file size and what it holds."""

    snapshot: str
    collection: str
    bytes: int
    info: SnapshotInfo

    def to_json(self) -> dict[str, Any]:
        """Its id, collection and size, and what it holds (the files' checksums aside)."""
        held = {field: getattr(self.info, field) for field in ("generation", "count", "created")}
        named = {"snapshot": self.snapshot, "collection": self.collection}
        return named | {"bytes": self.bytes} | held


def take_snapshot(folder: DataFolder, collection: str) -> StoredSnapshot:
    """Snapshot collection `collection` (a name or an alias) beside its writer."""
    name = folder.resolve(collection)
    directory = folder.directory(name)
    if is_sharded(directory):
        raise StoreError(f"collection {name!r} is a sharded index: snapshot each shard alone")
    snapshot = new_snapshot_id()
    target = folder.snapshot_folder(name) / f"{snapshot}.tar"
    with atomic_path(target) as temporary, temporary.open("wb") as fh:
        info = write_snapshot(directory, fh)
    return StoredSnapshot(snapshot, name, target.stat().st_size, info)


def list_snapshots(folder: DataFolder, collection: str) -> list[StoredSnapshot]:
    """The snapshots kept of `collection` (a collection's name, also after it was
    deleted), oldest first."""
    found = []
    for path in sorted(folder.snapshot_folder(collection).glob("*.tar")):
        try:
            with path.open("rb") as fh:
                info = read_snapshot_info(fh)
        except (StoreError, OSError):
            continue  # not one of ours, or unreadable: listed by nobody, removed by hand
        found.append(StoredSnapshot(path.stem, collection, path.stat().st_size, info))
    return found


def delete_snapshot(folder: DataFolder, collection: str, snapshot: str) -> None:
    """Delete one kept snapshot; UnknownCollection when there is no such snapshot."""
    path = folder.snapshot_file(snapshot, collection)
    try:
        path.unlink()
    except FileNotFoundError:
        raise UnknownCollection(f"no snapshot {snapshot!r}") from None
