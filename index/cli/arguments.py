"""The argparse objects command modules receive, as the small contracts they use.

argparse's own classes for these (`_SubParsersAction`, `_ArgumentGroup`) are private:
these Protocols name what a module calls on them, and both argparse's objects and
test doubles satisfy them.
"""

from __future__ import annotations

import argparse
from typing import Any, Protocol


class Subcommands(Protocol):
    """What `ArgumentParser.add_subparsers()` returns: a command adds itself to it."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


class ArgumentAdder(Protocol):
    """An `ArgumentParser` or one of its argument groups: options are added to it."""

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action: ...
