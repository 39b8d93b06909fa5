"""`vitrieval-index build --embeddings EMB --shards N`: a sharded index (index.shards),
apart from cli.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..shards.layout import PLAN_FILE, is_sharded, read_shards_manifest
from .common import checked_save_every


def add_shards_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shards",
        type=int,
        metavar="N",
        help="with --embeddings: split the index into N shards built in parallel (default 1, "
        "one store; an existing sharded index keeps its count)",
    )


def check_shards_option(args: argparse.Namespace) -> None:
    """--shards must be >= 1, and above 1 needs --embeddings."""
    shards = getattr(args, "shards", None)
    if shards is None:
        return
    if shards < 1:
        raise ValueError(f"--shards must be at least 1, got {shards}")
    if shards > 1 and getattr(args, "images", None) is not None:
        raise ValueError(
            "--shards needs --embeddings: embed the images first (`vitrieval-index embed "
            "--model M.onnx --images ... --out EMB`), then `vitrieval-index build --embeddings "
            f"EMB --shards {shards} --out INDEX`"
        )


def existing_shards(out: Path) -> int | None:
    """The shard count of the sharded index in `out`, or of its unfinished build (None:
    neither)."""
    if is_sharded(out):
        return len(read_shards_manifest(out).shards)
    try:
        plan = json.loads((out / PLAN_FILE).read_text(encoding="utf-8"))
        return int(plan["shards"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def wants_shards(args: argparse.Namespace, out: Path) -> bool:
    """Whether `build --embeddings` makes or extends a sharded index."""
    return (args.shards or 1) > 1 or existing_shards(out) is not None


def build_sharded_from_args(
    args: argparse.Namespace, folder, model: Path | None, factory: str | None
) -> int:
    """Build, resume or extend the sharded index `--out`; `factory` resolved (None: the
    existing index's or unfinished build's own)."""
    from ..shards.build import build_sharded

    out = Path(args.out)
    shards = args.shards or existing_shards(out) or 1
    save_every = checked_save_every(args.save_every, 1_000_000)
    run_shards = None
    if getattr(args, "ray", None):  # each shard a Ray task (distributed/build.py)
        from vitrieval.distributed.build import shard_runner

        run_shards = shard_runner(args.ray)
    report = build_sharded(
        folder.folder, out, str(model or ""), factory, shards, save_every, run_shards
    )
    present = f", {report['already_present']} already present" if report["already_present"] else ""
    print(
        f"indexed {report['indexed']} of {report['total']} embeddings from {folder.folder}"
        f"{present} in {report['seconds']:.1f}s ({report['images_per_s']:.0f} vectors/s); "
        f"{out} holds {report['index_size']} items in {shards} shards"
    )
    return 0
