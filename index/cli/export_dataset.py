"""`vitrieval-index export-dataset`: a dataset split written as image files (a folder
per class) and the CSV list `build` and `bench` read."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import Subcommands


def add_export_dataset_command(sub: Subcommands) -> None:
    export = sub.add_parser(
        "export-dataset", help="write a dataset split as image files (a folder per class + CSV)"
    )
    export.add_argument("--dataset", default="digits", help="digits|cub|cars|sop|folder|csv")
    export.add_argument("--data-root", help="dataset folder or CSV (all but digits)")
    export.add_argument("--split", default="test", choices=("train", "test", "all"))
    export.add_argument("--image-size", type=int, default=32, help="digits only: side in pixels")
    export.add_argument("--seed", type=int, default=0)
    export.add_argument("--out", required=True, help="folder to write")
    export.set_defaults(handler=_export_dataset)


def _export_dataset(args: argparse.Namespace) -> int:
    from ..evaluation.datasets import load_dataset
    from ..pipeline.sources import write_image_folder

    split = load_dataset(args.dataset, args.data_root, seed=args.seed, image_size=args.image_size)
    items = {"train": split.train, "test": split.test, "all": split.train + split.test}[args.split]
    listing = write_image_folder(items, Path(args.out))
    print(
        f"wrote {len(items)} images of {split.name} ({args.split}) to {args.out}; list: {listing}"
    )
    return 0
