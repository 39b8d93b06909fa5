"""`vitrieval-index`: build, inspect and search indexes (commands listed by --help)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitrieval-index", description=__doc__.splitlines()[0])
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        print(
            "vitrieval-index: no index commands are available in this version yet; "
            "train and export a model with vitrieval-train",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
