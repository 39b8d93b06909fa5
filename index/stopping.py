"""Ctrl-C in the long `vitrieval-index` commands (build, embed, add): say at once that
the command is stopping, keep what was done, and say how to go on.

The first Ctrl-C prints one line straight away (from the signal handler, so it does not
wait for the batch under way) and raises KeyboardInterrupt; the work loops save what
they can resume from and raise `Stopped`, naming what was kept; the CLI ends with the
command line to run again. A second Ctrl-C is Python's default (quit at once).
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

PROGRAM = "vitrieval-index"
RESUMABLE_COMMANDS: frozenset[str] = frozenset({"build", "embed", "add", "duplicates", "reembed"})
"""The commands whose work a re-run continues (each skips what is already done)."""


class Stopped(KeyboardInterrupt):
    """Ctrl-C, after the work done so far was kept; `kept` says what (one clause)."""

    def __init__(self, kept: str) -> None:
        super().__init__(kept)
        self.kept = kept


@contextmanager
def stop_on_ctrl_c(command: str) -> Iterator[None]:
    """Within the block, the first Ctrl-C prints that `command` is stopping, then raises
    KeyboardInterrupt; the handler found is put back afterwards. Only in the main thread
    (Python runs signal handlers there alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    found = signal.getsignal(signal.SIGINT)

    def stopping(signum: int, frame: FrameType | None) -> None:
        print(
            f"{PROGRAM} {command}: stopping, keeping what is done (Ctrl-C again to quit at once)",
            file=sys.stderr,
            flush=True,
        )
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stopping)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, found)


def stopped_message(command: str, argv: Sequence[str], error: KeyboardInterrupt) -> str:
    """The last line of a stopped command: what was kept and the command to go on with."""
    kept = f": {error.kept}" if isinstance(error, Stopped) else ""
    if command not in RESUMABLE_COMMANDS:
        return f"{PROGRAM} {command}: interrupted{kept}"
    again = shlex.join([PROGRAM, *argv])
    return f"{PROGRAM} {command}: stopped{kept}; to go on, run the same command again: {again}"
