"""What the `vitrieval-index` commands share: the runtime options and the embedder
they build from them."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_runtime_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--batch-size", type=int, default=64, help="images per model call")


def embedder_from_args(model: Path, args: argparse.Namespace):
    """The Embedder of `model` with the command's --device and --batch-size."""
    from .embedder import Embedder

    return Embedder(model, device=args.device, batch_size=args.batch_size)
