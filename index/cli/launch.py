"""The console scripts' entry points: Ctrl-C while a command is still starting.

A command's first half second is spent importing numpy, ONNX Runtime, FAISS or torch,
before its own Ctrl-C handling exists; a Ctrl-C then would print a KeyboardInterrupt
traceback from deep inside an import. The scripts `pyproject.toml` installs call these
functions instead of each command's `main`: this module imports nothing heavy, imports
the command inside a guard, and turns a Ctrl-C that arrives before the command has
taken over into one line and exit status 130. Once `main` runs, its own handling
(saving what was done, naming the command to run again) answers Ctrl-C as before.
A Ctrl-C in the interpreter's own start-up (its `site` module, the first few tens of
milliseconds, before any line of the script runs) still ends in Python's fatal-error
message: nothing of vitrieval has run by then, and nothing can catch it.
"""

from __future__ import annotations

import importlib
import sys

INTERRUPTED_STATUS = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C


def run_command(program: str, module: str) -> int:
    """Import `module` and return its `main()`, answering an early Ctrl-C in one line."""
    try:
        main = importlib.import_module(module).main
        return main()
    except KeyboardInterrupt:
        print(f"{program}: stopped while starting; nothing was done", file=sys.stderr)
        return INTERRUPTED_STATUS


def index_main() -> int:
    """`vitrieval-index`."""
    return run_command("vitrieval-index", "vitrieval.index.cli")


def train_main() -> int:
    """`vitrieval-train`."""
    return run_command("vitrieval-train", "vitrieval.training.cli")


def serve_main() -> int:
    """`vitrieval-serve`."""
    return run_command("vitrieval-serve", "vitrieval.service.cli")
