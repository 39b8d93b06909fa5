"""`vitrieval-index snapshot` and `restore`: an index as one tar file, and back
(index/store/snapshot.py). The file is written under a temporary name and renamed
when complete, so a killed snapshot leaves either the whole file or nothing."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import Subcommands


def add_snapshot_commands(sub: Subcommands) -> None:
    snapshot = sub.add_parser(
        "snapshot", help="write an index's committed items and its journal as one tar file"
    )
    snapshot.add_argument("index")
    snapshot.add_argument("--out", required=True, metavar="FILE", help="the tar file to write")
    snapshot.set_defaults(handler=_snapshot)
    restore = sub.add_parser("restore", help="make an index folder from a snapshot file")
    restore.add_argument("snapshot", metavar="FILE")
    restore.add_argument("--out", required=True, metavar="DIR", help="a new index folder")
    restore.set_defaults(handler=_restore)


def _snapshot(args: argparse.Namespace) -> int:
    from ..atomic import atomic_path
    from ..shards import is_sharded
    from ..shards.store import check_writable
    from ..store import StoreError
    from ..store.snapshot import write_snapshot

    index, out = Path(args.index), Path(args.out)
    if is_sharded(index):
        raise StoreError(f"{index} is a sharded index: snapshot each shard folder on its own")
    try:
        check_writable(index)
    except StoreError:
        raise StoreError(
            f"{index} is in use by a running server: take the snapshot through it "
            "(POST /v1/collections/{name}/snapshots) or stop it first"
        ) from None
    with atomic_path(out) as temporary, temporary.open("wb") as fh:
        info = write_snapshot(index, fh)
    size = out.stat().st_size
    print(f"{out}: generation {info.generation}, {info.count:,} items committed "
          f"(and the journal's rows), {len(info.files)} files, {size:,} bytes")  # fmt: skip
    return 0


def _restore(args: argparse.Namespace) -> int:
    from ..store import IndexStore
    from ..store.snapshot import restore_snapshot

    source, out = Path(args.snapshot), Path(args.out)
    if not source.is_file():
        raise ValueError(f"snapshot file not found: {source}")
    with source.open("rb") as fh:
        info = restore_snapshot(fh, out)
    with IndexStore.open(out) as store:  # checks it opens, its journal replayed
        count = len(store)
    print(f"{out}: restored generation {info.generation}, {count:,} items")
    return 0
