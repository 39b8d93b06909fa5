"""`vitrieval-serve`: the HTTP search service."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vitrieval-serve", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    print(
        "vitrieval-serve: the search service is not available in this version yet", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
