"""The one exception the index store raises, and a helper that turns FAISS errors into it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path


class StoreError(RuntimeError):
    """Every user-facing failure of the index store, as one clear sentence.

    Callers (the CLI, the service) catch this one type and show its message; anything
    else escaping the store is a bug. The message may name the index's folder and the
    commands to run on it: the command line's user owns the machine. `public`, when
    given, says the same to a client of the HTTP service, who does not: no server path
    (a command to run calls the folder INDEX). The service logs the message and answers
    `public` (service.errors.store_error).
    """

    def __init__(self, message: str, *, public: str | None = None) -> None:
        super().__init__(message)
        self.public = public


class KeyExistsError(StoreError):
    """add() met keys that are already live and was not asked to replace them."""


_FAISS_LOCATION = re.compile(r" at \S+:\d+: (.*)", re.S)
_FAISS_ASSERT = re.compile(r"Error: '.*?' failed: (.*)", re.S)


def faiss_reason(exc: BaseException) -> str:
    """The human part of a FAISS C++ exception message, without file names and line numbers.

    FAISS reports e.g. "Error in void faiss::Clustering::train_encoded(...) at
    /project/faiss/Clustering.cpp:66: Error: 'nx >= k' failed: Number of training points
    (5) should be at least as large as number of clusters (16)"; users need only the last
    clause.
    """
    text = str(exc).strip()
    located = _FAISS_LOCATION.search(text)
    if located:
        text = located.group(1)
    asserted = _FAISS_ASSERT.match(text)
    if asserted:
        text = asserted.group(1)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


class FolderNotEmptyError(StoreError):
    """A new store was asked for in a folder that holds other files (`held`, by name)."""

    def __init__(self, directory: Path, held: Sequence[str]) -> None:
        self.directory, self.held = directory, list(held)
        super().__init__(
            f"{directory} is not empty (it holds {held_names(self.held)}); "
            "pass overwrite=True to replace it"
        )


def held_names(names: Sequence[str], most: int = 3) -> str:
    """`names` for a message: the first `most` of them, then how many more."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


class DamagedIndexError(StoreError):
    """A segment failed verification: the index answers searches without it but takes
    no changes until restored."""


class ScrubStopped(Exception):
    """A paced verification was asked to stop (not an error of the index)."""


class WriterLockTimeout(StoreError):
    """Another process held the folder's writer lock (.lock) longer than a save or a
    merge waits for it: nothing was written; try again later."""
