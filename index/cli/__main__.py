"""`python -m index.cli`: the `vitrieval-index` command."""

import sys

from .commands import main

if __name__ == "__main__":  # not when a tool walks the package and imports this module
    sys.exit(main())
