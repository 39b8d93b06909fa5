"""`vitrieval-index`, the command line: one module per command group.

`commands` builds the parser and runs a command; `add`, `bench`, `configure`, `search`
and `shards` declare their commands' options; `common` and `arguments` hold what they
share; `launch` holds the console scripts' entry points. `python -m index.cli` runs it.
"""

__all__ = ["build_parser", "main"]


def __getattr__(name: str) -> object:
    # imported on first use, so that importing launch.py (the console scripts' entry
    # points, before their Ctrl-C guard) imports nothing heavy: no typing, no numpy
    if name in __all__:
        from . import commands

        return getattr(commands, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
