"""Ctrl-C and SIGTERM stop a training run cleanly, at a point `--resume` continues from.

Left to its default action, SIGTERM ends the process on the spot: the data-loader worker
processes outlive it until they notice (seconds later, or never when one is stuck on a
full pipe), and a checkpoint may lose its metrics row. Within `stoppable(run, command)`
(`fit`, its lacvit/ce methods, and `pretrain`):

- SIGTERM, like Ctrl-C (SIGINT), raises `Interrupted`, a KeyboardInterrupt, in the main
  thread, so the `finally` blocks and context managers on the way out run;
- `loader_batches(loader)` iterates a DataLoader and shuts its worker processes down when
  the loop ends, however it ends (an exception's traceback would otherwise keep the
  iterator, and its workers, alive until the process exits);
- `deferred()` holds a signal back while a checkpoint and its metrics row are written, so
  a run never stops between the two;
- on the way out one line on stderr says which checkpoint the run folder holds and the
  command that continues from it (`RESUME_COMMAND_ENV` names another, e.g. `make demo`);
- a second signal while the run is stopping takes the default action at once.

Handlers are installed only in the main thread and only over the defaults (Python's
KeyboardInterrupt for SIGINT, termination for SIGTERM): an application's own handlers
are left alone. `exit_status` is what the command line returns: 130 after Ctrl-C, 143
after SIGTERM (128 + the signal number, what a shell reports for a process it killed).
This module imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from .run_folder import CHECKPOINT_DIR, STATE_FILE

RESUME_COMMAND_ENV = "VITRIEVAL_RESUME_COMMAND"
"""Set by a caller that runs the training command for the user (the Makefile sets it to
`make demo`): the stop line names it as the command that continues the run, instead
of `vitrieval-train COMMAND --out RUN --resume`."""

SIGNALS = (signal.SIGINT, signal.SIGTERM)
SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM. `reported`: its line has been printed."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or signal.Signals(signum).name)
        self.signum = int(signum)
        self.message = message
        self.reported = False

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class _Handlers:
    """The process's one set of installed handlers and the state they share."""

    def __init__(self) -> None:
        self.depth = 0  # nesting of stop_on_signals()
        self.previous: dict[int, Any] = {}  # the handlers replaced, restored at the end
        self.held = 0  # nesting of deferred() (and of a fork in progress)
        self.signum: int | None = None  # the signal that stops the run
        self.at_fork = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            # the second signal: the default action (termination), now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if not self.held:
            raise Interrupted(signum)

    def check(self) -> None:
        """At a point where stopping is safe: raise the stop a signal asked for. Usually
        the handler has raised it already; but Python drops an exception raised where it
        cannot propagate (a fork callback, a __del__), and deferred() holds it back."""
        if self.signum is not None and not self.held:
            raise Interrupted(self.signum)

    def before_fork(self) -> None:
        # The parent runs Python's fork callbacks (logging's lock release among them)
        # with the signal held, so that it is not raised, and dropped, inside one.
        if self.depth:
            self.held += 1

    def after_fork_in_parent(self) -> None:
        if self.depth:
            self.held -= 1

    def after_fork_in_child(self) -> None:
        # A data-loader worker: torch's handlers and the defaults, not ours.
        if self.depth:
            with contextlib.suppress(ValueError):
                for signum, previous in self.previous.items():
                    signal.signal(signum, previous)
            self.depth, self.previous = 0, {}
            self.reset()

    def reset(self) -> None:
        self.held, self.signum = 0, None

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """A signal that comes within the block waits for the next `check()`."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1


_handlers = _Handlers()


def _is_default(signum: int, handler: Any) -> bool:
    if signum == signal.SIGINT:
        return handler is signal.default_int_handler
    return handler == signal.SIG_DFL


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` in the main thread within the block.

    Nests (the outermost block installs and restores); outside the main thread, or where
    a handler other than the default is installed, that signal is left as it is.
    """
    state = _handlers
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if state.depth == 0:
        state.reset()
        state.previous = {}
        for signum in SIGNALS:
            current = signal.getsignal(signum)
            if _is_default(signum, current):
                state.previous[signum] = current
                signal.signal(signum, state.handle)
        if not state.at_fork and hasattr(os, "register_at_fork"):
            os.register_at_fork(
                before=state.before_fork,
                after_in_parent=state.after_fork_in_parent,
                after_in_child=state.after_fork_in_child,
            )
            state.at_fork = True
    state.depth += 1
    try:
        yield
    finally:
        state.depth -= 1
        if state.depth == 0:
            for signum, previous in state.previous.items():
                signal.signal(signum, previous)
            state.previous = {}
            state.reset()


def check() -> None:
    """Raise `Interrupted` if a signal asked the run to stop (see `_Handlers.check`)."""
    _handlers.check()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back until the block has run: a checkpoint and its metrics
    row are written together. A signal that came meanwhile is raised at the end."""
    state = _handlers
    if not state.previous or threading.current_thread() is not threading.main_thread():
        yield
        return
    with state.holding():
        yield
    state.check()


@contextlib.contextmanager
def loader_batches(loader: Iterable) -> Iterator[Iterator]:
    """`iter(loader)` for the block; a DataLoader's worker processes are shut down (joined,
    killed after torch's timeout) when the block ends, however it ends."""
    batches = iter(loader)
    try:
        yield _checked(batches)
    finally:
        # torch's own shutdown (what the iterator's __del__ calls): long-standing, private
        shutdown = getattr(batches, "_shutdown_workers", None)
        if callable(shutdown):
            with _handlers.holding():
                shutdown()
        del batches


def _checked(batches: Iterator) -> Iterator:
    """The batches, with `check()` before each: a stop never waits more than a step."""
    for batch in batches:
        _handlers.check()
        yield batch


def checkpoint_epoch(run: Path) -> tuple[int, str | None] | None:
    """(epoch, stage) of the checkpoint in `run` (None: no readable checkpoint)."""
    try:
        state = json.loads((Path(run) / CHECKPOINT_DIR / STATE_FILE).read_text())
        return int(state["epoch"]), state.get("stage")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resume_line(run: Path, command: str, signum: int) -> str:
    """The one line an interrupted run prints: where it stopped, how to continue."""
    head = f"vitrieval-train {command}: stopped by {SIGNAL_NAMES.get(signum, signum)}"
    saved = checkpoint_epoch(run)
    if saved is None:
        return (
            f"{head} before its first checkpoint: nothing to resume, the same command starts over"
        )
    epoch, stage = saved
    what = f"{stage} epoch {epoch}" if stage and stage != "pretrain" else f"epoch {epoch}"
    again = os.environ.get(RESUME_COMMAND_ENV, "").strip()
    again = again or f"vitrieval-train {command} --out {shlex.quote(str(run))} --resume"
    return f"{head}; {run} holds the checkpoint of {what}: `{again}` continues it"


@contextlib.contextmanager
def stoppable(run: Path, command: str) -> Iterator[None]:
    """A training run `vitrieval-train {command} --out run` as a block: SIGINT and SIGTERM
    stop it (`stop_on_signals`), and on the way out one line says where to resume. The
    KeyboardInterrupt goes on with that line (`message`), `signum` and `reported` set;
    nested blocks report once."""
    with stop_on_signals():
        try:
            yield
        except KeyboardInterrupt as exc:
            if getattr(exc, "reported", False):
                raise
            exc.signum = getattr(exc, "signum", int(signal.SIGINT))  # type: ignore[attr-defined]
            line = resume_line(Path(run), command, exc.signum)  # type: ignore[attr-defined]
            # a progress bar may hold the terminal's line: start a fresh one
            clear = "\r\033[K" if sys.stderr.isatty() else ""
            print(clear + line, file=sys.stderr, flush=True)
            exc.message, exc.reported = line, True  # type: ignore[attr-defined]
            raise


def exit_status(command: str, exc: KeyboardInterrupt) -> int:
    """For the command line's `except KeyboardInterrupt`: print one line unless the run
    already did, and return 128 + the signal number (130 Ctrl-C, 143 SIGTERM)."""
    if not getattr(exc, "reported", False):
        print(f"vitrieval-train {command}: interrupted", file=sys.stderr, flush=True)
    return 128 + int(getattr(exc, "signum", signal.SIGINT))
