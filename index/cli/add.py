"""`vitrieval-index add`: add images to an index, a list of them or one image with its
key, label and metadata given on the command line."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from ..evaluation.datasets import Item
from .arguments import Subcommands
from .common import add_runtime_options

BuildFunction = Callable[[argparse.Namespace, "list[Item] | None"], int]
"""What `add` runs once its items are known: `build` into the existing index."""


def add_add_command(sub: Subcommands, build: BuildFunction) -> None:
    """The `add` subcommand; `build(args, items)` does the work (index.cli's build)."""
    add = sub.add_parser(
        "add",
        help="add images to an index, with the model it was built with",
        description="Add a folder or CSV list of images (--images), or one image (IMAGE "
        "--key K [--label L] [--metadata JSON]), to an existing index.",
    )
    add.add_argument("index")
    add.add_argument("image", nargs="?", help="one image file to add (with --key)")
    add.add_argument("--images", help="folder or CSV list (instead of IMAGE)")
    add.add_argument("--key", help="with IMAGE: the key the index stores it under")
    add.add_argument("--label", help="with IMAGE: its label")
    add.add_argument(
        "--metadata",
        metavar="JSON",
        help='with IMAGE: its metadata, a JSON object (e.g. \'{"colour": "red"}\'), or @FILE',
    )
    add.add_argument("--model", help="must have the index's fingerprint")
    add.add_argument("--labels-from-folders", action="store_true")
    add.add_argument("--save-every", type=int, default=2048)
    add_runtime_options(add)
    add.set_defaults(handler=lambda args: run_add(args, build))


def run_add(args: argparse.Namespace, build: BuildFunction) -> int:
    """Check the arguments, then build into the existing index `args.index`."""
    from ..shards import is_index
    from ..store import StoreError

    if not is_index(args.index):
        raise StoreError(f"{args.index} is not an index; create one with `vitrieval-index build`")
    args.out = args.index
    args.factory = None
    return build(args, one_image(args))


def one_image(args: argparse.Namespace) -> list[Item] | None:
    """The single item of `add INDEX IMAGE --key K`, or None when --images lists them."""
    from ..evaluation.datasets import parse_metadata

    single = [flag for flag in ("key", "label", "metadata") if getattr(args, flag) is not None]
    if (args.image is None) == (args.images is None):
        raise ValueError(
            "add needs exactly one of IMAGE (one file, with --key) and --images (a folder "
            "or CSV list)"
        )
    if args.image is None:
        if single:
            raise ValueError(
                f"--{single[0]} applies to one IMAGE; a CSV list carries its own "
                "(columns key, label, metadata)"
            )
        return None
    if args.labels_from_folders:
        raise ValueError("--labels-from-folders applies to --images; pass --label for IMAGE")
    if not args.key:
        raise ValueError(f"add {args.image} needs --key: the key the index stores it under")
    path = Path(args.image)
    if not path.is_file():
        raise ValueError(f"image file not found: {path}")
    metadata = None
    if args.metadata is not None:
        text = args.metadata
        if text.startswith("@"):
            text = Path(text[1:]).read_text(encoding="utf-8")
        metadata = parse_metadata(text, "--metadata")
    return [Item(key=args.key, label=args.label, path=path.absolute(), metadata=metadata)]
