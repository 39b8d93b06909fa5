"""`vitrieval-index snapshot` and `restore`: an index as one tar file, and back
(index/store/snapshot.py), a local file or a URL (index/remote_files.py). A killed
snapshot leaves either the whole file or nothing."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import Subcommands


def add_snapshot_commands(sub: Subcommands) -> None:
    snapshot = sub.add_parser(
        "snapshot", help="write an index's committed items and its journal as one tar file"
    )
    snapshot.add_argument("index")
    snapshot.add_argument(
        "--out",
        required=True,
        metavar="FILE|URL",
        help="the tar file to write: a path, or a URL such as s3://bucket/key (the s3 extra)",
    )
    snapshot.set_defaults(handler=_snapshot)
    restore = sub.add_parser("restore", help="make an index folder from a snapshot file")
    restore.add_argument("snapshot", metavar="FILE|URL")
    restore.add_argument("--out", required=True, metavar="DIR", help="a new index folder")
    restore.set_defaults(handler=_restore)


def _snapshot(args: argparse.Namespace) -> int:
    from ..remote_files import is_url, writing
    from ..shards import is_sharded
    from ..shards.store import check_writable
    from ..store import StoreError
    from ..store.snapshot import write_snapshot

    index, out = Path(args.index), args.out
    if is_sharded(index):
        raise StoreError(f"{index} is a sharded index: snapshot each shard folder on its own")
    try:
        check_writable(index)
    except StoreError:
        raise StoreError(
            f"{index} is in use by a running server: take the snapshot through it "
            "(POST /v1/collections/{name}/snapshots) or stop it first"
        ) from None
    with writing(out) as fh:
        info = write_snapshot(index, fh)
    size = "" if is_url(out) else f", {Path(out).stat().st_size:,} bytes"
    print(f"{out}: generation {info.generation}, {info.count:,} items committed "
          f"(and the journal's rows), {len(info.files)} files{size}")  # fmt: skip
    return 0


def _restore(args: argparse.Namespace) -> int:
    from ..remote_files import reading
    from ..store import IndexStore
    from ..store.snapshot import restore_snapshot

    out = Path(args.out)
    with reading(args.snapshot) as fh:
        info = restore_snapshot(fh, out)
    with IndexStore.open(out) as store:  # checks it opens, its journal replayed
        count = len(store)
    print(f"{out}: restored generation {info.generation}, {count:,} items")
    return 0
